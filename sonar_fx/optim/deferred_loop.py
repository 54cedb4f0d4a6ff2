"""The deferred schedule's loop contract: what a loop does to gradients between backwards and `step()`.

Expert gradients of this schedule exist only as kept contributions (`deferred.DeferredGrads`) until
`step()`, so every habit that reads or writes gradients in between must reach them, or be refused
before any weight moves, naming what to use instead:
- zeroing: `optimizer.zero_grad()` and `model.zero_grad()` (the prepared model's, replaced by
  `ZeroGradWithKept`) drop the kept contributions with the dense gradients. A reset Sonar did not see
  (a wrapper's `zero_grad`, every dense `.grad` set to None) is told by the dense gradients themselves:
  none of the tensors a backward left is still there; refused when contributions of before it remain.
- no zeroing between steps: torch adds the next step's gradients to the last step's; the expert
  gradients of the last step are gone (freed at its `step()`), so a dense gradient that survived the
  last step with no zeroing since is refused, as is a second `step()` after one backward.
- a change to dense gradients after backward (the user's own `clip_grad_norm_`, accelerate's): refused;
  `clip_grad_norm_` here is the habit served exactly: the norm over every parameter, bitwise
  `torch.nn.utils.clip_grad_norm_`'s, and the step clips every expert gradient by it. Its norm pass
  keeps computed gradients within the keep budget for the step's update pass, as the step's own norm
  pass does (`keep_budget.KeptGradients`); under nonfinite="skip" its total norm is the step's verdict
  (`user_clip_skips`): no gradient is computed again for it.
It never updates a weight; it only watches, refuses, and records the user's clip for `step()`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.deferred_gradient import step_gradient
from sonar_fx.optim.keep_budget import KeptGradients
from sonar_fx.optim.nonfinite import NonFinitePolicy, finite
from sonar_fx.optim.norms import ExpertClipper, clip_coefficient, plain, total_norm

if TYPE_CHECKING:  # the deferred step imports this module
    from sonar_fx.optim.grad_watch import DenseGradWatch
    from sonar_fx.optim.stats import SonarStats
    from sonar_fx.optim.step_tracker import StepTracker
    from sonar_fx.runtime.meter import ExpertGradMeter

Identities = dict[int, "weakref.ref[Tensor]"]
"""id(param) -> weak reference to the `.grad` it had."""


def _identities(params: list[Tensor]) -> Identities:
    return {id(p): weakref.ref(p.grad) for p in params if p.grad is not None}


def _survivors(params: list[Tensor], seen: Identities) -> list[Tensor]:
    """Params whose `.grad` is still the very tensor of `seen` (written in place or not)."""
    return [p for p in params if p.grad is not None and id(p) in seen and seen[id(p)]() is p.grad]


@dataclass
class UserClip:
    """A `clip_grad_norm_` through the optimizer, waiting for its `step()`."""

    total: Tensor
    coef: Tensor
    backwards: int
    """Backwards seen when it ran: another one before `step()` would add unclipped gradients."""


@dataclass
class DeferredLoop:
    """What the loop did to gradients since the last step (one per `SonarOptimizer`)."""

    zeroed: bool = True
    """A zeroing Sonar saw since the last step (True before the first)."""
    after_step: Identities = field(default_factory=dict)
    after_backward: Identities = field(default_factory=dict)
    unseen_reset: bool = False
    """Every dense gradient a backward left was gone when the next began, the reset unseen by Sonar."""
    clip: UserClip | None = None
    shown: Tensor | None = None
    """The expert tensor whose gradient `backward_finished` put in `.grad` for a GradScaler to see."""

    def zero_grad(self) -> None:
        self.zeroed, self.after_backward, self.unseen_reset, self.clip = True, {}, False, None
        self.shown = None

    def step_finished(self, dense: list[Tensor]) -> None:
        self.zeroed, self.after_step, self.after_backward, self.clip = False, _identities(dense), {}, None
        self.unseen_reset, self.shown = False, None


def backward_began(opt: LoopOptimizer) -> None:
    """A backward reached the model's outputs: a reset of every dense gradient since the last backward
    is noted (refused at `step()`), and a gradient shown in `.grad` goes back to the kept ones, first,
    so that this backward's contributions are added to it as AccumulateGrad adds them."""
    if opt.schedule != "deferred":
        return
    loop, store = opt.loop, opt.deferred
    reset = bool(loop.after_backward) and not _survivors(opt.dense_params(), loop.after_backward)
    if reset and _keeps_gradients(opt):
        loop.unseen_reset = True
    shown, loop.shown = loop.shown, None
    if shown is not None and shown.grad is not None:
        grad, shown.grad = shown.grad, None
        store.add_accumulated(shown, grad)


