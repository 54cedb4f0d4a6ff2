"""The dense half of `step()`: the dense (or, under expert_clip="global", total) norm, the non-finite
check, the refusal of dense gradients changed after backward while Sonar clips, clipping, and the update
of every dense group. It runs once per step, in either schedule (the deferred step calls it between
its verdicts and the expert updates); it never touches an expert tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from sonar_fx.optim import global_clip
from sonar_fx.optim.checks import refuse_changed_grads
from sonar_fx.optim.grad_watch import DenseGradWatch
from sonar_fx.optim.nonfinite import finite
from sonar_fx.optim.norms import plain
from sonar_fx.optim.step_tracker import StepTracker


class SonarOptimizer(global_clip.Optimizer, Protocol):
    """What the dense step reads and calls of `SonarOptimizer` (which imports this module)."""

    grad_watch: DenseGradWatch
    tracker: StepTracker
    _dense: list[Tensor]

    @property
    def schedule(self) -> str: ...

    def _any_rank(self, local: bool) -> bool: ...

    def _forget_fresh_states(self, names: list[str]) -> None: ...

    def _dense_updates(self) -> list[tuple[dict[str, Any], Any]]: ...

    def _state(self, param: Tensor, *, expert: str | None = None, rule: Any = None) -> dict[str, Any]: ...


def dense_step(opt: SonarOptimizer, *, update: bool = True) -> None:
    """The dense half of `step()`: the dense (or, under expert_clip="global", total) norm, the
    non-finite check, clipping and (`update`) the update of every dense group. Without `update` the
    caller runs `dense_update` later (the deferred step: beside its last expert reduction)."""
    if opt.clipper.skip_step:
        return
    params = [p for p in opt.dense_params() if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    norms = opt.clipper.current
    if grads and norms.dense is None:
        # Always taken (the logged dense norm); get_total_norm + clip_grads_with_norm_ is what
        # clip_grad_norm_ runs: the same bits.
        norms.dense = plain(torch.nn.utils.get_total_norm(grads))
    skipped = opt.nonfinite_policy.at_step(
        norms.dense,
        lambda: [opt.dense_name(p) for p in params if not finite(p.grad)],
        _this_rank if opt.schedule == "deferred" else opt._any_rank,
        opt.stats,
        experts_moved=opt.schedule != "deferred",
    )
    if skipped is not None:
        for p in params:
            p.grad = None
        opt._forget_fresh_states(skipped)
        opt.clipper.skip_step = True
        return
    _refuse_changed_grads(opt)
    clip_by = norms.total if opt.cfg.expert_clip == "global" else norms.dense
    if opt.cfg.clips and clip_by is not None and grads:
        torch.nn.utils.clip_grads_with_norm_(params, opt.cfg.max_grad_norm, clip_by)  # type: ignore[arg-type]
    if update:
        dense_update(opt)


def dense_update(opt: SonarOptimizer) -> None:
    """Every dense group's update with its (clipped) gradients: after `dense_step(update=False)`."""
    for group, rule in opt._dense_updates():
        stepped = [p for p in group["params"] if p.grad is not None]
        states = [opt._state(p, rule=rule) for p in stepped]
        rule.update_(stepped, [p.grad for p in stepped], states, group)


def _this_rank(local: bool) -> bool:
    """The deferred schedule's verdict here, without a collective: it flags its experts only in the
    update pass after this (their verdict is the step's own, over every rank: `deferred_step`), so this
    one is on the dense norm alone, which is the same on every rank (each engine reduces the dense
    gradients before `step()`, and FSDP2's norm is the DTensor's whole): every rank reaches it alike.
    Under expert parallelism this saves the step one of its two verdict all-reduces."""
    return local


def _refuse_changed_grads(opt: SonarOptimizer) -> None:
    """Dense gradients written after backward (a clip of the user's own) while Sonar clips: refused
    before any dense tensor moves (`grad_watch`); after the non-finite check, which names a NaN."""
    if opt.cfg.clips:
        changed = opt.grad_watch.changed_since_backward(opt._dense)
        if changed:
            refuse_changed_grads(
                [opt.dense_name(p) for p in changed], opt.cfg.max_grad_norm, bool(opt.tracker.updated)
            )
