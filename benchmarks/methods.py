"""Question (paper Table 1): what does each training method cost in memory and time, eager and compiled?

Every method of `sonar_fx.methods`, and the hand-written expert hooks of PyTorch's tutorial (the eager
hooks' equal-work reference), on CPU models shaped like OLMoE and Granite (`benchmarks.workload`), bf16,
batch 2, in three execution modes: eager (Sonar and oib_all by post-accumulate-grad hooks), the
torch.compile'd model with the same hooks (they fire only after the whole compiled backward, so Sonar's
saving should vanish) and the compiled pass (updates inside the backward graph). Reported: peak step
memory, measured vs predicted saving, step time and its paired ratio vs standard, tokens/s, held-out loss.

The same arms answer neighbouring questions, each an option with its own results folder:
- `--granularity` (paper Table 3): batched (2L) against per-expert (2EL) updates, eager and compiled.
- `--batch-sweep` (paper section 5.5): standard vs Sonar at batch 2 to 32: the saving is a fixed number
  of bytes, so its share of a growing peak falls, as does the time saved.
- `--accumulation` (paper Table 8, and the deferred schedule): A micro-batches per step, clip scope
  "dense" (against standard_no_expert_clip) and "all" (against standard): Sonar updating the experts at
  every micro-batch (another optimizer: see the held-out loss), the deferred schedule (standard's
  semantics at one expert gradient plus the kept operands) and, under "all" at A=1, the in-backward
  exact route (expert_clip="global": forward and backward twice).
- `--deferred` (docs/modes.md): the same arms under the clip over every parameter at A=1 and 4, eager
  and compiled: which path saves, how much, and at what time.
- `--timeline` and `--profile` (`benchmarks.profiles`): live memory through one step; where the time
  of Sonar's update goes beside the same update done the plain way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from benchmarks import common, profiles
from benchmarks.arms import (
    COMPILED,
    EAGER,
    HOOKS_ON_COMPILED,
    Arm,
    ArmResult,
    HandwrittenHooksArm,
    MethodStep,
    Plan,
    by_label,
    run_arms,
)
from benchmarks.common import Goal, Mode, Output, Table, failed, goal, mib
from benchmarks.handwritten import METHOD as HANDWRITTEN
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import fmt_ratio, paired_ratio, ratio
from sonar_fx.methods import METHODS, Execution, Method, TrainingMethod
from sonar_fx.workload import Batch, make_batches

SCRIPT = "methods"
BASELINE = {"dense": "standard_no_expert_clip", "all": "standard"}
"""The accumulation baseline of each clip scope: standard training with the same clip."""
GRANULARITY = (("standard_no_expert_clip", "-"), ("sonar", "batched"), ("sonar_per_expert", "per expert"))


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script (every option: its own defaults, see `MODES`)."""

    shapes: tuple[str, ...] = ("olmoe-cpu", "granite-cpu")
    """Keys of `benchmarks.workload.SHAPES`."""
    workload: Workload = field(default_factory=Workload)
    """Batch 2 x seq 64, bf16 (the micro-batch under --accumulation)."""
    plan: Plan = field(default_factory=lambda: Plan(warmup=2, rounds=20))
    methods: tuple[str, ...] = (*METHODS, HANDWRITTEN)
    executions: tuple[Execution, ...] = (EAGER, HOOKS_ON_COMPILED, COMPILED)
    """Sonar runs in each; every other method once eager and once compiled (the first compiled one)."""
    lr: float = 1e-3
    """Large enough that a randomly initialised model learns visibly in a dozen steps."""
    max_grad_norm: float = 1.0
    """Active on these models (their gradient norm is above it), so the clipping variants differ."""
    batches: tuple[int, ...] = ()
    """--batch-sweep: the batch sizes."""
    steps_of: tuple[int, ...] = ()
    """--accumulation: A, micro-batches per optimizer step."""
    clips: tuple[str, ...] = ()
    """--accumulation: clip scopes, one global norm over the dense gradients or over every gradient."""