def backward_finished(opt: LoopOptimizer) -> None:
    """The backward ended. Where no parameter holds a `.grad` (every dense tensor frozen), one expert
    gradient is computed now and shown in `.grad`: a GradScaler's `step()` asserts that it checked at
    least one gradient before it calls ours ("No inf checks were recorded"), and this one it unscales
    and checks itself; the step computes it no more. One expert gradient alive until `step()`."""
    if opt.schedule != "deferred":
        return
    opt.loop.after_backward = _identities(opt.dense_params())
    if any(p.grad is not None for group in opt.param_groups for p in group["params"]):
        return
    if getattr(getattr(opt, "distributed", None), "holds_dense_grads", lambda: False)():
        return  # FSDP2 without gradient sync keeps the dense gradients unsharded: no step() comes next
    for p in opt.experts.params:  # weight-decay splits included
        grad = opt.deferred.gradient(p, consume=True) if id(p) in opt.deferred.kept else None
        if grad is not None:
            p.grad = grad_like_param(p, grad)
            opt.meter.appeared(p, p.grad.nbytes)
            opt.loop.shown = p
            return


class LoopOptimizer(Protocol):
    """What this module reads of `SonarOptimizer` (which imports it, not the reverse)."""

    cfg: OptimizerConfig
    deferred: Any  # deferred.DeferredGrads
    kept_grads: KeptGradients
    loop: DeferredLoop
    nonfinite_policy: NonFinitePolicy
    stats: SonarStats
    clipper: ExpertClipper
    grad_watch: DenseGradWatch
    tracker: StepTracker
    meter: ExpertGradMeter
    param_groups: list[dict[str, Any]]

    @property
    def schedule(self) -> str: ...

    experts: ExpertSet

    def dense_params(self) -> list[Tensor]: ...

    def model_order(self) -> dict[int, int]: ...

    def expert_name(self, param: Tensor) -> str: ...

    def dense_name(self, param: Tensor) -> str: ...


def _keeps_gradients(opt: LoopOptimizer) -> bool:
    """Expert gradients of this step are kept: as operands, or computed by the user's clip within the
    keep budget (their operands dropped)."""
    return bool(opt.deferred.kept) or opt.kept_grads.holds_any()


def refuse_before_step(opt: LoopOptimizer, *, scaled: bool) -> None:
    """Refuse, before any weight moves, a step whose expert gradients are not what plain torch would
    apply (see the module docstring). `scaled`: a GradScaler is stepping this optimizer."""
    dense, loop = opt.dense_params(), opt.loop
    reset_after_backward = bool(loop.after_backward) and not _survivors(dense, loop.after_backward)
    if _keeps_gradients(opt) and (loop.unseen_reset or reset_after_backward):
        raise SonarUsageError(
            "every dense gradient was reset after a backward whose expert gradients Sonar keeps (a "
            "zero_grad() Sonar did not see: a wrapper module's, or each .grad set to None by hand): "
            "plain torch would have reset the experts' gradients too. Call optimizer.zero_grad() or "
            "zero_grad() on the prepared model itself (both drop the experts' kept gradients)."
        )
    stale = _survivors(dense, loop.after_step) if not loop.zeroed else []
    if stale:
        raise SonarUsageError(
            f"no zero_grad() since the last step(), and {opt.dense_name(stale[0])}'s gradient is the one "
            "that step applied: plain torch would add this step's gradients to the last step's (or, with "
            "no backward since, apply them again), but schedule='deferred' freed the experts' gradients "
            "at that step(). Call optimizer.zero_grad() after every step()."
        )
    changed = opt.grad_watch.changed_since_backward(dense)
    if changed:
        raise SonarUsageError(
            f"dense gradients changed between backward and step() ({opt.dense_name(changed[0])}"
            f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}): a clip_grad_norm_ of your own "
            "(or accelerate's)? Under schedule='deferred' the expert gradients do not exist before step(), "
            "so it clipped the dense gradients by a norm without them and left the experts unclipped. "
            "Use model.sonar.clip_grad_norm_(max_norm) instead (the norm over every parameter, bitwise "
            "torch's), or max_grad_norm=..., expert_clip='global' in the config."
        )
    if loop.clip is not None and scaled:
        raise SonarUsageError(
            "model.sonar.clip_grad_norm_ under a GradScaler: the expert gradients it took the norm of are "
            "still scaled, and the step unscales them after. Clip with the config instead "
            "(max_grad_norm=..., expert_clip='global'): the step unscales every gradient, then clips."
        )
    if loop.clip is not None and loop.clip.backwards != opt.tracker.backwards:
        raise SonarUsageError(
            "a backward ran after model.sonar.clip_grad_norm_ and before step(): plain torch would add its "
            "gradients unclipped to clipped ones. Clip once, after the step's last backward."
        )


