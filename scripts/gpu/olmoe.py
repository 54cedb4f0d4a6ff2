"""Question: on a lent H200, what do full-size OLMoE-1B-7B steps cost in memory and time, with Sonar?

The prepared GPU script: bf16, the OLMoE-1B-7B configuration (hidden 2048, expert intermediate 1024,
64 experts, top-8, 16 layers, 16 heads, vocab 50304; 6.44B expert parameters, 12.9 GB of bf16 expert
gradients) with random weights (`from_config`: weight values change neither memory nor speed), batch 2,
seq 256. Arms run one after another (a 7B model with AdamW state is ~55 GB): standard,
standard_no_expert_clip, sonar with eager hooks, sonar compiled (the pass); `--compiled-standard` adds
the compiled baseline; `--experts-kernel sonicmoe|scattermoe|torch` computes the experts with that
kernel backend in every arm (the paper's numbers use SonicMoE; the default is transformers' own
grouped_mm). Reported: `max_memory_allocated` / `max_memory_reserved` over one step after warm-up,
and the median step time over the steps after it (`sonar_fx.measure`; the arms do not fit side by
side, so each runs its rounds alone and "× standard" is a ratio of medians, not of paired rounds).
`--device cpu --tiny` is the smoke mode a test runs (same code path, a tiny config on CPU, results
under results/gpu_smoke).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.arms import COMPILED, Arm
from benchmarks.common import Table
from sonar_fx.config import AdamWConfig
from sonar_fx.environment import Environment
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.experts.kernels import BACKENDS, use_kernel_backend
from sonar_fx.measure import ArmResult, Spread, measure_arm, run_rounds, short_error
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.planner.models import PRESETS

SCRIPT = "gpu"
"""Results name (results/gpu/; the smoke mode writes gpu_smoke)."""
MODULE = "scripts.gpu.olmoe"
GIB = 2**30

OLMOE_1B_7B: dict[str, Any] = {**PRESETS["olmoe-1b-7b"].fields, "max_position_embeddings": 4096}
"""The planner's OLMoE-1B-7B preset: the run and its plan build one configuration."""
TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, vocab_size=512, max_position_embeddings=512,
    pad_token_id=1, eos_token_id=2,  # OLMoE's defaults (50279) lie outside the tiny vocabulary
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    device: str = "cuda"
    tiny: bool = False
    """The smoke configuration (`TINY`) instead of OLMoE-1B-7B."""
    batch: int = 2
    seq: int = 256
    warmup: int = 3
    """Untimed steps (the first compiles), then one memory step, then the timed steps."""
    steps: int = 10
    arms: tuple[Arm, ...] = (
        Arm(method="standard"),
        Arm(method="standard_no_expert_clip"),
        Arm(method="sonar"),
        Arm(method="sonar", execution=COMPILED),
    )
    opt: AdamWConfig = field(default_factory=lambda: AdamWConfig(lr=2e-5, max_grad_norm=1.0))
    clip_all_arms: tuple[Arm, ...] = ()
    """Arms run with one global clip over every parameter (`expert_clip="global"`), as standard clips:
    the deferred schedule's exact clip, whose cost is one more weight-gradient GEMM per expert tensor."""
    experts_kernel: str = "default"
    """Expert kernel backend of every arm (`sonar_fx.experts.kernels.BACKENDS`), or transformers' own."""


def build(cfg: Config) -> nn.Module:
    import transformers

    config = transformers.OlmoeConfig(**(TINY if cfg.tiny else OLMOE_1B_7B))
    # Built on the device directly: materialising 6.9B parameters on the host first takes minutes.
    with torch.device(cfg.device):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if cfg.experts_kernel != "default":
        use_kernel_backend(model, cfg.experts_kernel)
    return model


def batches(cfg: Config, vocab: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (cfg.batch, cfg.seq), generator=g).to(cfg.device)
        out.append({"input_ids": ids, "labels": ids})
    return out


def measure(arm: Arm, cfg: Config, opt: AdamWConfig, label: str) -> dict[str, Any]:
    """Build one arm, warm it up, measure one step's memory, time the next `cfg.steps` steps."""
    model = build(cfg)
    grads = ExpertGradBytes.of(ExpertSet.discover(model).layers)
    method = arm.build(model, opt)
    vocab = (TINY if cfg.tiny else OLMOE_1B_7B)["vocab_size"]
    data = batches(cfg, vocab, cfg.warmup + 1 + cfg.steps)
    # One arm at a time (a 7B model with AdamW state is ~55 GB): rounds of one, so no pairing.
    result = measure_arm(ArmResult(label=label), method.train_step, data[: cfg.warmup], data[cfg.warmup],
                         device=cfg.device)  # fmt: skip
    run_rounds([(result, method.train_step)], data[cfg.warmup + 1 :])
    if result.error is not None:
        raise RuntimeError(result.error)
    report = method.optimizer.report() if isinstance(method.optimizer, SonarOptimizer) else {}
    return {
        "arm": label,
        "warmup_s": result.warmup_s,
        "peak_step_bytes": result.peak_bytes,
        "max_allocated_bytes": result.allocated_bytes,
        "max_reserved_bytes": result.reserved_bytes,
        "step_s": result.step_s,
        "predicted_saving_bytes": grads.predicted_saving,
        "expert_grad_bytes": grads.total,
        "updates_in_graph": report.get("updates_in_graph"),
        "updates_by_hook": report.get("updates_by_hook"),
        "fallbacks": report.get("fallbacks", []),
    }


