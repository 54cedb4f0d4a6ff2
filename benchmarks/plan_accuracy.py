"""Question: how close is `sonar-fx plan` (a step on fake tensors) to a measured step, and to the paper?

Two checks of `sonar_fx.plan`:
- on this machine: for each configuration (family x batch x checkpointing x state bits x dtype, at
  shapes that step on CPU in seconds), the plan's peak against the same step measured on real CPU
  tensors (`sonar_fx.memory.measure_peak`, the profiler's allocator events: bytes above the step's
  start). Both count the same thing: the plan's peak minus its step-start bytes is the transient the
  profiler sees; the absolute peak adds the bytes alive at the start (weights, optimizer states, the
  batch), counted on the real tensors for the measured side;
- against the paper's GPU peaks (bf16, batch 2, plan at seq 256, OLMoE-1B-7B and
  Granite-3.1-3B-A800M at full size, CUDA's allocator blocks, SonicMoE kernels), and the paper's OLMoE
  batch sweep.
The CPU cases plan transformers' default kernels on the CPU (`--device cpu`: exact bytes, the CPU
kernels' scratch), as they run here; the paper's rows are planned as the paper ran them: on CUDA
(`--device cuda`: the caching allocator's blocks, no CPU-only scratch) with SonicMoE's kernels
(`--kernels sonicmoe`). docs/plan.md holds the full tables (written by this script between its
markers: the CPU cases' section and the paper's); results.json the short ones and every record.
`--cases none` plans the paper's rows only (a few minutes) and rewrites only the paper's section.
`--real-size` plans and measures real layer shapes instead (`benchmarks.plan_real_size`: OLMoE-1B-7B's
dimensions with 2 layers, Granite-3.1-1B-A400M whole; bf16, batch 1 and 2, seq 256; 13.1 GiB of
resident memory at most, 40 minutes on 2 busy cores) and writes results/plan_accuracy_real_size.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages

from benchmarks import common, plan_real_size
from benchmarks.common import Goal, Invocation, Table, grade
from benchmarks.goals import GOALS
from sonar_fx.config import AdamWConfig
from sonar_fx.memory import measure_peak, process_peak_rss_bytes
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.models.tiny import BYTE_VOCAB, tiny_config
from sonar_fx.planner import Plan, plan
from sonar_fx.planner.run import enable_checkpointing
from sonar_fx.workload import random_batches

SCRIPT = "plan_accuracy"
DOC = Path("docs/plan.md")
START, END = "<!-- plan_accuracy:start -->", "<!-- plan_accuracy:end -->"
PAPER_START, PAPER_END = "<!-- plan_accuracy:paper:start -->", "<!-- plan_accuracy:paper:end -->"
PAPER_KERNELS = "sonicmoe"
"""The expert kernels the paper ran (DESIGN.md 1), planned for its rows."""
GB, MIB = 1e9, 2**20
OLMOE, GRANITE = "olmoe-1b-7b", "granite-3.1-3b-a800m"


@dataclass(frozen=True, kw_only=True)
class Family:
    """A CPU-sized model of one transformers MoE family (its real classes, fewer and narrower layers)."""

    base: str
    """`sonar_fx.models.TINY_MODELS` entry."""
    overrides: dict[str, Any]


FAMILIES = {
    "olmoe": Family(base="tiny-olmoe", overrides=dict(
        num_experts=64, num_experts_per_tok=8, hidden_size=384, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=6)),
    "granitemoe": Family(base="tiny-granitemoe", overrides=dict(
        num_local_experts=40, num_experts_per_tok=8, hidden_size=512, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)),
    "qwen3moe": Family(base="tiny-qwen3moe", overrides=dict(
        num_experts=32, num_experts_per_tok=4, hidden_size=256, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "olmoe-1b-7b-2l": Family(base="tiny-olmoe", overrides=plan_real_size.OLMOE_2L),
    "granite-3.1-1b-a400m": Family(base="tiny-granitemoe", overrides=plan_real_size.GRANITE_1B),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Case:
    """One configuration planned and measured on CPU."""

    family: str
    batch: int
    dtype: str = "bf16"
    checkpointing: bool = False
    state_bits: int = 32
    dense_state_bits: int = 32
    seq: int = 64
    grad_accum: int = 1
    """Micro-batches per step (gradients accumulated)."""
    methods: tuple[str, ...] = ()
    """Methods to plan and measure (empty: `Config.methods`)."""

    @property
    def label(self) -> str:
        bits = f"{self.state_bits}/{self.dense_state_bits}"
        accum = f" x{self.grad_accum}" if self.grad_accum > 1 else ""
        return (
            f"{self.family} b{self.batch}{accum} {self.dtype} {'ckpt' if self.checkpointing else '-'} {bits}"
        )


CASES = (
    Case(family="olmoe", batch=2),
    Case(family="olmoe", batch=8),
    Case(family="olmoe", batch=2, checkpointing=True),
    Case(family="olmoe", batch=2, state_bits=8),
    Case(family="olmoe", batch=2, state_bits=8, dense_state_bits=8),
    Case(family="olmoe", batch=4, dtype="fp32", checkpointing=True, state_bits=8),
    Case(family="granitemoe", batch=2),
    Case(family="granitemoe", batch=8, checkpointing=True),
    Case(family="granitemoe", batch=4, state_bits=8),
    Case(family="granitemoe", batch=2, dtype="fp32"),
    Case(family="granitemoe", batch=4, dtype="fp32", checkpointing=True),
    Case(family="qwen3moe", batch=2),
    Case(family="qwen3moe", batch=8),
    Case(family="qwen3moe", batch=2, checkpointing=True, state_bits=8),
    Case(family="qwen3moe", batch=4, dtype="fp32"),
    Case(family="qwen3moe", batch=2, dtype="fp32", checkpointing=True),
)  # fmt: skip
DEFERRED = ("standard", "sonar_deferred")
DEFERRED_CASES = (
    Case(family="olmoe", batch=2, methods=DEFERRED),
    Case(family="olmoe", batch=2, grad_accum=4, methods=DEFERRED),
    Case(family="granitemoe", batch=2, grad_accum=4, methods=DEFERRED),
    Case(family="granitemoe", batch=4, grad_accum=4, methods=DEFERRED),  # down_proj crosses over
)  # fmt: skip
"""The deferred schedule against standard, with accumulation, below and past a tensor's crossover."""
REAL_CASES = tuple(
    Case(family=family, batch=batch, seq=256, methods=plan_real_size.METHODS)
    for family in ("olmoe-1b-7b-2l", "granite-3.1-1b-a400m")
    for batch in (1, 2)
)
"""Real layer shapes (`--real-size`), one model in memory at a time (each record's
`peak_rss`: the process's high-water mark so far)."""