# A smoke run (--quick) proves the script's code paths, not a number: the micro model, two timed rounds,
# compiled with aot_eager (the same pass without inductor's codegen), and here one arm of each kind (a
# baseline, Sonar by hooks and by the pass, the hand-written hooks). --batch-sweep and --accumulation
# run eager only: what they add to these arms does not depend on the execution.
MICRO = ("olmoe-micro",)
SMOKE = Plan(warmup=1, rounds=2, held_out_batches=1)
AOT = (EAGER, Execution(compiler="aot_eager", sonar_pass=False), Execution(compiler="aot_eager"))
QUICK = Config(shapes=MICRO, plan=SMOKE, methods=("standard", "sonar", HANDWRITTEN), executions=AOT)


def arms_for(cfg: Config) -> list[Arm]:
    arms: dict[str, Arm] = {}
    for execution in cfg.executions:
        for method in cfg.methods:
            if method == HANDWRITTEN:  # Sonar's eager hooks' equal-work reference
                arm: Arm = HandwrittenHooksArm()
                if execution.compiled:
                    continue
            else:  # hooks vs pass is Sonar's choice; every other method has one compiled arm
                plain = Execution(compiler=execution.compiler)
                arm = Arm(method=method, execution=execution if Method.named(method).sonar else plain)
            arms.setdefault(arm.label, arm)
    return list(arms.values())


def accumulation_arms(cfg: Config, a: int, clip: str) -> list[Arm]:
    arms = []
    for ex in cfg.executions:
        arms += [Arm(method=BASELINE[clip], execution=ex), Arm(method="sonar_deferred", execution=ex)]
        if clip == "dense":
            arms.append(Arm(method="sonar", execution=ex, accumulation="per_microbatch" if a > 1 else None))
        elif a == 1:  # expert_clip="global" in backward: two passes, and no accumulation
            arms.append(Arm(method="sonar", execution=ex))
    return arms


def measure(
    cfg: Config,
    shape: str,
    arms: list[Arm],
    *,
    batch: int | None = None,
    a: int = 1,
    clip: str | None = None,
    step: MethodStep | None = None,
) -> list[ArmResult]:
    """`arms` on `shape` side by side (`benchmarks.arms.run_arms`), each step `a` micro-batches (with a
    clip: one `step(method, micro_batches)`)."""
    w = replace(cfg.workload, batch=batch or cfg.workload.batch)
    print(f"{SHAPES[shape].describe()}, {a} x batch {w.batch} x seq {w.seq}, {w.dtype}", flush=True)
    opt = AdamWConfig(
        lr=cfg.lr, max_grad_norm=cfg.max_grad_norm, expert_clip="global" if clip == "all" else None
    )
    n = cfg.plan.warmup + 1 + cfg.plan.rounds
    flat = make_batches(n * a, w.batch, w.seq)
    held_out = make_batches(cfg.plan.held_out_batches, w.batch, w.seq, held_out=True)
    build = partial(SHAPES[shape].build, w.torch_dtype)
    if clip is None:
        return run_arms(build, arms, opt, cfg.plan, flat, held_out)
    with warnings.catch_warnings():  # the per-micro-batch semantics are measured here; it warns users
        warnings.filterwarnings("ignore", message="accumulation='per_microbatch'")
        grouped = [flat[i * a : (i + 1) * a] for i in range(n)]
        return run_arms(build, arms, opt, cfg.plan, grouped, held_out, step=step or accumulated_step)


def accumulated_step(method: TrainingMethod, micro_batches: Sequence[Batch]) -> None:
    """One optimizer step over A micro-batches; the loss is averaged, as accumulation should."""
    if len(micro_batches) == 1:
        method.train_step(micro_batches[0])  # expert_clip="global" in backward takes a closure
        return
    for b in micro_batches:
        (method.model(**b).loss / len(micro_batches)).backward()
    method.optimizer_step()


