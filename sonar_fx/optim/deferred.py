"""The deferred schedule: expert gradients computed at `step()` from kept operands, one at a time.

In backward, the graph pass hands over, for each expert tensor, the operands of its weight-gradient
op and a recipe to run it (`sonar_fx.passes.defer_grads`); `DeferredGrads` keeps them, per tensor, in
the order backward produced them, for any number of backwards. At `step()` each expert gradient is
computed from them (the same ops on the same operands) and summed in that order, which is what
autograd's accumulation computes, bit for bit; so the step sees the facts of the whole step first:
- the global norm over ALL gradients (expert_clip="global"): a first pass computes, takes the norm of
  and frees each expert gradient; the update pass computes it again;
- a GradScaler's verdict: every expert gradient is unscaled and checked before any weight moves;
- gradient accumulation: the micro-batches' operands, summed at the step.
A tensor whose kept operands outgrow its gradient (many tokens per step) crosses over: its gradient is
computed then and accumulated in `.grad` from there on, as standard training does. A gradient no graph
deferred (eager hooks, a graph break, a producer with no recipe) stays whole in `.grad` until the step:
exact, but nothing saved for it (said once, loudly).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from sonar_fx.config import OptimizerConfig
from sonar_fx.optim import global_clip
from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.amp import ScalerStep, scaler_step
from sonar_fx.optim.nonfinite import NonFinitePolicy
from sonar_fx.optim.norms import ExpertClipper
from sonar_fx.optim.reduction import StepReduce, step_reduction
from sonar_fx.passes.recipe import Recipe
from sonar_fx.runtime.meter import ExpertGradMeter
from sonar_fx.runtime.registry import same_storage, storage_key


@dataclass(frozen=True)
class _WeightView:
    """An operand that is the expert weight (or a view of it): rebuilt from the parameter when the
    gradient is computed, since the weight has not moved by then; never kept as memory."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Kept:
    recipe: str
    operands: list[Tensor | _WeightView]
    nbytes: int

    def gradient(self, param: Tensor) -> Tensor:
        ops = [
            param.as_strided(o.size, o.stride, o.offset) if isinstance(o, _WeightView) else o
            for o in self.operands
        ]
        return Recipe.from_json(self.recipe).run(ops)


