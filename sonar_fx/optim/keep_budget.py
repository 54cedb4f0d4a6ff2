"""The deferred step's keep budget: expert gradients the norm pass keeps for the update pass.

Under the clip over every parameter (Sonar's, expert_clip="global", or the user's,
`model.sonar.clip_grad_norm_`: `deferred_loop`), a GradScaler's verdict or nonfinite="skip", the
deferred step computes each expert gradient twice: in the norm pass (its norm, its inf check), then in
the update pass. That keeps one gradient alive at a time, at the price of one more weight-gradient GEMM per
tensor. `KeptGradients` spends a byte budget (`keep_budget` in the config) on skipping it: the norm
pass keeps the gradients it computed, in the order the update pass reaches them, each one that still
fits, and the update pass takes them instead of computing them again. A kept gradient is the norm
pass's own tensor, reduced and unscaled as the update pass would make it: the same bits.
- Gradients the step holds as one tensor already (past their crossover, arrived whole, shown in
  `.grad` for a GradScaler) are never computed twice: they count against the budget first.
- Without a GradScaler a kept gradient's operands are dropped as soon as it is kept (the gradient
  takes their place, as at the crossover); under a scaler they stay until the update, so a step the
  scaler skips leaves the kept contributions as they were.
- "auto": at each step, the CUDA caching allocator's free memory (what the driver has free, plus what
  the allocator holds unused) less a margin: two of the largest expert gradients (the one computed
  next and its layout copy) and 5% of the card (the allocator's fragmentation). On CPU there is no
  allocator to ask: refused at construction, naming the bytes that keep everything.
Never: change a gradient's bits; keep past the budget; keep under a distributed engine (whether a
tensor crossed over differs by rank, so ranks would disagree on which reductions the update pass runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sonar_fx.config import KeepBudget, OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.runtime.meter import ExpertGradMeter

AUTO_MARGIN_GRADIENTS = 2
""""auto" leaves room for this many of the largest expert gradients (the next one computed, a copy)."""
AUTO_MARGIN_FRACTION = 0.05
"""...and for this share of the card's memory (the caching allocator's fragmentation)."""


@dataclass(frozen=True)
class KeepRecord:
    """What the keep budget did in one step's norm pass."""

    budget_bytes: int
    """The step's budget ("auto" resolved)."""
    held_bytes: int
    """Expert gradients the step held as one tensor already (crossed over, arrived whole): counted
    against the budget, never computed twice."""
    computed_bytes: int
    """Expert gradients the norm pass computed from kept operands."""
    kept_bytes: int
    """Of those, kept for the update pass (not computed again)."""
    kept: tuple[str, ...] = ()
    """Names of the expert tensors whose gradient was kept."""

    @property
    def recomputed_share(self) -> float:
        """Share of the norm pass's computed gradient bytes that the update pass computes again."""
        return (self.computed_bytes - self.kept_bytes) / self.computed_bytes if self.computed_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "keep_budget_bytes": self.budget_bytes,
            "held_grad_bytes": self.held_bytes,
            "computed_grad_bytes": self.computed_bytes,
            "kept_grad_bytes": self.kept_bytes,
            "recomputed_share": self.recomputed_share,
            "kept": list(self.kept),
        }


