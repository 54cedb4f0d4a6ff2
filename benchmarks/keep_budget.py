"""Question (the deferred schedule's keep budget): what does each byte the norm pass keeps buy in step time?

Under the clip over every parameter the deferred step computes each expert gradient twice (its norm,
then its update) unless `keep_budget` lets the norm pass keep it (`sonar_fx.optim.keep_budget`). Here
the deferred schedule runs with a budget of 0, 1/4, 1/2 and all of the model's expert-gradient bytes,
beside standard training with the same global clip, on the OLMoE-shaped CPU model (bf16, batch 2 x seq
64 per micro-batch), at A=1 and A=4 micro-batches per step, side by side in interleaved rounds. Reported
per arm: the budget, the bytes kept and the share of computed gradient bytes computed again, the step's
transient peak against standard's, and the step time as the median of paired per-round ratios against
standard [IQR], and beside it the step's thread CPU time (`time.thread_time`: what a loaded machine does
not inflate) as the same paired ratio, with the minor page faults of a step (glibc returning freed
memory to the system and faulting it in again: an allocator's cost, not the schedule's). Expected: at
"all" the same work and the same peak as standard; the ratio falls with the budget as the recomputed
share does. `--shape olmoe-micro` (or `--quick`) runs in seconds.
"""

from __future__ import annotations

import itertools
import math
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any

from torch import nn

from benchmarks import common, methods
from benchmarks.arms import EAGER, Arm, ArmResult, Plan
from benchmarks.common import Goal, Output, Table, failed, goal, mib
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.measure import Spread, fmt_ratio, paired_ratio, ratio
from sonar_fx.methods import Execution, TrainingMethod, build_method
from sonar_fx.workload import Batch

