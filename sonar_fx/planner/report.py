"""`sonar-fx plan`: the planner's command line, its table, JSON and bar chart.

For: turning flags into one `sonar_fx.plan` call and a `Plan` into text a user reads (one row per
method: peak, its split by category, the saving against standard and against Sonar's prediction,
and with --budget the largest batch that fits), one JSON object (--json) or a PNG (--plot).
Bad input exits 2 with one line naming the flag and the fix. Never: compute a number itself; every
figure shown is the plan's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabulate import tabulate

from sonar_fx.config import STATE_BITS, AdamWConfig, ConfigFieldError
from sonar_fx.planner.device import GPUS
from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.kernels import KERNELS
from sonar_fx.planner.models import PRESETS
from sonar_fx.planner.parallel import PARALLEL
from sonar_fx.planner.planning import DEFAULT_METHODS, DEVICES, MethodPlan, Plan, plan
from sonar_fx.planner.run import PLAN_METHODS
from sonar_fx.planner.tracker import CATEGORIES

GB = 1e9
"""Tables show GB of 1e9 bytes, the unit of the paper's figures."""


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """Flags of `sonar-fx plan`."""
    add = p.add_argument
    add(
        "--model",
        default="olmoe-1b-7b",
        help=f"a preset ({', '.join(PRESETS)}), a tiny model name, or a local directory with a config.json",
    )
    add("--batch", type=int, default=2, help="sequences per step")
    add("--seq", type=int, default=256, help="tokens per sequence")
    add("--dtype", default="bf16", help="bf16 or fp32: weights, gradients and optimizer states")
    add(
        "--methods",
        nargs="+",
        default=None,
        choices=tuple(PLAN_METHODS),
        metavar="METHOD",
        help=f"methods to plan (default: {' '.join(DEFAULT_METHODS)}, less oib_all with --parallel, which "
        "no distributed engine runs; also: "
        f"{', '.join(m for m in PLAN_METHODS if m not in DEFAULT_METHODS)})",
    )
    add(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches of --batch sequences per optimizer step (gradient accumulation)",
    )
    add(
        "--gradient-checkpointing",
        action="store_true",
        help="transformers activation_checkpointing_enable() (gradient checkpointing)",
    )
    add("--state-bits", type=int, choices=STATE_BITS, default=32, help="bits of the expert tensors' moments")
    add(
        "--dense-state-bits",
        type=int,
        choices=STATE_BITS,
        default=32,
        help="bits of the dense tensors' moments",
    )
    add("--max-grad-norm", type=float, default=1.0, help="clip threshold (standard clips all gradients)")
    add(
        "--budget",
        default=None,
        help="memory budget, e.g. 46GiB or 48GB, or auto (this machine's free CUDA memory): the largest "
        "batch that fits, per method, and for sonar_deferred_global_clip the largest keep budget that fits",
    )
    add(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="the device's allocator and kernels (cuda: the caching allocator's blocks; cpu: exact bytes and "
        "the CPU kernels' scratch)",
    )
    add(
        "--kernels",
        choices=tuple(KERNELS),
        default="torch",
        help="expert kernels modelled (torch: transformers' default grouped GEMM; scattermoe; sonicmoe)",
    )
    add(
        "--gpu",
        choices=tuple(GPUS),
        default=None,
        help="plan for this card: its usable memory is the budget (fits, largest batch per method)",
    )
    add(
        "--parallel",
        choices=PARALLEL,
        default=None,
        help="plan one rank of a run on this engine (ddp: whole model per rank; ep: E/world experts per "
        "rank; fsdp2: FSDP2's own step, rank 0 of --world on a fake process group); every figure is per rank",
    )
    add("--world", type=int, default=1, metavar="N", help="ranks of the --parallel run (each with --batch)")
    add("--json", action="store_true", help="print one JSON object instead of the table")
    add("--plot", type=Path, default=None, metavar="PNG", help="also write a bar chart of the peaks here")