@dataclass(frozen=True, kw_only=True)
class PaperRow:
    """A peak the paper measured on GPU (GB of 1e9 bytes; bf16; batch 2; sequences up to 256 tokens)."""

    model: str
    """`sonar_fx.planner.PRESETS` name."""
    label: str
    method: str
    paper_gb: float
    checkpointing: bool = False
    state_bits: int = 32
    """8: every optimizer state in 8 bits (expert and dense)."""


PAPER_ROWS = (
    PaperRow(model=OLMOE, label="standard (global clip)", method="standard", paper_gb=55.55),
    PaperRow(model=OLMOE, label="standard, dense clip", method="standard_no_expert_clip", paper_gb=55.55),
    PaperRow(model=OLMOE, label="optimizer-in-backward, all parameters", method="oib_all", paper_gb=43.35),
    PaperRow(model=OLMOE, label="sonar", method="sonar", paper_gb=43.57),
    PaperRow(model=OLMOE, label="standard + gradient checkpointing", method="standard", paper_gb=55.48,
             checkpointing=True),
    PaperRow(model=OLMOE, label="sonar + gradient checkpointing", method="sonar", paper_gb=43.23,
             checkpointing=True),
    PaperRow(model=OLMOE, label="8-bit AdamW (all states)", method="standard", paper_gb=41.93, state_bits=8),
    PaperRow(model=OLMOE, label="8-bit AdamW + sonar", method="sonar", paper_gb=29.94, state_bits=8),
    PaperRow(model=GRANITE, label="standard (global clip)", method="standard", paper_gb=26.91),
    PaperRow(model=GRANITE, label="sonar", method="sonar", paper_gb=21.14),
)  # fmt: skip
PAPER_SWEEP = {2: 12.0, 8: 9.4, 16: 5.2, 32: 0.0}
"""The paper's OLMoE-1B-7B saving (standard - sonar peak, GB) by batch size."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    cases: tuple[Case, ...] = CASES + DEFERRED_CASES
    methods: tuple[str, ...] = ("standard", "sonar")
    paper_rows: tuple[PaperRow, ...] = PAPER_ROWS
    sweep: dict[int, float] = field(default_factory=lambda: dict(PAPER_SWEEP))
    paper_seq: int = 256
    sweep_tolerance: float = GOALS["plan_accuracy.sweep"].threshold
    """Goal: each planned saving of the batch sweep within this fraction of the paper's (where the paper
    saved nothing: within this fraction of its batch-2 saving)."""
    tolerance: float = GOALS["plan_accuracy.peak"].threshold
    """Goal: each predicted peak within this fraction of the measured one."""
    saving_tolerance: float = GOALS["plan_accuracy.saving"].threshold
    """Goal: each predicted saving within this fraction of the measured saving."""
    cost_goal_s: float = GOALS["plan_accuracy.cost_s"].threshold
    """Goal: a full-size OLMoE-1B-7B plan of the four default methods takes less."""
    timed_steps: int = 0
    """Steps run after the measured one, timed without the profiler (the real-size step times)."""


QUICK = Config(cases=CASES[:1] + CASES[6:7] + DEFERRED_CASES[1:2], paper_rows=PAPER_ROWS[8:], sweep={})


def measure_case(case: Case, methods: Sequence[str], timed_steps: int = 0) -> list[dict[str, Any]]:
    """Plan `case` on fake CPU tensors, then measure the same step on real ones; one record per method
    (then `timed_steps` more steps, timed)."""
    methods = case.methods or methods
    family, dtype = FAMILIES[case.family], {"bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    bits = dict(state_bits=case.state_bits, dense_state_bits=case.dense_state_bits)
    cfg = AdamWConfig(lr=1e-3, **bits)  # type: ignore[arg-type]
    predicted = plan(
        tiny_config(family.base, **family.overrides),
        batch=case.batch,
        seq=case.seq,
        dtype=dtype,
        opt_cfg=cfg,
        methods=methods,
        device="cpu",
        gradient_checkpointing=case.checkpointing,
        grad_accum=case.grad_accum,
    )
    records = []
    for name in methods:
        mine = predicted.method(name)
        records.append(
            {
                "case": asdict(case),
                "label": case.label,
                "method": name,
                "predicted_transient": mine.transient_bytes,
                "predicted_start": mine.step_start_bytes,
                "predicted_peak": mine.peak_allocated_bytes,
                "categories": mine.categories,
                "predicted_saving_formula": predicted.expert_grad.predicted_saving,
                "plan_seconds": predicted.seconds,
                "predicted_kept": mine.kept_operand_bytes,
                "predicted_crossed": list(mine.crossed_over),
                **_measured_step(case, name, cfg, timed_steps),
            }
        )
        gc.collect()  # the arm's model and states (hooks hold cycles) go before the next is built
    return records


def _measured_step(case: Case, name: str, cfg: AdamWConfig, timed_steps: int) -> dict[str, Any]:
    """Step 2 of `case` with method `name` on real CPU tensors: its transient peak, the bytes alive at
    its start, the deferred schedule's report, and the time of each step after it."""
    family, dtype = FAMILIES[case.family], {"bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    model = build_model(family.base, dtype=dtype, seed=0, **family.overrides).train()
    if case.checkpointing:
        enable_checkpointing(model, case.label)
    method = build_method(name, model, cfg)
    n = (2 + timed_steps) * case.grad_accum
    vocab = int(family.overrides.get("vocab_size", BYTE_VOCAB))  # ids over the model's whole vocabulary
    batches = random_batches(n, vocab=vocab, batch=case.batch, seq=case.seq)
    steps = [batches[i : i + case.grad_accum] for i in range(0, len(batches), case.grad_accum)]
    method.train_step(steps[0])  # creates the optimizer states, as the plan's first step does
    start = _bytes_alive(model, method.optimizers, steps[1])
    began = time.perf_counter()
    _, peak = measure_peak(partial(method.train_step, steps[1]))
    profiled = time.perf_counter() - began
    deferred = getattr(method.optimizer, "deferred", None) if name == "sonar_deferred" else None
    measured = {
        "measured_transient": peak.peak_bytes,
        "measured_start": start,
        "measured_kept": None if deferred is None else deferred.last_peak_bytes,
        "measured_crossed": [] if deferred is None else sorted(deferred.crossed),
    }
    if not timed_steps:
        return measured
    times = []
    for step in steps[2:]:
        began = time.perf_counter()
        method.train_step(step)
        times.append(time.perf_counter() - began)
    return measured | {"step_s": times, "profiled_step_s": profiled, "peak_rss": process_peak_rss_bytes()}


def _bytes_alive(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], batches: list[dict]) -> int:
    """Storage bytes of the weights, buffers, any gradients, every optimizer state (torchao's quantized
    ones through their inner tensors) and the batch, each storage once."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors += [*model.buffers(), *(t for b in batches for t in b.values())]
    storages = {id(st): st.nbytes() for t in tensors for st in get_untyped_storages(t)}
    return sum(storages.values())


def paper_plans(cfg: Config) -> dict[str, Plan]:
    """The plans the paper rows and the sweep need, one `sonar_fx.plan` call per setting."""
    groups: dict[tuple[str, bool, int], list[str]] = {}
    for row in cfg.paper_rows:
        groups.setdefault((row.model, row.checkpointing, row.state_bits), []).append(row.method)
    plans = {}
    for (model, ckpt, bits), methods in groups.items():
        print(f"planning {model} (checkpointing {ckpt}, {bits}-bit states): {', '.join(methods)}", flush=True)
        opt = AdamWConfig(state_bits=bits, dense_state_bits=bits)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = dict(batch=2, seq=cfg.paper_seq, opt_cfg=opt, methods=methods)
        plans[_key(model, ckpt, bits)] = plan(
            model, gradient_checkpointing=ckpt, device="cuda", kernels=PAPER_KERNELS, **kwargs
        )
    for batch in (b for b in cfg.sweep if b != 2):
        print(f"planning olmoe-1b-7b at batch {batch}", flush=True)
        plans[f"sweep-{batch}"] = plan(
            OLMOE, batch=batch, seq=cfg.paper_seq, methods=["standard", "sonar"], device="cuda",
            kernels=PAPER_KERNELS,
        )  # fmt: skip
    return plans


def _key(model: str, checkpointing: bool, bits: int) -> str:
    return f"{model}|ckpt={checkpointing}|bits={bits}"


def accuracy_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case: each method's error and the saving's, as fractions of the measured values."""
    rows = []
    for label in dict.fromkeys(r["label"] for r in records):
        by = {r["method"]: r for r in records if r["label"] == label}
        row: dict[str, Any] = {"label": label}
        for name, r in by.items():
            row[f"{name}_measured"] = r["measured_transient"]
            row[f"{name}_error"] = r["predicted_transient"] / r["measured_transient"] - 1
            row[f"{name}_abs_error"] = (
                (r["predicted_peak"]) / (r["measured_start"] + r["measured_transient"]) - 1
            )
        other = next((m for m in ("sonar", "sonar_deferred") if m in by), None)
        if other == "sonar_deferred":
            r = by[other]
            row.update(predicted_kept=r["predicted_kept"], measured_kept=r["measured_kept"],
                       predicted_crossed=len(r["predicted_crossed"]),
                       measured_crossed=len(r["measured_crossed"]))  # fmt: skip
        if "standard" in by and other is not None:
            measured = by["standard"]["measured_transient"] - by[other]["measured_transient"]
            predicted = by["standard"]["predicted_transient"] - by[other]["predicted_transient"]
            row.update(
                measured_saving=measured,
                predicted_saving=predicted,
                saving_error=predicted / measured - 1 if measured else None,
            )
        rows.append(row)
    return rows