@torch.no_grad()
def clip_grad_norm_(opt: LoopOptimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` over every parameter, for the deferred schedule: the total norm
    (each expert gradient computed from its kept contributions, its norm taken, then freed or kept
    within the keep budget: `_expert_norms`), the dense gradients clipped now, the experts at `step()`
    by the same coefficient. Returns the total norm."""
    if opt.schedule != "deferred":
        raise SonarUsageError(
            "model.sonar.clip_grad_norm_ needs schedule='deferred': the in-backward schedule has updated "
            "the experts before it could run. For a clip over every parameter there, use max_grad_norm=..., "
            "expert_clip='global' and optimizer.backward(closure)."
        )
    if opt.cfg.clips:
        raise SonarUsageError(
            "model.sonar.clip_grad_norm_ while Sonar clips at step() "
            f"(max_grad_norm={opt.cfg.max_grad_norm}): the gradients would be clipped twice. Set "
            "max_grad_norm=None to clip yourself, or drop this call."
        )
    if opt.loop.clip is not None:
        raise SonarUsageError(
            "model.sonar.clip_grad_norm_ was called twice before step(): clip once per step."
        )
    if getattr(opt, "distributed", None) is not None:
        raise SonarUsageError(
            "model.sonar.clip_grad_norm_ on a distributed engine: the expert gradients it would take the "
            "norm of are this rank's, before the engine reduces them, so the norm would not be the one "
            "clip_grad_norm_ computes on the plain engine. Refused before any gradient was clipped. Let "
            "Sonar clip at step() instead: max_grad_norm=<max_norm>, expert_clip='global' in the config "
            "(one norm over every parameter of every rank, as the engine's clip_grad_norm_ returns it)."
        )
    order = opt.model_order()
    dense = [p for p in opt.dense_params() if p.grad is not None]
    norms: dict[int, Tensor] = {}
    if dense:
        grads = [p.grad for p in dense if p.grad is not None]
        norms.update(zip(map(id, dense), torch._foreach_norm(grads, norm_type), strict=True))
    expert_norms = _expert_norms(opt, norms, norm_type)
    if not norms:
        return torch.tensor(0.0)
    total = total_norm([norms[pid] for pid in sorted(norms, key=order.__getitem__)], norm_type)
    coef = clip_coefficient(total, max_norm)
    if dense:
        torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    opt.grad_watch.backward_finished(opt.dense_params())  # our own write: not the user's clip
    current = opt.clipper.current
    current.experts.update(expert_norms)
    current.total = plain(total)
    opt.loop.clip = UserClip(total, coef, opt.tracker.backwards)
    return total


def _expert_norms(opt: LoopOptimizer, norms: dict[int, Tensor], norm_type: float) -> dict[str, Tensor]:
    """Each expert gradient's norm (into `norms` by id, and returned by name): computed from its kept
    contributions, counted on the meter while alive, then freed, or kept for the update pass within
    the keep budget, in the order the update pass reaches them (`keep_budget.KeptGradients`; its
    operands dropped: no scaler here, `refuse_before_step` refuses one; under nonfinite="skip" a
    skipped step drops the kept contributions anyway, and its verdict is these norms: `user_clip_skips`)."""
    store, kept = opt.deferred, opt.kept_grads
    experts: list[Tensor] = [p for p in opt.experts.params if store.has(p)]  # weight-decay splits too
    kept.begin(experts, store)
    expert_norms = {}
    for p in experts:
        name, key = opt.expert_name(p), object()  # a key of its own: a held gradient stays under `p`
        # As autograd's `.grad` would be (the norm's own bits); read in place where held as one tensor.
        grad = step_gradient(store, opt.meter, p, consume=False, key=key, read_only=True)
        norms[id(p)] = expert_norms[name] = torch._foreach_norm([grad], norm_type)[0]
        if not kept.keep(p, name, grad, key, store, drop=True):
            opt.meter.freed(key)
        del grad
    kept.finish()
    return expert_norms


def user_clip_skips(opt: LoopOptimizer) -> bool:
    """nonfinite="skip" after `clip_grad_norm_`: whether its total norm over every parameter is
    non-finite (the step is then skipped whole, before any weight moves, and counted). Its norms are
    the step's verdict, as the plain loop's `torch.isfinite(clip_grad_norm_(...))` is."""
    clip, current = opt.loop.clip, opt.clipper.current
    assert clip is not None
    dense = opt.dense_params()
    skip = opt.nonfinite_policy.at_global_norm(
        clip.total,
        current.experts,
        lambda: [opt.dense_name(p) for p in dense if not finite(p.grad)],
        opt.stats,
        clip="model.sonar.clip_grad_norm_",
    )
    opt.clipper.skip_step = opt.clipper.skip_step or skip
    return skip


class ZeroGradWithKept:
    """The prepared model's `zero_grad` under the deferred schedule: `nn.Module.zero_grad`, and the
    experts' kept gradients dropped with it (their `.grad` is None until `step()`, so the module's own
    would leave them). A plain object, so a deep copy or a pickle of the model carries it to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, set_to_none: bool = True) -> None:
        nn.Module.zero_grad(self.module, set_to_none)
        owner = self.module.__dict__.get("sonar")
        if owner is not None:
            owner.zero_grad(set_to_none)
