"""The keep budget a plan chooses: the largest one whose step still fits the memory budget.

For: `sonar_fx.plan` and `sonar-fx plan --budget` with the deferred schedule under the clip over every
parameter (`sonar_deferred_global_clip`). Its norm pass computes each expert gradient and, within
`keep_budget` bytes, keeps it for the update pass instead of computing it again
(`sonar_fx.optim.keep_budget`): memory bought back as time. The budgets worth trying are the byte
counts of the first n expert tensors in the order the step updates them (n = 0 .. all): each keeps n
more whole gradients. The step's peak grows with n, so the largest n that fits is found by planned
steps (all first: if it fits, nothing else is tried; else bisection), each one the method's real step
at that budget on the fake model. A gradient held whole already (past its crossover) is never computed
twice and counts against the budget, as the step counts it. Never: guess a peak the planned step did
not produce.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sonar_fx.planner.run import StepMemory


@dataclass(frozen=True, kw_only=True)
class KeepChoice:
    """The keep budget chosen for a memory budget, and its planned step."""

    budget_bytes: int
    """The largest keep budget whose step fits (0: none does beyond today's)."""
    peak_allocated_bytes: int
    """The planned step's peak with it."""
    fits: bool
    """Whether that step fits the memory budget (False: not even with nothing kept)."""
    kept: tuple[str, ...]
    """Expert tensors whose gradient the norm pass keeps (computed once)."""
    tensors: int
    """Expert tensors of the model."""
    kept_bytes: int
    held_bytes: int
    """Gradients held whole already (past their crossover): counted against the budget."""
    recomputed_share: float
    """Share of the norm pass's computed gradient bytes the update pass computes again."""
    extra_gemm_flops: int | None = None
    """The weight-gradient GEMMs the update pass runs again, per step (None: shapes not modelled)."""
    probes: int = 0
    """Planned steps the choice took."""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kept"] = list(self.kept)
        return out


def choose_keep_budget(
    step_at: Callable[[int], StepMemory], order: list[tuple[str, int]], memory_budget: int
) -> tuple[int, StepMemory, int]:
    """The largest of the budgets keeping the first n tensors of `order` ((name, gradient bytes) in update
    order) whose planned step (`step_at(keep_budget)`) peaks within `memory_budget`; with its step and the
    number of steps planned. Budget 0 is returned when none fits (its step then says by how much)."""
    candidates = [0, *itertools.accumulate(nbytes for _, nbytes in order)]
    planned: dict[int, StepMemory] = {}

    def fits(n: int) -> bool:
        if candidates[n] not in planned:
            planned[candidates[n]] = step_at(candidates[n])
        return planned[candidates[n]].peak <= memory_budget

    lo, hi = 0, len(candidates) - 1
    if fits(hi):
        lo = hi
    elif fits(lo):
        while hi - lo > 1:  # lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return candidates[lo], planned[candidates[lo]], len(planned)