def _records(results: list[ArmResult], **key: Any) -> list[dict[str, Any]]:
    return [{**key, **asdict(r)} for r in results]


def _tokens_per_s(tokens: int, r: ArmResult) -> str:
    return f"{tokens / (r.step_ms.median / 1e3):.0f}"


def _calls(r: ArmResult) -> str:
    return "-" if r.update_calls_per_step is None else str(r.update_calls_per_step)


# ------------------------------------------------------------------------------------ Table 1


def run_methods(cfg: Config) -> Output:
    tables, goals, records = [], [], []
    for shape in cfg.shapes:
        results = measure(cfg, shape, arms_for(cfg))
        tables.append(table(SHAPES[shape].describe(), results, cfg.workload))
        goals += shape_goals(shape, results)
        records += _records(results, shape=shape)
    return Output(tables=tables, goals=goals, records=records)


def table(title: str, results: list[ArmResult], w: Workload) -> Table:
    headers = ["arm", "peak MiB", "Δ peak", "total MiB (Δ)", "saved / predicted MiB", "step ms", "× standard",
               "tokens/s", "held-out loss", "Δ loss", "expert update calls/step"]  # fmt: skip
    named, rows = by_label(results), []
    for r in results:
        base = named.get(r.arm.baseline().label)
        if not r.ok:
            rows.append(failed([r.label], r.error, len(headers)))
        elif base is None or not base.ok:
            rows.append([r.label, f"{mib(r.peak_bytes):.1f}", *["-"] * 3, r.step_ms.fmt(0), *["-"] * 5])
        else:
            total, base_total = r.resident_bytes + r.peak_bytes, base.resident_bytes + base.peak_bytes
            rows.append([
                r.label, f"{mib(r.peak_bytes):.1f}", f"{100 * (r.peak_bytes / base.peak_bytes - 1):+.1f}%",
                f"{mib(total):.0f} ({100 * (total / base_total - 1):+.1f}%)", _saved(r, base),
                r.step_ms.fmt(0), fmt_ratio(ratio(r, base)), _tokens_per_s(w.tokens, r),
                f"{r.held_out_loss:.4f}", f"{r.held_out_loss - base.held_out_loss:+.4f}", _updates(r),
            ])  # fmt: skip
    note = (
        "Peak: transient bytes of one train step after warm-up (profiler allocator events); total adds "
        "the weights and optimizer state (the paper's peaks include them). Δ and × are vs standard "
        "(global clip) in the same execution: eager for eager arms, compiled for compiled ones; × is the "
        "median of per-round paired ratios [IQR]. step ms: median [IQR]. saved/predicted: (standard "
        "peak - arm peak) / (all expert-gradient bytes - one layer's)."
    )
    return Table(title=title, headers=headers, rows=rows, note=note)


def _saved(r: ArmResult, base: ArmResult) -> str:
    if r is base or not r.predicted_saving_bytes:
        return "-"
    saved, predicted = base.peak_bytes - r.peak_bytes, r.predicted_saving_bytes
    return f"{mib(saved):.1f} / {mib(predicted):.1f} ({saved / predicted:.0%})"


def _updates(r: ArmResult) -> str:
    if r.update_calls_per_step is None:
        return "-"
    paths = ", ".join(f"{n} tensors by {p}" for p, n in sorted(r.update_paths.items()))
    return f"{r.update_calls_per_step} ({paths})" + (" FALLBACK" if r.fallbacks else "")