def run(cfg: Config) -> list[dict[str, Any]]:
    records = []
    clip_all = replace(cfg.opt, expert_clip="global")
    runs = [(a, cfg.opt, a.label) for a in cfg.arms]
    runs += [(a, clip_all, f"{a.label} (clip all)") for a in cfg.clip_all_arms]
    for arm, opt, label in runs:
        print(f"  {label}", flush=True)
        try:
            records.append(measure(arm, cfg, opt, label))
        except Exception as err:  # reported in the table; the other arms still run
            records.append({"arm": label, "error": short_error(err)})
        torch._dynamo.reset()
        gc.collect()
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return records


def table(records: list[dict[str, Any]], cfg: Config) -> Table:
    gib = "MiB" if cfg.tiny else "GiB"
    unit = 2**20 if cfg.tiny else GIB
    base = next((r for r in records if r["arm"] == "standard · eager" and "error" not in r), None)
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["arm"], f"failed: {r['error']}", *["-"] * 6])
            continue
        rows.append(_row(r, base, unit))
    headers = [
        "arm", f"max allocated {gib}", f"max reserved {gib}", f"step peak above start {gib}",
        "saved/predicted", "step ms", "× standard", "expert updates (all steps)",
    ]  # fmt: skip
    shape = "tiny smoke config" if cfg.tiny else "OLMoE-1B-7B shapes, random weights"
    note = (
        f"{shape}, bf16, batch {cfg.batch}, seq {cfg.seq}, experts kernel {cfg.experts_kernel}; "
        f"step ms: median [IQR] of {cfg.steps} steps; × standard: ratio of medians (arms run one after "
        "another)."
    )
    return Table(title="Full-size OLMoE on one GPU", headers=headers, rows=rows, note=note)


def _row(r: dict[str, Any], base: dict[str, Any] | None, unit: int) -> list[str]:
    def size(nbytes: int | None) -> str:
        return "-" if nbytes is None else f"{nbytes / unit:.2f}"

    saved, x_std, paths = "-", "-", "-"
    if r["updates_in_graph"] is not None:
        paths = f"{r['updates_in_graph']} graph / {r['updates_by_hook']} hook"
    if base is not None and r is not base:
        saved = f"{(base['peak_step_bytes'] - r['peak_step_bytes']) / r['predicted_saving_bytes']:.0%}"
        # Arms ran one after another: a ratio of medians, not of paired rounds.
        x_std = f"{Spread.of(r['step_s']).median / Spread.of(base['step_s']).median:.2f}x"
    return [
        r["arm"], size(r["max_allocated_bytes"]), size(r["max_reserved_bytes"]), size(r["peak_step_bytes"]),
        saved, Spread.of([t * 1e3 for t in r["step_s"]]).fmt(1), x_std,
        paths,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = common.parser(MODULE, __doc__)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: the smoke mode)")
    p.add_argument("--tiny", action="store_true", help="a tiny OLMoE config instead of OLMoE-1B-7B")
    p.add_argument("--compiled-standard", action="store_true", help="add the compiled standard arm")
    p.add_argument(
        "--deferred",
        action="store_true",
        help="add the deferred schedule with one clip over every parameter, eager and compiled "
        "(the same clip as standard: its time against standard is the extra weight-gradient GEMMs' cost)",
    )
    p.add_argument(
        "--compiler",
        choices=["inductor", "aot_eager"],
        default="inductor",
        help="backend of the compiled arms (aot_eager: the same pass without codegen, for a fast smoke run)",
    )
    p.add_argument(
        "--experts-kernel",
        choices=["default", *BACKENDS],
        default="default",
        help="expert kernel backend of every arm (default: transformers' grouped_mm)",
    )
    args = p.parse_args(argv)
    common.setup(args)
    cfg = Config(device=args.device, tiny=args.tiny, experts_kernel=args.experts_kernel)
    if args.quick:
        cfg = replace(cfg, warmup=2, steps=5)
    if args.tiny:
        cfg = replace(cfg, seq=32, warmup=1, steps=2)  # a smoke run: the code path, not the numbers
    if args.compiled_standard:
        cfg = replace(cfg, arms=(*cfg.arms, Arm(method="standard", execution=COMPILED)))
    if args.deferred:
        cfg = replace(
            cfg,
            clip_all_arms=(Arm(method="sonar_deferred"), Arm(method="sonar_deferred", execution=COMPILED)),
        )
    cfg = replace(
        cfg,
        arms=tuple(a.under(args.compiler) for a in cfg.arms),
        clip_all_arms=tuple(a.under(args.compiler) for a in cfg.clip_all_arms),
    )
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "scripts.gpu.olmoe: no CUDA device here; run with --device cpu --tiny for the smoke mode."
        )
    inv = common.Invocation(
        script=f"{SCRIPT}_smoke" if cfg.tiny else SCRIPT, command=common.command(MODULE, argv), args=args,
        cfg=cfg, env=Environment.now(cfg.device),
    )  # fmt: skip
    records = run(cfg)
    inv.finish([table(records, cfg)], records=records)


if __name__ == "__main__":
    main()
