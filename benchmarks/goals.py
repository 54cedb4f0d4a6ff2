"""Every goal the benchmarks grade: its threshold, how a measurement must compare with it, its wording.

One table, so that a goal is moved or reworded in one place and every script grades it the same way
(`benchmarks.common.goal` looks a goal up here and grades it with `benchmarks.common.grade`). Keys are
"<results name>.<goal>". A threshold is a ratio, a fraction or a count, as its `target` says. This module
never measures or grades anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Want = Literal["<", "<=", ">", ">="]
"""How a measurement must compare with its threshold (`measured <= threshold` for "<=")."""


@dataclass(frozen=True)
class Target:
    threshold: float
    want: Want
    target: str
    """The target column's text."""


def _x(want: Want, threshold: float, why: str = "") -> Target:
    """A step-time ratio's target ("<= 0.85x")."""
    return Target(threshold, want, f"{want} {threshold:.2f}x{why}")


GOALS: dict[str, Target] = {
    # methods (paper Table 1); per shape
    "methods.saving": Target(0.95, ">=", ">= 95% of predicted"),
    "methods.pass_vs_standard": _x("<=", 0.85),
    "methods.pass_vs_twin": _x("<=", 0.97),
    "methods.hooks_vs_handwritten": _x("<=", 1.00),
    "methods.pass_vs_hooks": _x("<=", 0.90),
    "methods.hooks_on_compiled": Target(0.5, "<", "hooks < 50%, pass >= 95% of predicted"),
    "methods.per_expert": _x(">", 1.00),
    # granularity (paper Table 3)
    "granularity.per_expert": _x(">", 1.00, " (paper, GPU: +20% OLMoE, +72% Granite)"),
    # accumulation (paper Table 8) and the deferred schedule: time by (clip, A), memory at A=1 and 4
    "accumulation.deferred_all_1": _x("<=", 1.10),
    # eager: no compiler fuses the step's GEMMs and updates, SonarTrainer's default all the same
    "accumulation.deferred_all_1_eager": _x("<=", 1.20),
    "accumulation.deferred_dense_4": _x("<=", 1.03),
    "accumulation.deferred_all_4": _x("<=", 1.10),
    "accumulation.deferred_memory": Target(0.9, ">=", ">= 90% of expected"),
    "accumulation.deferred_memory_one": Target(0.9, ">=", ">= 90% of predicted (one micro-batch)"),
    # keep_budget: the deferred norm pass's kept gradients (per A and execution)
    "keep_budget.all_time": _x("<=", 1.03, " vs standard (keep all: the same work)"),
    "keep_budget.all_peak": Target(1.0, "<=", "<= standard's peak (keep all)"),
    "keep_budget.falls": Target(0, "<=", "0 rises: the ratio falls with the budget"),
    # hot_path: CPU-time ratios of equal-work pairs
    "hot_path.pass_vs_twin": _x("<=", 0.97),
    "hot_path.hooks_vs_handwritten": _x("<=", 1.00),
    "hot_path.guard": _x("<=", 1.01),
    # endurance
    "endurance.rss_slope": Target(1024.0, "<", "< 1024 KiB per 1k steps"),
    "endurance.recompiles": Target(0, "<=", "0 frame compiles and sonar recompiles after warm-up"),
    "endurance.drift_high": Target(1.2, "<=", "CPU time, last / first quarter within 20%"),
    "endurance.drift_low": Target(0.8, ">=", "CPU time, last / first quarter within 20%"),
    # optimizers
    "optimizers.norms": Target(0.02, "<", "< 2% of step time"),
    "optimizers.nonfinite": Target(1.02, "<", "< 2% of step time (default: it reads the logged norm)"),
    "optimizers.global_clip_memory": Target(1.0, "<", "below standard (global clip)"),
    "optimizers.lowbit_8": Target(0.3, "<", "~1/4 of fp32 states"),
    "optimizers.muon_state": Target(0.51, "<", "about 1/2 of AdamW's (one buffer, not two moments)"),
    "optimizers.muon_time": Target(1.05, "<", "within 5% of the same Muon at step()"),
    "optimizers.muon_memory": Target(1.0, "<", "step transient below the same Muon at step()"),
    "optimizers.muon_guard": Target(1.05, "<", "< 5% of step time"),
    # distributed_deferred: per rank, 2 gloo ranks, the deferred schedule against the plain engine
    "distributed_deferred.saving": Target(0.9, ">=", ">= 90% of expected"),
    "distributed_deferred.no_saving_expected": Target(0.0, "<=", "<= 0: costs nothing"),
    "distributed_deferred.plan": Target(0.03, "<=", "within 3%"),
    "distributed_deferred.dense_time": _x("<=", 1.05),
    # plan_accuracy: its Config's defaults (a run may set others; its goals table shows what it used)
    "plan_accuracy.peak": Target(0.03, "<=", "every case (and each paper row) within 3%"),
    "plan_accuracy.saving": Target(0.05, "<=", "within 5%"),
    "plan_accuracy.sweep": Target(0.10, "<=", "each within 10%"),
    "plan_accuracy.cost_s": Target(120.0, "<", "< 120 s"),
}