def shape_goals(shape: str, results: list[ArmResult]) -> list[Goal]:
    a = by_label(results)
    std_c, sonar_e, sonar_p = (
        a.get(k) for k in ("standard · compiled", "sonar · eager hooks", "sonar · compiled pass")
    )
    eager, saved = _fraction(sonar_e, a.get("standard · eager")), _fraction(sonar_p, std_c)
    hooks = _fraction(a.get("sonar · compiled + hooks"), std_c)
    goals = [
        goal("methods.saving", f"{shape}: memory saved, eager hooks", eager, _pct(eager)),
        goal("methods.saving", f"{shape}: memory saved, compiled pass", saved, _pct(saved)),
        goal("methods.pass_vs_standard", f"{shape}: compiled pass vs compiled standard",
             ratio(sonar_p, std_c)),
        goal("methods.pass_vs_twin", f"{shape}: compiled pass vs compiled standard_no_expert_clip",
             ratio(sonar_p, a.get("standard_no_expert_clip · compiled"))),
        goal("methods.hooks_vs_handwritten", f"{shape}: eager hooks vs hand-written expert hooks",
             ratio(sonar_e, a.get(f"{HANDWRITTEN} · eager hooks"))),
        goal("methods.pass_vs_hooks", f"{shape}: compiled pass vs sonar eager hooks",
             ratio(sonar_p, sonar_e)),
        goal("methods.hooks_on_compiled",
             f"{shape}: hooks on a compiled model lose the saving (the pass keeps it)", hooks,
             f"hooks {_pct(hooks)}, pass {_pct(saved)}"),
    ]  # fmt: skip
    for mode, label in (("eager", "eager hooks"), ("pass", "compiled pass")):
        per = ratio(a.get(f"sonar_per_expert · {label}"), a.get(f"sonar · {label}"))
        goals.append(goal("methods.per_expert", f"{shape}: per-expert slower than batched, {mode}", per))
    return goals


def _fraction(r: ArmResult | None, base: ArmResult | None) -> float | None:
    if r is None or base is None or not (r.ok and base.ok) or not r.predicted_saving_bytes:
        return None
    return (base.peak_bytes - r.peak_bytes) / r.predicted_saving_bytes


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0%}"


# ------------------------------------------------------------------------------------ --granularity


def run_granularity(cfg: Config) -> Output:
    headers = ["shape", "execution", "granularity", "update calls/step", "peak MiB", "step ms", "× batched",
               "× no_expert_clip"]  # fmt: skip
    rows, goals, records = [], [], []
    for shape in cfg.shapes:
        a = by_label(results := measure(cfg, shape, arms_for(cfg)))
        for ex in cfg.executions:
            arms = {m: Arm(method=m, execution=ex) for m, _ in GRANULARITY}
            how = arms["sonar"].label.split(" · ", 1)[1]  # "eager hooks", "compiled pass"
            batched, twin = a.get(arms["sonar"].label), a.get(arms["standard_no_expert_clip"].label)
            for method, gran in GRANULARITY:
                r = a.get(arms[method].label)
                if r is None or not r.ok:
                    rows.append(failed([shape, how, gran], r.error if r else "missing", len(headers)))
                    continue
                rows.append([shape, how, gran, _calls(r), f"{mib(r.peak_bytes):.1f}", r.step_ms.fmt(0),
                             fmt_ratio(ratio(r, batched)), fmt_ratio(ratio(r, twin))])  # fmt: skip
            per = ratio(a.get(arms["sonar_per_expert"].label), batched)
            goals.append(
                goal("granularity.per_expert", f"{shape}: per-expert slower than batched, {how}", per)
            )
        records += _records(results, shape=shape)
    note = (
        "update calls: fused-AdamW launches on expert tensors per step (2L batched, 2EL per expert). "
        "× columns: median of per-round paired step-time ratios [IQR]; step ms: median [IQR]."
    )
    title = "Batched vs per-expert updates"
    return Output(
        tables=[Table(title=title, headers=headers, rows=rows, note=note)], goals=goals, records=records
    )


# ------------------------------------------------------------------------------------ --batch-sweep


def run_batch_sweep(cfg: Config) -> Output:
    points, records = [], []
    for batch in cfg.batches:
        results = measure(cfg, cfg.shapes[0], arms_for(cfg), batch=batch)
        points += [_point(batch, ex, results) for ex in cfg.executions]
        records += _records(results, batch=batch)
    figures = {"batch_sweep.png": partial(draw_sweep, points)}
    return Output(tables=[sweep_table(points)], records=[*points, *records], figures=figures)