def accuracy_table(rows: list[dict[str, Any]], methods: Sequence[str], *, deferred: bool = False) -> Table:
    rows = [r for r in rows if all(f"{m}_error" in r for m in methods)]
    headers = ["case (family, batch x micro-batches, dtype, ckpt, expert/dense bits)"]
    for m in methods:
        headers += [f"{m} measured MiB", f"{m} error", f"{m} error (absolute peak)"]
    headers += ["saving measured MiB", "saving predicted MiB", "saving error"]
    headers += (
        ["kept operands planned / measured MiB", "tensors crossed over planned / measured"]
        if deferred
        else []
    )
    body = []
    for r in rows:
        cells = [r["label"]]
        for m in methods:
            cells += [f"{r[f'{m}_measured'] / MIB:.2f}", _pct(r[f"{m}_error"]), _pct(r[f"{m}_abs_error"])]
        cells += [
            f"{r['measured_saving'] / MIB:.2f}",
            f"{r['predicted_saving'] / MIB:.2f}",
            _pct(r["saving_error"]),
        ]
        if deferred:
            cells += [f"{r['predicted_kept'] / MIB:.2f} / {r['measured_kept'] / MIB:.2f}",
                      f"{r['predicted_crossed']} / {r['measured_crossed']}"]  # fmt: skip
        body.append(cells)
    note = (
        "error: predicted / measured - 1 of the step's transient peak (bytes above its start, as the "
        "profiler counts); absolute peak: plus the bytes alive at the start. seq 64, eager, AdamW; bits: "
        "expert/dense moment bits (8: torchao's quantized states)."
    )
    if deferred:
        note += (
            " sonar_deferred, eager: expert gradients computed at step() from operands kept in backward; "
            "saving: standard's peak minus sonar_deferred's; x4: 4 micro-batches per step (accumulated)."
        )
        return Table(title="The deferred schedule: plan vs measured step on CPU", headers=headers, rows=body,
                     note=note)  # fmt: skip
    return Table(title="Plan vs measured step on CPU", headers=headers, rows=body, note=note)