def plan_command(args: argparse.Namespace) -> int:
    """`sonar-fx plan`: 0 with the plan printed; 2 for bad input (one line on stderr)."""
    try:
        cfg = AdamWConfig(state_bits=args.state_bits, dense_state_bits=args.dense_state_bits,
                          max_grad_norm=args.max_grad_norm)  # fmt: skip
        result = plan(
            args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, opt_cfg=cfg, methods=args.methods,
            device=args.device, gradient_checkpointing=args.gradient_checkpointing, budget=args.budget,
            grad_accum=args.grad_accum, kernels=args.kernels, gpu=args.gpu, parallel=args.parallel,
            world=args.world,
        )  # fmt: skip
    except (PlanError, ConfigFieldError) as err:
        print(f"sonar-fx plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else format_plan(result))
    if args.plot is not None and not plot_plan(result, args.plot):
        print("sonar-fx plan: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
    return 0


def format_plan(p: Plan) -> str:
    """The plan as a table with a header and notes (GB of 1e9 bytes; MB for models under 1 GB)."""
    unit, scale = ("GB", 1e9) if max(m.peak_allocated_bytes for m in p.methods) >= 1e9 else ("MB", 1e6)
    predicted = p.expert_grad.predicted_saving
    headers = ["method", f"peak {unit}", *(c.replace("_", " ") for c in CATEGORIES), "saving vs standard",
               "saving / predicted"]  # fmt: skip
    headers += ["fits", "max batch"] if p.budget_bytes is not None else []
    deferred = any(m.kept_operand_bytes is not None for m in p.methods)
    if deferred:
        headers.insert(len(CATEGORIES) + 2, "kept operands")
    rows = []
    for m in p.methods:
        saving = m.saving_bytes if m.method != "standard" else None
        row = [
            m.method,
            f"{m.peak_allocated_bytes / scale:.2f}",
            *(f"{m.categories[c] / scale:.2f}" for c in CATEGORIES),
        ]
        if deferred:
            row.append("-" if m.kept_operand_bytes is None else f"{m.kept_operand_bytes / scale:.2f}")
        expected = predicted - (m.kept_operand_bytes or 0)  # the deferred schedule keeps its operands
        row += (
            [f"{saving / scale:.2f} {unit}", f"{saving / expected:.0%}" if expected > 0 else "-"]
            if saving is not None
            else ["-", "-"]
        )
        if p.budget_bytes is not None:
            row.append("yes" if m.fits else "no")
            row.append(
                str(m.max_batch) if m.max_batch else f"none (batch 1: {m.batch_peaks[1] / scale:.1f} {unit})"
            )
        rows.append(row)
    bits = p.optimizer.get("state_bits", 32), p.optimizer.get("dense_state_bits", 32)
    budget = f"; budget {p.budget_bytes / scale:.2f} {unit}" if p.budget_bytes is not None else ""
    if p.gpu is not None:
        g = p.gpu
        budget = f"; {g.product}: usable {g.usable_bytes / scale:.2f} {unit} of {g.total_bytes / scale:.2f}"
    accum = f" x {p.grad_accum} micro-batches" if p.grad_accum > 1 else ""
    experts = ", E/world experts per rank" if p.parallel == "ep" else ""
    rank = (
        f"; rank 0 of {p.world} (fsdp2: FSDP2's own step, the rank's shards)" if p.parallel == "fsdp2"
        else f"; one rank of {p.world} ({p.parallel}: DDP's buckets among gradients{experts})" if p.parallel
        else ""
    )  # fmt: skip
    return "\n".join([
        f"{p.model}: batch {p.batch} x seq {p.seq}{accum}, {p.dtype}, {p.optimizer['optimizer']} "
        f"(expert states {bits[0]}-bit, dense {bits[1]}-bit), gradient checkpointing "
        f"{'on' if p.gradient_checkpointing else 'off'}, {p.device}, {p.kernels} kernels{budget}{rank}",
        tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True),
        "Peak allocated bytes of training step 2 (optimizer states alive), split by what is alive at the "
        f"peak; {unit} = {scale:.0e} bytes. Predicted saving: expert gradients "
        f"{p.expert_grad.total / scale:.2f} {unit} minus one layer "
        f"{p.expert_grad.one_layer / scale:.2f} {unit} = {predicted / scale:.2f} {unit}"
        + (", less its kept operands for sonar_deferred (bytes among activations and temporaries)."
           if deferred else "."),
        f"Planned: {p.execution}, on fake tensors in {p.seconds:.0f} s ({p.cpu_seconds:.0f} s of CPU).",
        "",
        format_modes(p, unit, scale),
        *([format_crossover(p)] if p.crossover is not None else []),
        *([format_gpu(p)] if p.gpu is not None else []),
        *(format_norm_pass(p, m) for m in p.methods if m.extra_gemm_flops is not None),
        *(format_keep(p, m) for m in p.methods if m.keep is not None),
    ])  # fmt: skip


def format_gpu(p: Plan) -> str:
    """What `--gpu` assumed of the card."""
    g = p.gpu
    assert g is not None
    return (
        f"{g.product}: {g.total_bytes / 1e9:.2f} GB; usable {g.usable_bytes / 1e9:.2f} GB = total less 1 GiB "
        "(CUDA context, library workspaces) less 5% (the caching allocator's reserve beyond the allocated "
        "peak). fits: the asked batch's peak is within it; max batch: the largest that is."
    )


def format_norm_pass(p: Plan, m: MethodPlan) -> str:
    """The deferred all-parameter clip's extra weight-gradient GEMMs, and their time on `--gpu`."""
    assert m.extra_gemm_flops is not None
    ms = p.extra_gemm_ms(m)
    time = (
        f", {ms:.2f} ms per step on a {p.gpu.product} at its {p.gpu.bf16_tflops:g} dense bf16 TFLOPS "
        f"({p.gpu.source}; a floor: grouped GEMMs run below peak)"
        if ms is not None and p.gpu is not None
        else " (--gpu gives its time)"
    )
    share = f" (recomputed share {m.recomputed_share:.2f})" if m.recomputed_share is not None else ""
    return (
        f"{m.method}: one more weight-gradient GEMM per expert tensor per step (2 x routed slots x in x out "
        f"each, summed) = {m.extra_gemm_flops / 1e9:.1f} GFLOP{time}, at keep budget 0{share}."
    )


def format_keep(p: Plan, m: MethodPlan) -> str:
    """The largest keep budget whose step fits the memory budget, what it keeps and what is left."""
    k = m.keep
    assert k is not None and p.budget_bytes is not None
    flops = "" if k.extra_gemm_flops is None else f" = {k.extra_gemm_flops / 1e9:.3g} GFLOP per step"
    ms = p.gpu.gemm_ms(k.extra_gemm_flops) if p.gpu is not None and k.extra_gemm_flops is not None else None
    time = f" ({ms:.2f} ms on a {p.gpu.product}, a floor)" if ms is not None and p.gpu is not None else ""
    if not k.fits:
        return (
            f"{m.method}: keep budget 0: its step needs {_size(k.peak_allocated_bytes)} with nothing kept, "
            f"over the budget of {_size(p.budget_bytes)}."
        )
    held = f"; {_size(k.held_bytes)} held past the crossover count against it" if k.held_bytes else ""
    return (
        f"{m.method}: keep budget {_size(k.budget_bytes)} (keep_budget={k.budget_bytes}), the largest whose "
        f"step fits {_size(p.budget_bytes)} (peak {_size(k.peak_allocated_bytes)}; {k.probes} planned "
        f"steps): {len(k.kept)} of {k.tensors} expert gradients kept ({_size(k.kept_bytes)}){held}; "
        f"recomputed share {k.recomputed_share:.2f}, extra weight-gradient GEMMs{flops}{time}."
    )


def format_modes(p: Plan, unit: str, scale: float) -> str:
    """ "Which mode when": per method what it trains and its planned peak."""
    rows = [
        [m.method, m.semantics.clip, m.semantics.accumulation, m.semantics.experts_updated,
         f"{m.peak_allocated_bytes / scale:.2f}"]
        for m in p.methods
        if m.semantics is not None
    ]  # fmt: skip
    headers = ["which mode when", "clips", "accumulation", "experts updated", f"peak {unit}"]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def format_crossover(p: Plan) -> str:
    """The deferred schedule's crossover: the batch above which kept operands outgrow gradients, and
    what it holds against the keep budget."""
    c = p.crossover
    assert c is not None
    accum = f" x {c.grad_accum} micro-batches" if c.grad_accum > 1 else ""
    tensors = ", ".join(f"{t.name} {t.batch}" for t in c.tensors)
    return (
        f"Deferred crossover (top-{c.top_k}, seq {c.seq}{accum}): the step keeps "
        f"{_size(c.layer_operand_bytes_per_token * c.seq)} of operands per layer and sequence, against "
        f"{_size(c.layer_grad_bytes)} of expert gradients per layer: the operands outgrow them above batch "
        f"{c.layer_batch:.1f}. Per tensor, sonar_deferred keeps the gradient instead (as standard does) "
        f"from batch: {tensors}. Such a gradient is computed once and counts against the keep budget"
        + "".join(
            f"; {m.method} holds {_size(m.held_grad_bytes)} of them at batch {p.batch}"
            for m in p.methods
            if m.held_grad_bytes is not None
        )
        + "."
    )


def _size(nbytes: float) -> str:
    for scale, unit, digits in ((1e9, "GB", 2), (1e6, "MB", 1), (1e3, "kB", 1)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def plot_plan(p: Plan, path: Path) -> bool:
    """Stacked bars of each method's peak by category (and the budget line); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(1.6 * len(p.methods) + 3, 4.5))
    names = [m.method for m in p.methods]
    bottom = [0.0] * len(names)
    for c in CATEGORIES:
        heights = [m.categories[c] / GB for m in p.methods]
        ax.bar(names, heights, bottom=bottom, label=c.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if p.budget_bytes is not None:
        ax.axhline(p.budget_bytes / GB, color="black", ls="--", lw=1, label="budget")
    ax.set(ylabel="peak allocated, GB", title=f"{p.model}: batch {p.batch} x seq {p.seq}, {p.dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