def _point(batch: int, execution: Execution, results: list[ArmResult]) -> dict:
    a = by_label(results)
    base, sonar = (a.get(Arm(method=m, execution=execution).label) for m in ("standard", "sonar"))
    if base is None or sonar is None or not (base.ok and sonar.ok):
        error = next((r.error for r in (base, sonar) if r and r.error), "missing")
        return {"batch": batch, "execution": execution.label, "ok": False, "error": error}
    t = ratio(sonar, base)
    return {
        "batch": batch, "execution": execution.label, "ok": True, "error": None,
        "standard_peak_mib": mib(base.peak_bytes), "sonar_peak_mib": mib(sonar.peak_bytes),
        "standard_total_mib": mib(base.peak_bytes + base.resident_bytes),
        "sonar_total_mib": mib(sonar.peak_bytes + sonar.resident_bytes),
        "predicted_mib": mib(sonar.predicted_saving_bytes), "standard_ms": base.step_ms.fmt(0),
        "sonar_ms": sonar.step_ms.fmt(0), "time_ratio": asdict(t) if t else None,
        "time_ratio_text": fmt_ratio(t),
    }  # fmt: skip


def sweep_table(points: list[dict]) -> Table:
    headers = ["batch", "execution", "standard peak MiB", "sonar peak MiB", "saved MiB (share of peak)",
               "saved/predicted", "Δ total", "standard ms", "sonar ms", "sonar × standard"]  # fmt: skip
    rows = []
    for p in points:
        if not p["ok"]:
            rows.append(failed([p["batch"], p["execution"]], p["error"], len(headers)))
            continue
        saved = p["standard_peak_mib"] - p["sonar_peak_mib"]
        total_change = p["sonar_total_mib"] / p["standard_total_mib"] - 1
        rows.append([
            str(p["batch"]), p["execution"], f"{p['standard_peak_mib']:.1f}", f"{p['sonar_peak_mib']:.1f}",
            f"{saved:.1f} ({saved / p['standard_peak_mib']:.0%})", f"{saved / p['predicted_mib']:.0%}",
            f"{100 * total_change:+.1f}%", p["standard_ms"], p["sonar_ms"], p["time_ratio_text"],
        ])  # fmt: skip
    note = (
        "seq 64; eager: hooks vs eager standard; inductor: the pass vs compiled standard (global clip). "
        "Peaks are a step's transient bytes; Δ total adds weights and optimizer state (as the paper's do)."
    )
    return Table(title="Saving and speedup vs batch size", headers=headers, rows=rows, note=note)


def draw_sweep(points: list[dict], plt: Any) -> Any:
    """Saving share of the peak and time ratio against the batch size."""
    from matplotlib.ticker import NullLocator

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for ex in dict.fromkeys(p["execution"] for p in points):
        pts = [p for p in points if p["execution"] == ex and p["ok"]]
        xs = [p["batch"] for p in pts]
        share = [100 * (p["standard_peak_mib"] - p["sonar_peak_mib"]) / p["standard_peak_mib"] for p in pts]
        (mem_line,) = ax_mem.plot(xs, share, marker="o", label=f"{ex}: share of step peak")
        total = [100 * (1 - p["sonar_total_mib"] / p["standard_total_mib"]) for p in pts]
        ax_mem.plot(xs, total, marker="s", ls="--", color=mem_line.get_color(), label=f"{ex}: share of total")
        (line,) = ax_time.plot(xs, [p["time_ratio"]["median"] for p in pts], marker="o", label=ex)
        lo, hi = [p["time_ratio"]["q25"] for p in pts], [p["time_ratio"]["q75"] for p in pts]
        ax_time.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
    ax_mem.set(xlabel="batch", ylabel="peak memory saved (% of standard)")
    ax_time.set(xlabel="batch", ylabel="sonar / standard step time (IQR band)")
    ax_time.axhline(1.0, color="grey", lw=0.8)
    batch_sizes = sorted({p["batch"] for p in points})
    for ax in (ax_mem, ax_time):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.legend()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ --accumulation