@dataclass
class DeferredGrads:
    """The step's kept operands, per expert tensor, and what they cost."""

    kept: dict[int, list[_Kept]] = field(default_factory=dict)
    live_bytes: int = 0
    """Bytes of operands kept now (storage bytes: a kept view keeps its whole storage)."""
    peak_bytes: int = 0
    """The most kept at once since the last `end_step`."""
    last_peak_bytes: int | None = None
    crossed: dict[str, int] = field(default_factory=dict)
    """Expert tensor name -> operand bytes it held when it crossed over to a kept gradient."""
    whole: set[str] = field(default_factory=set)
    """Expert tensors whose gradient arrived whole (not deferred) in this run."""
    _warned_whole: bool = False
    _crossed_now: set[int] = field(default_factory=set)  # ids that crossed over in this step

    def add(self, param: Tensor, name: str, recipe: str, operands: list[Tensor]) -> None:
        """One backward's operands for `param` (or, past the crossover, its gradient added to `.grad`)."""
        kept = [_weight_view(t) if same_storage(param, t) else t for t in operands]
        own = [t for t in kept if isinstance(t, Tensor)]
        nbytes = sum({storage_key(t): t.untyped_storage().nbytes() for t in own}.values())
        entry = _Kept(recipe, kept, nbytes)
        if param.grad is not None:  # crossed over (or a hook kept it): accumulate as autograd does
            param.grad += entry.gradient(param)
            return
        entries = self.kept.setdefault(id(param), [])
        entries.append(entry)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        held = sum(e.nbytes for e in entries)
        if held > param.numel() * param.element_size():
            param.grad = self.gradient(param, consume=True)
            self.crossed[name] = held
            self._crossed_now.add(id(param))

    def has(self, param: Tensor) -> bool:
        return id(param) in self.kept or param.grad is not None

    def arrived_whole(self, param: Tensor) -> bool:
        """`param`'s gradient is in `.grad` though no operands were kept or crossed over for it."""
        return param.grad is not None and id(param) not in self.kept and id(param) not in self._crossed_now

    def gradient(self, param: Tensor, *, consume: bool) -> Tensor | None:
        """`param`'s gradient for the step: `.grad` (kept whole), then each kept backward's gradient
        added in order. `consume`: drop the operands and `.grad` (the update pass); else they stay and
        the result is a new tensor (the norm pass)."""
        entries = self.kept.pop(id(param), []) if consume else self.kept.get(id(param), [])
        grad = param.grad
        if consume:
            param.grad = None
        elif grad is not None:
            grad = grad.clone()
        for e in entries:
            g = e.gradient(param)
            grad = g if grad is None else grad.add_(g)
            if consume:
                self.live_bytes -= e.nbytes
        return grad

    def clear(self) -> None:
        """Drop every kept operand (`zero_grad`)."""
        self.kept.clear()
        self._crossed_now.clear()
        self.live_bytes = 0

    def end_step(self) -> None:
        self.last_peak_bytes, self.peak_bytes = self.peak_bytes, self.live_bytes
        self._crossed_now.clear()

    def note_whole(self, names: list[str]) -> None:
        """Gradients that arrived whole: say once that they were kept (exact, nothing saved)."""
        self.whole.update(names)
        if names and not self._warned_whole:
            self._warned_whole = True
            warnings.warn(
                f"sonar: schedule='deferred' kept {len(names)} expert gradient(s) whole until step() "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): they were computed "
                "outside a compiled graph (compiler='eager', a graph break, or a weight-gradient op with "
                "no recipe). Training is exact, but no memory is saved for them; compile with "
                "compiler='aot_eager' or 'inductor' (report()['deferred'] lists them).",
                stacklevel=4,
            )

    def report(self) -> dict[str, object]:
        return {
            "kept_operand_bytes": self.live_bytes,
            "kept_operand_peak": self.last_peak_bytes,
            "crossed_over": dict(self.crossed),
            "kept_whole": sorted(self.whole),
        }


def _weight_view(t: Tensor) -> _WeightView:
    return _WeightView(tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))


class SonarOptimizer(global_clip.Optimizer, Protocol):
    """What the deferred step reads and calls of `SonarOptimizer` (which imports this module)."""

    cfg: OptimizerConfig
    clipper: ExpertClipper
    deferred: DeferredGrads
    param_groups: list[dict[str, Any]]
    meter: ExpertGradMeter
    nonfinite_policy: NonFinitePolicy

    def expert_name(self, param: Tensor) -> str: ...

    def dense_step(self) -> None: ...

    def end_step(self) -> None: ...

    def check_deferred(self, name: str, param: Tensor, grad: Tensor | None) -> None: ...

    def update_deferred_(self, name: str, param: Tensor, grad: Tensor, *, path: str) -> None: ...

    def _any_rank(self, local: bool) -> bool: ...


