"""The deferred schedule's `step()`: verdicts first (a GradScaler's inf check, the global norm over
every parameter, nonfinite="skip"), then the dense step, then each expert gradient computed from its
kept contributions (`deferred.DeferredGrads`), reduced as the engine reduces it, clipped, updated and
freed in turn: its reduction runs while the next one is computed (`deferred_pipeline`), so at most two
are alive at once (or, within the keep budget, taken as the first pass kept them: `keep_budget`). The
arithmetic of the kept contributions is `deferred`'s; this module only orders the passes and counts
what each holds alive (`deferred_gradient.step_gradient`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from sonar_fx.config import OptimizerConfig
from sonar_fx.optim import deferred_loop, global_clip
from sonar_fx.optim.amp import ScalerStep, scaler_step
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.deferred_gradient import step_gradient
from sonar_fx.optim.deferred_pipeline import pipelined
from sonar_fx.optim.keep_budget import KeptGradients
from sonar_fx.optim.nonfinite import NonFinitePolicy
from sonar_fx.optim.norms import ExpertClipper
from sonar_fx.optim.reduction import Reduced, StepReduce, step_reduction
from sonar_fx.runtime.meter import ExpertGradMeter


class SonarOptimizer(global_clip.Optimizer, deferred_loop.LoopOptimizer, Protocol):
    """What the deferred step reads and calls of `SonarOptimizer` (which imports this module)."""

    cfg: OptimizerConfig
    clipper: ExpertClipper
    deferred: DeferredGrads
    kept_grads: KeptGradients
    loop: deferred_loop.DeferredLoop
    param_groups: list[dict[str, Any]]
    meter: ExpertGradMeter
    nonfinite_policy: NonFinitePolicy

    def expert_name(self, param: Tensor) -> str: ...

    def dense_step(self, *, update: bool = True) -> None: ...

    def dense_update(self) -> None: ...

    def end_step(self) -> None: ...

    def check_deferred(self, name: str, param: Tensor, grad: Tensor | None) -> None: ...

    def update_deferred_(self, name: str, param: Tensor, grad: Tensor, *, path: str) -> None: ...

    def _any_rank(self, local: bool) -> bool: ...


@torch.no_grad()
def step(opt: SonarOptimizer) -> None:
    """The deferred schedule's `step()`: verdicts first (a scaler's inf check, the global norm), then
    the dense step's verdict and clip, then each expert computed, clipped, updated and freed in turn,
    and the dense update beside the last expert reduction in flight."""
    store = opt.deferred
    reduce = step_reduction(opt.distributed)  # an engine's check of the loop, before any weight moves
    experts: list[Tensor] = [p for p in opt.experts.params if store.has(p) or opt.kept_grads.holds(p)]
    store.note_whole([opt.expert_name(p) for p in experts if store.arrived_whole(p)])
    for p in experts:  # before any weight moves (the dense step's included): a model cast after its
        opt.check_deferred(opt.expert_name(p), p, p.grad)  # state was made is refused, not half-stepped
    scaler = scaler_step(opt)
    deferred_loop.refuse_before_step(opt, scaled=scaler is not None)
    # A gradient already in `.grad` (crossed over, or kept whole) sat in param_groups when the scaler
    # unscaled and checked them: unscaling it again would divide it by the scale twice.
    unscaled = {id(p) for p in experts if p.grad is not None} if scaler is not None else set()
    clip_all = opt.cfg.expert_clip == "global"
    # A verdict before any weight moves: the scaler's, the global norm, or nonfinite="skip"'s promise
    # that a skipped step is as if never seen (each costs one more computation of every gradient).
    skip_whole = opt.nonfinite_policy.mode == "skip"
    # The user's clip (model.sonar.clip_grad_norm_) took every norm after the last backward: under
    # nonfinite="skip" its total is the verdict, and no gradient is computed again for it.
    if opt.loop.clip is not None and skip_whole and scaler is None and not clip_all:
        experts = [] if deferred_loop.user_clip_skips(opt) else experts
    elif scaler is not None or clip_all or skip_whole:
        found_inf = _first_pass(opt, experts, scaler, clip_all or skip_whole, unscaled, reduce)
        # One verdict on every rank: a rank holding other experts (expert parallelism) saw other infs.
        if scaler is not None and opt._any_rank(found_inf is not None and bool(found_inf.item())):
            scaler.report_inf(torch.ones(()))  # the scaler skips the step as if it had seen it: so do we
            opt.kept_grads.clear()
            opt.clipper.abandon()
            return
        if clip_all and global_clip._global_norm(opt) is None:
            experts = []  # nonfinite="skip": the dense step below skips too
        elif skip_whole and not clip_all and not opt.clipper.skip_step:
            experts = [] if _skip_for_experts(opt) else experts
        if clip_all:
            opt.clipper.backward_pass = "update"  # the expert updates clip by the global coefficient
    if opt.loop.clip is not None:  # model.sonar.clip_grad_norm_: its norms and coefficient, recorded
        opt.clipper.coef, opt.clipper.backward_pass = opt.loop.clip.coef, "update"
    skipped = opt.clipper.skip_step
    opt.dense_step(update=False)  # its verdict and clip now, before any weight moves; its update below
    dense_updates = not opt.clipper.skip_step  # not where the dense verdict skipped the dense half
    if skipped:  # nonfinite="skip": the whole step, as if its batches had never been seen
        store.clear()
        opt.kept_grads.clear()
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        opt.end_step()
        return
    names = []
    with pipelined() as line:  # each reduction runs while the next gradient is computed: two alive at most
        for p in experts:
            name = opt.expert_name(p)
            path = "kept" if store.arrived_whole(p) else "deferred"
            update = partial(_update, opt, p, name, path, scaler, unscaled)
            kept = opt.kept_grads.take(p, store)  # the norm pass's, reduced and unscaled: not computed again
            if kept is not None:
                line.started(Reduced(kept), update)
            else:
                grad = step_gradient(
                    store, opt.meter, p, consume=True, key=p, make_room=line.make_room,
                    in_flight=line.in_flight,
                )  # fmt: skip
                # The engine's reduction (DDP: the mean over ranks), started; the update waits for it.
                line.started(reduce(name, grad), update)
                del grad  # the flight holds it until its update, which frees it
            del kept
            names.append(name)
        # The dense update runs while the last expert gradient's collective is in flight: no next
        # gradient is left to overlap it with (the dense and expert tensors are apart: the same bits).
        if dense_updates:
            opt.dense_update()
    store.overlapped += line.overlapped
    err = opt.nonfinite_policy.after_backward(names, opt._any_rank)
    opt.end_step()
    if err is not None:
        raise err


def _update(
    opt: SonarOptimizer,
    p: Tensor,
    name: str,
    path: str,
    scaler: ScalerStep | None,
    unscaled: set[int],
    grad: Tensor,
) -> None:
    """The update pass's end of one expert: unscale (a scaler's), update `p`, free its gradient."""
    try:
        if scaler is not None and id(p) not in unscaled:
            scaler.unscale_(grad, torch.zeros((), dtype=torch.float32, device=grad.device))
        opt.update_deferred_(name, p, grad, path=path)
    finally:
        opt.meter.freed(p)


def _skip_for_experts(opt: SonarOptimizer) -> bool:
    """nonfinite="skip", dense clip: whether an expert norm of the first pass is non-finite on any rank
    (the step then skips whole on every rank, the dense half included, before any update; a rank that
    skipped alone would leave the others waiting in the next collective)."""
    norms = opt.clipper.current.experts
    bad = [name for name, n in norms.items() if not bool(torch.isfinite(n))]
    if not opt._any_rank(bool(bad)):
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
    gradients the scaler itself unscaled and checked) and record its norm (global clip), then free it,
    or keep it for the update pass within the keep budget (`keep_budget`; its id joins `unscaled`).
    Returns the experts' inf verdict (scaler only)."""
    found_inf, store = None, opt.deferred
    if scaler is not None and experts:
        found_inf = torch.zeros((), dtype=torch.float32, device=experts[0].device)
    opt.kept_grads.begin(experts, opt.deferred)
    with pipelined() as line:  # each reduction runs while the next gradient is computed
        for p in experts:
            key = object()  # this pass's own copy: a gradient held whole stays counted under `p`
            unscale = scaler is not None and found_inf is not None and id(p) not in unscaled
            # A held gradient is read in place only where nothing writes it (no unscale, no reduction).
            in_place = not unscale and opt.distributed is None
            grad = step_gradient(
                store, opt.meter, p, consume=False, key=key, read_only=in_place, make_room=line.make_room,
                in_flight=line.in_flight,
            )  # fmt: skip
            checks = (scaler, found_inf) if unscale else (None, None)
            # The engine's reduction, started; the norm, verdict and keep wait for it.
            line.started(
                reduce(opt.expert_name(p), grad),
                partial(_check, opt, p, key, *checks, clip_all, unscaled, scaler is None),
            )
            del grad
    opt.kept_grads.finish()
    opt.deferred.overlapped += line.overlapped
    return found_inf


def _check(
    opt: SonarOptimizer,
    p: Tensor,
    key: object,
    scaler: ScalerStep | None,
    found_inf: Tensor | None,
    clip_all: bool,
    unscaled: set[int],
    drop: bool,
    grad: Tensor,
) -> None:
    """The first pass's end of one expert: unscale and check it (a scaler's; `found_inf`: its verdict so
    far), record its norm (global clip), then keep it for the update pass within the keep budget (its
    id joins `unscaled`) or free it."""
    name = opt.expert_name(p)
    kept = False
    try:
        if scaler is not None and found_inf is not None:
            scaler.unscale_(grad, found_inf)
        if clip_all:
            opt.clipper.norm_of(name, grad)
        kept = opt.kept_grads.keep(p, name, grad, key, opt.deferred, drop=drop)
    finally:
        if kept:
            unscaled.add(id(p))  # (kept unscaled: the update pass must not unscale it again)
        else:
            opt.meter.freed(key)