SCRIPT = "keep_budget"
FRACTIONS = ("0", "1/4", "1/2", "1")
"""Keep budgets, as shares of the model's expert-gradient bytes ("1": every gradient kept)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    shape: str = "olmoe-cpu"
    """A key of `benchmarks.workload.SHAPES`."""
    workload: Workload = field(default_factory=Workload)
    """One micro-batch: batch 2 x seq 64, bf16."""
    plan: Plan = field(default_factory=lambda: Plan(warmup=1, rounds=15, held_out_batches=1))
    steps_of: tuple[int, ...] = (1, 4)
    """A: micro-batches per optimizer step."""
    fractions: tuple[str, ...] = FRACTIONS
    executions: tuple[Execution, ...] = (EAGER,)
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    """Active on these models, so the clip over all scales every gradient."""


QUICK = Config(shape="olmoe-micro", plan=Plan(warmup=1, rounds=2, held_out_batches=1), steps_of=(1, 2))


@dataclass(frozen=True, kw_only=True)
class KeepArm(Arm):
    """sonar_deferred with the clip over all and a keep budget of `fraction` of the expert gradients."""

    method: str = "sonar_deferred"
    fraction: str = "0"

    @property
    def label(self) -> str:
        return f"{super().label} · keep {self.fraction}"

    def build(self, model: nn.Module, cfg: AdamWConfig) -> TrainingMethod:
        grads = sum(la.grad_bytes() for la in ExpertSet.discover(model).layers)
        budget = int(Fraction(self.fraction) * grads)
        return build_method(self.method, model, replace(cfg, keep_budget=budget), execution=self.execution)


def arms_for(cfg: Config) -> list[Arm]:
    arms: list[Arm] = []
    for ex in cfg.executions:
        arms.append(Arm(method="standard", execution=Execution(compiler=ex.compiler)))
        arms += [KeepArm(execution=ex, fraction=f) for f in cfg.fractions]
    return arms


def run_keep_budget(cfg: Config) -> Output:
    like = methods.Config(shapes=(cfg.shape,), workload=cfg.workload, plan=cfg.plan, lr=cfg.lr,
                          max_grad_norm=cfg.max_grad_norm)  # fmt: skip
    rows, records = [], []
    for a in cfg.steps_of:
        counted = _CountedSteps()
        results = methods.measure(like, cfg.shape, arms_for(cfg), a=a, clip="all", step=counted.step)
        counts = counted.per_arm(results, cfg.plan.rounds)
        rows += _rows(a, results, counts)
        records += [
            {"A": a, "fraction": getattr(r.arm, "fraction", None), **asdict(r), **counts.get(r.label, {})}
            for r in results
        ]
    return Output(tables=[_table(rows, cfg)], goals=_goals(records, cfg), records=records,
                  figures={"keep_budget.png": lambda plt: _draw(records, cfg, plt)})  # fmt: skip


class _CountedSteps:
    """Each step's thread CPU seconds and minor page faults, per method, in the order the methods first
    stepped (`run_arms` builds and warms the arms one after another, in their order)."""

    def __init__(self) -> None:
        self.by_method: dict[int, list[tuple[float, int]]] = {}

    def step(self, method: TrainingMethod, micro_batches: Sequence[Batch]) -> None:
        faults, started = _minor_faults(), time.thread_time()
        methods.accumulated_step(method, micro_batches)
        counted = (time.thread_time() - started, _minor_faults() - faults)
        self.by_method.setdefault(id(method), []).append(counted)

    def per_arm(self, results: Sequence[ArmResult], rounds: int) -> dict[str, dict[str, list[float]]]:
        """Arm label -> its timed rounds' `cpu_s` and `minor_faults` (the last `rounds` steps: warm-up and
        the memory step come first), for the arms whose first step ran."""
        stepped = [r for r in results if not math.isnan(r.first_step_s)]
        out: dict[str, dict[str, list[float]]] = {}
        for r, steps in zip(stepped, self.by_method.values(), strict=False):
            timed = steps[-rounds:]
            out[r.label] = {"cpu_s": [c for c, _ in timed], "minor_faults": [f for _, f in timed]}
        return out


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _standard(results: Sequence[ArmResult], r: ArmResult) -> ArmResult | None:
    label = Arm(method="standard", execution=Execution(compiler=r.arm.execution.compiler)).label
    return next((b for b in results if b.label == label), None)


def _cpu_ratio(counts: dict[str, dict[str, list[float]]], r: ArmResult, base: ArmResult) -> str:
    mine, theirs = counts.get(r.label, {}).get("cpu_s"), counts.get(base.label, {}).get("cpu_s")
    if not mine or not theirs or len(mine) != len(theirs):
        return "-"
    return fmt_ratio(paired_ratio(mine, theirs))


def _faults(counts: dict[str, dict[str, list[float]]], r: ArmResult) -> str:
    faults = counts.get(r.label, {}).get("minor_faults")
    return f"{statistics.median(faults):.0f}" if faults else "-"


def _rows(a: int, results: list[ArmResult], counts: dict[str, dict[str, list[float]]]) -> list[list[str]]:
    rows = []
    for r in results:
        base = _standard(results, r)
        if not r.ok or base is None or not base.ok:
            rows.append(failed([a, r.label], r.error or "standard failed", len(HEADERS)))
            continue
        k = r.keep_budget
        share = "-" if not k else f"{k['recomputed_share']:.2f}"
        rows.append([
            str(a), r.label, "-" if not k else f"{mib(k['keep_budget_bytes']):.1f}",
            "-" if not k else f"{mib(k['kept_grad_bytes']):.1f}", share, f"{mib(r.peak_bytes):.1f}",
            "-" if r is base else f"{mib(r.peak_bytes - base.peak_bytes):+.1f}", r.step_ms.fmt(0),
            fmt_ratio(ratio(r, base)), _cpu_ratio(counts, r, base), _faults(counts, r),
        ])  # fmt: skip
    return rows


HEADERS = ["A", "arm", "budget MiB", "kept MiB", "recomputed", "peak MiB", "peak - standard MiB", "step ms",
           "× standard", "CPU × standard", "faults/step"]  # fmt: skip


def _table(rows: list[list[str]], cfg: Config) -> Table:
    w = cfg.workload
    note = (
        f"{SHAPES[cfg.shape].describe()}; one step = A micro-batches of batch {w.batch} x seq {w.seq}, "
        f"{w.dtype}, clip over every parameter (max norm {cfg.max_grad_norm}). keep f: keep_budget = f x the "
        "model's expert-gradient bytes. recomputed: share of the gradient bytes the norm pass computed that "
        "the update pass computes again. peak: the step's transient above weights and optimizer states. "
        "× standard: median of paired per-round step-time ratios [IQR]; CPU × standard: the same of the "
        "step's thread CPU time; faults/step: median minor page faults of a step (the process's)."
    )
    return Table(title="Keep budget: step time against memory", headers=HEADERS, rows=rows, note=note)


def _find(records: list[dict], a: int, label: str) -> dict | None:
    hit = [r for r in records if r["A"] == a and r["label"] == label and r.get("error") is None]
    return hit[0] if hit else None


def _ratio(records: list[dict], a: int, label: str, base_label: str) -> Spread | None:
    r, base = _find(records, a, label), _find(records, a, base_label)
    if r is None or base is None or len(r["step_s"]) != len(base["step_s"]) or not r["step_s"]:
        return None
    return Spread.of([x / y for x, y in zip(r["step_s"], base["step_s"], strict=True)])


def _goals(records: list[dict], cfg: Config) -> list[Goal]:
    """Per A and execution: at "all" the time and the peak against standard; the ratio falls with the
    budget (counted: budgets whose median ratio is above the next smaller budget's)."""
    out = []
    for ex in cfg.executions:
        base = Arm(method="standard", execution=Execution(compiler=ex.compiler)).label
        arms = [KeepArm(execution=ex, fraction=f) for f in cfg.fractions]
        for a in cfg.steps_of:
            name = f"A={a}, {arms[-1].label}"
            out.append(
                goal(
                    "keep_budget.all_time",
                    f"{name}: time vs standard",
                    _ratio(records, a, arms[-1].label, base),
                )
            )
            top, std = _find(records, a, arms[-1].label), _find(records, a, base)
            peak = top["peak_bytes"] / std["peak_bytes"] if top and std and std["peak_bytes"] else None
            out.append(
                goal(
                    "keep_budget.all_peak",
                    f"{name}: peak vs standard",
                    peak,
                    "-" if peak is None else f"{peak:.3f}",
                )
            )
            medians = [_ratio(records, a, arm.label, base) for arm in arms]
            known = [m.median for m in medians if m is not None]
            rises = (
                sum(later > earlier for earlier, later in itertools.pairwise(known))
                if len(known) == len(arms)
                else None
            )
            out.append(goal("keep_budget.falls", f"A={a}, {ex.label}: budgets whose ratio rose", rises))
    return out


def _draw(records: list[dict], cfg: Config, plt: Any) -> Any:
    """Step time (× standard) against the step's peak, one line per A, each point a budget."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ex in cfg.executions:
        base = Arm(method="standard", execution=Execution(compiler=ex.compiler)).label
        for a in cfg.steps_of:
            std = _find(records, a, base)
            points = []
            for f in cfg.fractions:
                label = KeepArm(execution=ex, fraction=f).label
                r, spread = _find(records, a, label), _ratio(records, a, label, base)
                if r is not None and spread is not None:
                    points.append((mib(r["peak_bytes"]), spread, f))
            if not points:
                continue
            xs, ys = [p[0] for p in points], [p[1].median for p in points]
            errs = [[p[1].median - p[1].q25 for p in points], [p[1].q75 - p[1].median for p in points]]
            (line,) = ax.plot(xs, ys, marker="o", label=f"A={a}, {ex.label}")
            ax.errorbar(xs, ys, yerr=errs, fmt="none", ecolor=line.get_color(), capsize=3)
            for x, y, (_, _, f) in zip(xs, ys, points, strict=True):
                ax.annotate(f"keep {f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if std is not None:
                ax.plot([mib(std["peak_bytes"])], [1.0], marker="*", ms=12, color=line.get_color(), ls="none")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step transient peak, MiB (standard: star)",
           ylabel="step time, × standard (paired median, IQR)",
           title=f"Keep budget on {cfg.shape}: time against memory, clip over all")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    overrides = [
        common.Override(field="shape", choices=sorted(SHAPES), help="the model shape (olmoe-micro: seconds)"),
        common.Override(field="fractions", choices=FRACTIONS, many=True, help="keep budgets (default: all)"),
        common.Override(field="executions", choices=["eager", "aot_eager", "inductor"], many=True,
                        help="executions of the arms", parse=Execution.from_label),
    ]  # fmt: skip
    common.main(
        SCRIPT, __doc__, argv, run=run_keep_budget, default=Config(), quick=QUICK, overrides=overrides
    )


if __name__ == "__main__":
    main()