@torch.no_grad()
def step(opt: SonarOptimizer) -> None:
    """The deferred schedule's `step()`: verdicts first (a scaler's inf check, the global norm), then
    the dense step, then each expert computed, clipped, updated and freed in turn."""
    store = opt.deferred
    reduce = step_reduction(opt.distributed)  # an engine's check of the loop, before any weight moves
    experts: list[Tensor] = [p for p in opt.experts.params if store.has(p)]
    store.note_whole([opt.expert_name(p) for p in experts if store.arrived_whole(p)])
    for p in experts:  # before any weight moves (the dense step's included): a model cast after its
        opt.check_deferred(opt.expert_name(p), p, p.grad)  # state was made is refused, not half-stepped
    scaler = scaler_step(opt)
    # A gradient already in `.grad` (crossed over, or kept whole) sat in param_groups when the scaler
    # unscaled and checked them: unscaling it again would divide it by the scale twice.
    unscaled = {id(p) for p in experts if p.grad is not None} if scaler is not None else set()
    clip_all = opt.cfg.expert_clip == "global"
    # A verdict before any weight moves: the scaler's, the global norm, or nonfinite="skip"'s promise
    # that a skipped step is as if never seen (each costs one more computation of every gradient).
    skip_whole = opt.nonfinite_policy.mode == "skip"
    if scaler is not None or clip_all or skip_whole:
        found_inf = _first_pass(opt, experts, scaler, clip_all or skip_whole, unscaled, reduce)
        if scaler is not None and found_inf is not None and found_inf.item():
            scaler.report_inf(found_inf)  # the scaler skips the step as if it had seen it: so do we
            opt.clipper.abandon()
            return
        if clip_all and global_clip._global_norm(opt) is None:
            experts = []  # nonfinite="skip": the dense step below skips too
        elif skip_whole and not clip_all and not opt.clipper.skip_step:
            experts = [] if _skip_for_experts(opt) else experts
        if clip_all:
            opt.clipper.backward_pass = "update"  # the expert updates clip by the global coefficient
    skipped = opt.clipper.skip_step
    opt.dense_step()
    if skipped:  # nonfinite="skip": the whole step, as if its batches had never been seen
        store.clear()
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        opt.end_step()
        return
    names = []
    for p in experts:
        name = opt.expert_name(p)
        deferred = not store.arrived_whole(p)
        # In the parameter's layout at once (the recipe may give a transposed view): the view is freed
        # as the copy returns, so one gradient's worth is alive, as autograd's layout contract leaves it.
        grad = grad_like_param(p, _required(store.gradient(p, consume=True)))
        grad = reduce(name, grad)  # the engine's reduction (DDP: the mean over ranks), before all else
        opt.meter.appeared(p, grad.nbytes)
        try:
            if scaler is not None and id(p) not in unscaled:
                scaler.unscale_(grad, torch.zeros((), dtype=torch.float32, device=grad.device))
            opt.update_deferred_(name, p, grad, path="deferred" if deferred else "kept")
        finally:
            opt.meter.freed(p)
        names.append(name)
    err = opt.nonfinite_policy.after_backward(names, opt._any_rank)
    opt.end_step()
    if err is not None:
        raise err


def _skip_for_experts(opt: SonarOptimizer) -> bool:
    """nonfinite="skip", dense clip: whether an expert norm of the first pass is non-finite (the step
    then skips whole, the dense half included, before any update)."""
    norms = opt.clipper.current.experts
    bad = [name for name, n in norms.items() if not bool(torch.isfinite(n))]
    if not bad:
        return False
    opt.nonfinite_policy.skip_before_update(bad, opt.stats)
    opt.clipper.skip_step = True
    return True


def _first_pass(
    opt: SonarOptimizer,
    experts: list[Tensor],
    scaler: ScalerStep | None,
    clip_all: bool,
    unscaled: set[int],
    reduce: StepReduce,
) -> Tensor | None:
    """Compute each expert gradient once, unscale and check it (scaler; not those in `unscaled`, ids of
    gradients the scaler itself unscaled and checked) and record its norm (global clip), then free it.
    Returns the experts' inf verdict (scaler only)."""
    found_inf = None
    if scaler is not None and experts:
        found_inf = torch.zeros((), dtype=torch.float32, device=experts[0].device)
    for p in experts:
        grad = grad_like_param(p, _required(opt.deferred.gradient(p, consume=False)))
        grad = reduce(opt.expert_name(p), grad)  # the engine's reduction, before the norm and verdict
        opt.meter.appeared(p, grad.nbytes)
        if scaler is not None and found_inf is not None and id(p) not in unscaled:
            scaler.unscale_(grad, found_inf)
        if clip_all:
            opt.clipper.norm_of(opt.expert_name(p), grad)
        del grad
        opt.meter.freed(p)
    return found_inf


def _required(grad: Tensor | None) -> Tensor:
    assert grad is not None, "an expert with neither kept operands nor a gradient was stepped"
    return grad