def run_accumulation(cfg: Config) -> Output:
    rows, records = [], []
    for clip in cfg.clips:
        for a in cfg.steps_of:
            results = measure(cfg, cfg.shapes[0], accumulation_arms(cfg, a, clip), a=a, clip=clip)
            rows += _accumulation_rows(a, clip, cfg, results)
            records += _records(results, A=a, clip=clip)
    return Output(tables=[accumulation_table(rows)], goals=accumulation_goals(records), records=records)


def _accumulation_rows(a: int, clip: str, cfg: Config, results: list[ArmResult]) -> list[list[str]]:
    named, rows = by_label(results), []
    for r in results:
        base = named.get(Arm(method=BASELINE[clip], execution=r.arm.execution).label)
        if not r.ok or base is None or not base.ok:
            rows.append(failed([a, clip, r.label], r.error or "baseline failed", len(ACCUMULATION_HEADERS)))
            continue
        expected = r.predicted_saving_bytes - (r.kept_operand_bytes or 0)
        rows.append([
            str(a), clip, r.label, f"{mib(r.peak_bytes):.1f}",
            "-" if r is base else f"{mib(base.peak_bytes - r.peak_bytes):.1f} / {mib(expected):.1f}",
            "-" if r.kept_operand_bytes is None else f"{mib(r.kept_operand_bytes):.2f}",
            r.step_ms.fmt(0), fmt_ratio(ratio(r, base)), _tokens_per_s(a * cfg.workload.tokens, r), _calls(r),
            f"{r.held_out_loss - base.held_out_loss:+.4f}",
        ])  # fmt: skip
    return rows


ACCUMULATION_HEADERS = [
    "A", "clip", "arm", "peak MiB", "saved / expected MiB", "kept operands MiB", "step ms", "× baseline",
    "tokens/s", "expert updates/step", "Δ held-out loss",
]  # fmt: skip


def accumulation_table(rows: list[list[str]]) -> Table:
    note = (
        "One step = A micro-batches (batch 2, seq 64) and one optimizer step; the peak is the step's "
        "transient (weights and optimizer states excluded). The baseline is standard training with the "
        "same clip in the same execution (clip dense: standard_no_expert_clip; all: standard). Expected "
        "saving: all expert-gradient bytes but one layer's, less the kept operands. × is the median of "
        "paired per-round ratios [IQR]."
    )
    return Table(
        title="Gradient accumulation and clip scope", headers=ACCUMULATION_HEADERS, rows=rows, note=note
    )


def accumulation_goals(records: list[dict]) -> list[Goal]:
    """The deferred schedule's time against standard with the same clip, its memory at A=4 (against
    the prediction less the kept operands) and at A=1 (against the prediction itself: with one
    micro-batch the step holds one expert gradient at a time beside the operands it consumes); only
    for the (A, clip) pairs the run measured."""
    out = []
    ran = {(r["A"], r["clip"]) for r in records}
    for ex, base_ex in (("eager", "eager"), ("compiled pass", "compiled")):
        for clip, a in [c for c in (("all", 1), ("dense", 4), ("all", 4)) if c[::-1] in ran]:
            r = _find(records, a, clip, f"sonar_deferred · {ex}")
            base = _find(records, a, clip, f"{BASELINE[clip]} · {base_ex}")
            ok = r is not None and base is not None and len(r["step_s"]) == len(base["step_s"])
            spread = paired_ratio(r["step_s"], base["step_s"]) if ok and r and base else None
            name = f"deferred, clip {clip}, A={a}, {ex}"
            eager_goal = "_eager" if (ex, clip, a) == ("eager", "all", 1) else ""  # its own threshold
            key = f"accumulation.deferred_{clip}_{a}{eager_goal}"
            out.append(goal(key, f"{name}: time vs {BASELINE[clip]}", spread))
            if a == 4 or clip == "all":
                frac = None
                if r and base and r["predicted_saving_bytes"]:
                    kept = (r["kept_operand_bytes"] or 0) if a > 1 else 0
                    expected = r["predicted_saving_bytes"] - kept
                    frac = (base["peak_bytes"] - r["peak_bytes"]) / expected
                key = "accumulation.deferred_memory" if a > 1 else "accumulation.deferred_memory_one"
                out.append(goal(key, f"{name}: memory saved", frac, _pct(frac)))
    return out