@dataclass
class KeptGradients:
    """The norm pass's gradients kept for the update pass, within `budget` bytes (one per optimizer)."""

    budget: KeepBudget
    meter: ExpertGradMeter
    last: KeepRecord | None = None
    """The last norm pass's record (None before the first)."""
    _kept: dict[int, tuple[Tensor, object]] = field(default_factory=dict)  # id(param) -> (grad, meter key)
    _room: int = 0
    _step: dict[str, Any] = field(default_factory=dict)  # the running norm pass's figures
    _names: list[str] = field(default_factory=list)  # the running norm pass's kept tensors

    def begin(self, params: list[Tensor], store: DeferredGrads) -> None:
        """A norm pass over `params` starts: the budget resolved, those held already counted against it."""
        self.clear()
        budget = auto_budget(params) if self.budget == "auto" else self.budget
        held = sum(_nbytes(p) for p in params if not computed_twice(p, store))
        self._room = max(budget - held, 0)
        self._step = {"budget_bytes": budget, "held_bytes": held, "computed_bytes": 0, "kept_bytes": 0}
        self._names = []

    def keep(
        self, param: Tensor, name: str, grad: Tensor, key: object, store: DeferredGrads, *, drop: bool
    ) -> bool:
        """Keep `grad` (the norm pass's, counted on the meter under `key`) for `param`'s update if it was
        computed from kept operands and fits; `drop`: its operands are dropped now. False: not kept."""
        if not computed_twice(param, store):
            return False
        nbytes = _nbytes(param)
        self._step["computed_bytes"] += nbytes
        if nbytes > self._room:
            return False
        self._room -= nbytes
        self._step["kept_bytes"] += nbytes
        self._names.append(name)
        self._kept[id(param)] = (grad, key)
        if drop:
            store.discard(param)
        return True

    def finish(self) -> None:
        """The norm pass ended: its record becomes `last`."""
        self.last = KeepRecord(**self._step, kept=tuple(self._names))

    def take(self, param: Tensor, store: DeferredGrads) -> Tensor | None:
        """`param`'s kept gradient for its update (counted on the meter under `param` from now on, as
        the update pass counts the gradient it computes), its operands dropped; None if none was kept."""
        entry = self._kept.pop(id(param), None)
        if entry is None:
            return None
        grad, key = entry
        store.discard(param)
        self.meter.freed(key)
        self.meter.appeared(param, _nbytes(param))
        return grad

    def holds(self, param: Tensor) -> bool:
        """Whether a gradient is kept for `param` (its operands may be dropped already)."""
        return id(param) in self._kept

    def holds_any(self) -> bool:
        return bool(self._kept)

    def clear(self) -> None:
        """Free every kept gradient (a step the scaler skipped, `zero_grad`)."""
        for _, key in self._kept.values():
            self.meter.freed(key)
        self._kept.clear()

    def report(self) -> dict[str, Any]:
        """The config's budget and the last norm pass's figures (None before the first)."""
        record = (
            self.last.to_json()
            if self.last is not None
            else dict.fromkeys(
                (
                    "keep_budget_bytes",
                    "held_grad_bytes",
                    "computed_grad_bytes",
                    "kept_grad_bytes",
                    "recomputed_share",
                )
            )
        )
        return {"keep_budget": self.budget, **record}


def computed_twice(param: Tensor, store: DeferredGrads) -> bool:
    """Whether the norm pass computes `param`'s gradient from kept operands (and the update pass would
    compute it again): not when the step holds it as one tensor (crossed over, arrived whole, `.grad`)."""
    return param.grad is None and store.held(param) is None and not store.crossed_over(param)


def auto_budget(params: list[Tensor]) -> int:
    """keep_budget="auto": the CUDA caching allocator's free memory now, less the margin (module
    docstring)."""
    device = params[0].device if params else torch.device("cpu")
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    largest = max((_nbytes(p) for p in params), default=0)
    margin = AUTO_MARGIN_GRADIENTS * largest + int(AUTO_MARGIN_FRACTION * total)
    return max(free + unused - margin, 0)


def check_keep_budget(
    cfg: OptimizerConfig, schedule: str, distributed: object | None, experts: list[Tensor]
) -> None:
    """Refuse, when the optimizer is built, a keep budget it could not honour (module docstring)."""
    budget = cfg.keep_budget
    if budget == 0:
        return
    if schedule != "deferred":
        raise SonarUsageError(
            f"keep_budget={budget!r} with schedule={schedule!r}: the budget keeps gradients the deferred "
            "step's norm pass computed, and the in-backward schedule computes each expert gradient once, in "
            "backward. Use schedule='deferred' (with expert_clip='global' or model.sonar.clip_grad_norm_), "
            "or drop keep_budget."
        )
    if distributed is not None:
        raise SonarUsageError(
            f"keep_budget={budget!r} under a distributed engine: which tensors cross over (and so which "
            "gradients the norm pass computes) differs by rank, and the ranks must run the same reductions. "
            "Use keep_budget=0 with sonar_fx.distributed."
        )
    devices = {p.device.type for p in experts}
    if budget == "auto" and devices != {"cuda"}:
        everything = sum(_nbytes(p) for p in experts)
        raise SonarUsageError(
            "keep_budget='auto' reads the CUDA caching allocator's free memory, and these expert tensors "
            f"are on {', '.join(sorted(devices)) or 'no device'}: there is no allocator to ask. Give bytes: "
            f"keep_budget={everything} keeps every expert gradient of this model (each computed once, "
            "standard's memory), 0 keeps none (each computed twice, one alive at a time)."
        )


def _nbytes(param: Tensor) -> int:
    return param.numel() * param.element_size()