def paper_rows(cfg: Config, plans: dict[str, Plan]) -> list[dict[str, Any]]:
    rows = []
    for row in cfg.paper_rows:
        p = plans[_key(row.model, row.checkpointing, row.state_bits)]
        mine = p.method(row.method)
        rows.append(
            {
                **asdict(row),
                "predicted_gb": mine.peak_allocated_bytes / GB,
                "categories": mine.categories,
                "plan_seconds": p.seconds,
            }
        )
    return rows


def paper_table(rows: list[dict[str, Any]]) -> Table:
    body = [
        [
            r["model"],
            r["label"],
            f"{r['predicted_gb']:.2f}",
            f"{r['paper_gb']:.2f}",
            _pct(r["predicted_gb"] / r["paper_gb"] - 1),
            f"{r['categories']['activations'] / GB:.2f}",
            f"{r['categories']['temporaries'] / GB:.2f}",
        ]
        for r in rows
    ]
    note = (
        "Peak allocated GB (1e9 bytes) of step 2, bf16 weights, gradients and AdamW states, batch 2, seq "
        "256. Plan: --device cuda (the caching allocator's blocks; no CPU kernel's scratch), --kernels "
        "sonicmoe (the adapter's ops on fake tensors and the buffers their bodies allocate), eager, SDPA; "
        "paper: GPU, SonicMoE kernels. 8-bit rows: every state in torchao's 8-bit format."
    )
    return Table(
        title="Plan vs the paper",
        headers=[
            "model",
            "row",
            "plan GB",
            "paper GB",
            "difference",
            "activations at the peak GB",
            "temporaries at the peak GB",
        ],
        rows=body,
        note=note,
    )