def _find(records: list[dict], a: int, clip: str, label: str) -> dict | None:
    hit = [r for r in records if r["A"] == a and r["clip"] == clip and r["label"] == label]
    return hit[0] if hit and hit[0].get("error") is None else None


# ------------------------------------------------------------------------------------ the command line

GRAN, SWEEP = tuple(m for m, _ in GRANULARITY), ("standard", "sonar")
TWO, OLMOE = (EAGER, COMPILED), ("olmoe-cpu",)
MODES = [
    Mode(flag="--granularity", script="granularity", run=run_granularity,
         question="Question (paper Table 3): what do per-expert updates (2EL kernel calls) cost against "
         "batched ones (2L)?",
         default=Config(methods=GRAN, executions=TWO, plan=Plan(rounds=10, held_out_batches=1)),
         quick=Config(shapes=MICRO, methods=GRAN, executions=AOT[::2], plan=SMOKE)),
    Mode(flag="--batch-sweep", script="batch_sweep", run=run_batch_sweep,
         question="Question (paper section 5.5): how do Sonar's memory saving and speedup shrink as the "
         "batch grows?",
         default=Config(shapes=OLMOE, methods=SWEEP, executions=TWO, batches=(2, 4, 8, 16, 32),
                        plan=Plan(warmup=1, rounds=5, held_out_batches=1)),
         quick=Config(shapes=MICRO, methods=SWEEP, executions=(EAGER,), batches=(2, 4), plan=SMOKE)),
    Mode(flag="--accumulation", script="accumulation", run=run_accumulation,
         question="Question (paper Table 8, and the deferred schedule): what do accumulation and the clip "
         "scope cost?",
         default=Config(shapes=OLMOE, executions=TWO, steps_of=(1, 4, 8), clips=("dense", "all"),
                        plan=Plan(warmup=1, rounds=15, held_out_batches=2)),
         quick=Config(shapes=MICRO, executions=(EAGER,), steps_of=(1, 4), clips=("dense", "all"),
                      plan=SMOKE)),
    Mode(flag="--deferred", script="deferred", run=run_accumulation,
         question="Question (docs/modes.md): with one clip over every parameter, which path saves, how much, "
         "and at what time: the deferred schedule beside the in-backward one, eager and compiled?",
         default=Config(shapes=OLMOE, executions=TWO, steps_of=(1, 4), clips=("all",),
                        plan=Plan(warmup=1, rounds=15, held_out_batches=1)),
         quick=Config(shapes=MICRO, executions=(EAGER,), steps_of=(1,), clips=("all",), plan=SMOKE)),
    *profiles.MODES,
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    overrides = [
        common.Override(field="shapes", choices=sorted(SHAPES), help="override the model shapes", many=True),
        common.Override(field="executions", choices=[e.label for e in Config().executions], many=True,
                        help="override the executions", parse=Execution.from_label),
        common.Override(field="clips", choices=["dense", "all"], many=True, help="--accumulation: clips"),
        common.Override(field="modes", choices=["compiled", "eager"], many=True, help="--profile: pairs"),
    ]  # fmt: skip
    common.main(SCRIPT, __doc__, argv, run=run_methods, default=Config(), quick=QUICK, overrides=overrides,
                modes=MODES)  # fmt: skip


if __name__ == "__main__":
    main()