def sweep_rows(cfg: Config, plans: dict[str, Plan]) -> list[dict[str, Any]]:
    rows = []
    for batch, paper in cfg.sweep.items():
        p = plans[_key(OLMOE, False, 32)] if batch == 2 else plans[f"sweep-{batch}"]
        std, sonar = p.method("standard"), p.method("sonar")
        rows.append(
            {
                "batch": batch,
                "paper_saving_gb": paper,
                "saving_gb": (std.peak_allocated_bytes - sonar.peak_allocated_bytes) / GB,
                "standard_gb": std.peak_allocated_bytes / GB,
                "sonar_gb": sonar.peak_allocated_bytes / GB,
                "standard_activations_gb": std.categories["activations"] / GB,
                "sonar_activations_gb": sonar.categories["activations"] / GB,
                "standard_gradients_gb": std.categories["gradients"] / GB,
            }
        )
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    body = [
        [
            str(r["batch"]),
            f"{r['standard_gb']:.2f}",
            f"{r['sonar_gb']:.2f}",
            f"{r['saving_gb']:.2f}",
            f"{r['paper_saving_gb']:.1f}",
            f"{r['standard_gradients_gb']:.2f}",
            f"{r['sonar_activations_gb']:.2f}",
        ]
        for r in rows
    ]
    headers = [
        "batch",
        "standard GB",
        "sonar GB",
        "plan saving GB",
        "paper saving GB",
        "gradients alive at standard's peak GB",
        "activations at sonar's peak GB",
    ]
    note = (
        "OLMoE-1B-7B, seq 256, bf16, --device cuda --kernels sonicmoe. Where standard's peak holds every "
        "gradient and sonar's holds its activations, the saving is the gradients less what the "
        "activations add."
    )
    return Table(title="OLMoE-1B-7B saving by batch size", headers=headers, rows=body, note=note)


def goals(
    cfg: Config,
    acc: list[dict[str, Any]],
    paper: list[dict[str, Any]],
    plans: dict[str, Plan],
    sweep: Sequence[dict[str, Any]] = (),
) -> list[Goal]:
    methods = {*cfg.methods, *(m for case in cfg.cases for m in case.methods)}
    errors = [abs(r[f"{m}_error"]) for r in acc for m in methods if f"{m}_error" in r]
    savings = [abs(r["saving_error"]) for r in acc if r.get("saving_error") is not None]
    tol, saving_tol = cfg.tolerance, cfg.saving_tolerance
    out = [
        _worst("plan vs measured peak (CPU)", f"every case within {tol:.0%}", errors, tol),
        _worst("predicted saving vs measured (CPU)", f"within {saving_tol:.0%}", savings, saving_tol),
    ]
    if paper:
        within = [r for r in paper if abs(r["predicted_gb"] / r["paper_gb"] - 1) <= cfg.tolerance]
        out.append(
            Goal(
                name="plan vs paper, batch-2 rows",
                target=f"within {cfg.tolerance:.0%}",
                measured=f"{len(within)} of {len(paper)} rows",
                status=grade(len(within), len(paper), ">="),
            )
        )
    if sweep:
        scale = max(r["paper_saving_gb"] for r in sweep)
        off = [abs(r["saving_gb"] - r["paper_saving_gb"]) / (r["paper_saving_gb"] or scale) for r in sweep]
        out.append(
            Goal(
                name="OLMoE saving by batch vs paper",
                target=f"each within {cfg.sweep_tolerance:.0%}",
                measured=f"{sum(e <= cfg.sweep_tolerance for e in off)} of {len(off)} (worst {max(off):.1%})",
                status=grade(max(off), cfg.sweep_tolerance, "<="),
            )
        )
    full = plans.get(_key(OLMOE, False, 32))
    if full is not None and len(full.methods) >= 4:
        out.append(
            Goal(
                name="OLMoE-1B-7B plan, 4 methods",
                target=f"< {cfg.cost_goal_s:.0f} s",
                measured=f"{full.seconds:.0f} s ({full.cpu_seconds:.0f} s of CPU)",
                status=grade(full.seconds, cfg.cost_goal_s, "<"),
            )
        )
    return out


def cost_table(plans: dict[str, Plan]) -> Table:
    body = [[key.replace("|", ", "), str(p.batch), ", ".join(m.method for m in p.methods), f"{p.seconds:.0f}",
             f"{p.cpu_seconds:.0f}"] for key, p in plans.items()]  # fmt: skip
    headers = ["plan", "batch", "methods", "wall s", "CPU s"]
    note = "Fake tensors do no arithmetic and hold no memory: the time is Python dispatch (and load)."
    return Table(title="What each full-size plan cost", headers=headers, rows=body, note=note)


def _worst(name: str, target: str, errors: list[float], tolerance: float) -> Goal:
    if not errors:
        return Goal(name=name, target=target, measured="no case", status=grade(None, tolerance, "<="))
    worst = max(errors)
    return Goal(
        name=name,
        target=target,
        measured=f"worst {worst:.2%} over {len(errors)}",
        status=grade(worst, tolerance, "<="),
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def plot(acc_records: list[dict[str, Any]], paper: list[dict[str, Any]], path: Path) -> bool:
    """Predicted vs measured (CPU cases) and plan vs paper (bars); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_cpu, ax_paper) = plt.subplots(1, 2, figsize=(12, 4.5))
    if acc_records:
        xs = [r["measured_transient"] / MIB for r in acc_records]
        ys = [r["predicted_transient"] / MIB for r in acc_records]
        ax_cpu.scatter(xs, ys, s=14)
        hi = max(xs + ys) * 1.1
        ax_cpu.plot([0, hi], [0, hi], color="grey", lw=0.8)
        ax_cpu.set(
            xlabel="measured step peak above start, MiB (CPU)",
            ylabel="planned, MiB",
            title="plan vs measured, CPU",
        )
    if paper:
        labels = [
            f"{'Granite' if r['model'].startswith('granite') else 'OLMoE'}: {r['label']}" for r in paper
        ]
        at = range(len(paper))
        ax_paper.barh([i - 0.2 for i in at], [r["predicted_gb"] for r in paper], height=0.4, label="plan")
        ax_paper.barh([i + 0.2 for i in at], [r["paper_gb"] for r in paper], height=0.4, label="paper (GPU)")
        ax_paper.set_yticks(list(at), labels, fontsize=7)
        ax_paper.invert_yaxis()
        ax_paper.set(xlabel="peak allocated GB", title="plan vs the paper (bf16, batch 2)")
        ax_paper.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_doc(
    inv: Invocation[Config],
    tables: list[Table],
    goal_list: list[Goal],
    doc: Path = DOC,
    markers: tuple[str, str] = (START, END),
) -> None:
    """Replace a generated section of docs/plan.md (between `markers`) with this run's tables."""
    if not doc.exists():
        return
    start, end = markers
    parts = [f"`{inv.command}`: {inv.env.line()}"]
    for t in [*tables, *([common.goals_table(goal_list)] if goal_list else [])]:
        parts += [f"**{t.title}**", t.render("github")] + ([t.note] if t.note else [])
    text = doc.read_text()
    section = "\n\n".join(parts)
    new = re.sub(
        f"{re.escape(start)}.*?{re.escape(end)}", lambda _: f"{start}\n{section}\n{end}", text, flags=re.S
    )
    doc.write_text(new)


def measure_cases(cfg: Config) -> list[dict[str, Any]]:
    records = []
    for case in cfg.cases:
        print(
            f"case {case.label}: planning and measuring {', '.join(case.methods or cfg.methods)}", flush=True
        )
        records += measure_case(case, cfg.methods, cfg.timed_steps)
    return records


def real_size(cfg: Config) -> common.Output:
    """`--real-size`: each real-size arm planned and measured, graded against its own case's standard."""
    records = measure_cases(cfg)
    rows = plan_real_size.rows(records)
    return common.Output(
        tables=[plan_real_size.table(rows, cfg.tolerance, cfg.saving_tolerance)],
        goals=plan_real_size.goals(rows, cfg.tolerance, cfg.saving_tolerance),
        records=records,
    )


REAL_SIZE = common.Mode(
    flag="--real-size",
    script=f"{SCRIPT}_real_size",
    question="Question: at real layer shapes, how close is the plan to the measured step (peak, saving)?",
    default=replace(Config(), cases=REAL_CASES, paper_rows=(), sweep={}, timed_steps=1),
    quick=replace(QUICK, cases=REAL_CASES[:1], paper_rows=(), sweep={}, timed_steps=1),
    run=real_size,
)
"""Real layer shapes instead (`--quick`: OLMoE's batch 1 only), no paper rows."""
MODES = [REAL_SIZE]


def main(argv: list[str] | None = None) -> None:
    cases = common.Override(
        field="cases", choices=("none",), help="none: plan the paper's rows only", parse=lambda _: ()
    )
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[cases], modes=MODES)
    cfg = inv.cfg
    if inv.script == REAL_SIZE.script:
        inv.write(REAL_SIZE.run(cfg))
        return
    records = measure_cases(cfg)
    plans = paper_plans(cfg) if cfg.paper_rows else {}
    acc, paper, sweep = accuracy_rows(records), paper_rows(cfg, plans), sweep_rows(cfg, plans)
    goal_list = goals(cfg, acc, paper, plans, sweep)
    cpu = [accuracy_table(acc, cfg.methods)]
    cpu += (
        [accuracy_table(acc, DEFERRED, deferred=True)]
        if any("sonar_deferred_error" in r for r in acc)
        else []
    )
    against_paper = [paper_table(paper)] + ([sweep_table(sweep)] if sweep else [])
    against_paper += [cost_table(plans)] if plans else []
    images = ["plan_accuracy.png"] if plot(records, paper, inv.out / "plan_accuracy.png") else []
    if not inv.args.quick:
        cpu_goals = [g for g in goal_list if "CPU" in g.name]
        if cfg.cases:
            write_doc(inv, cpu, cpu_goals)
        paper_goals = [g for g in goal_list if "CPU" not in g.name]
        write_doc(inv, against_paper, paper_goals, markers=(PAPER_START, PAPER_END))
    inv.finish([paper_table(paper)], goals=goal_list, records=[*records, *paper, *sweep], images=images)


if __name__ == "__main__":
    main()
