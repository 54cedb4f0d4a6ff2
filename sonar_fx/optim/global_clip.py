"""Exact global-norm clipping of expert gradients (expert_clip="global"): two forward-backward passes.

Pass 1 computes every gradient: dense ones stay in `.grad`, each expert gradient leaves only its norm
and is freed at once, so expert gradients are never all alive. The global norm (dense + experts,
summed in parameter order as `clip_grad_norm_` sums it) gives the clip coefficient. Pass 2 runs the
forward again from the same RNG state and a backward that computes expert gradients only (`inputs=`),
clipping and updating each. Costs one more forward and backward; the graph of pass 1 is not kept
(that would hold every activation through both passes, and a compiled backward may reuse its saved
buffers, which is why torch refuses retain_graph for it). This module drives the passes; the
optimizer's update path asks `norm_pass` whether to update, and `ExpertClipper` holds the norms.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

import torch
from torch import Tensor

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.nonfinite import NonFinitePolicy, finite
from sonar_fx.optim.norms import ExpertClipper, clip_coefficient, plain, total_norm
from sonar_fx.optim.reduction import GradReduction
from sonar_fx.optim.stats import SonarStats


class Optimizer(Protocol):
    """What the passes read and write of `SonarOptimizer` (which imports this module, not the reverse)."""

    cfg: OptimizerConfig
    clipper: ExpertClipper
    distributed: GradReduction | None
    experts: ExpertSet
    nonfinite_policy: NonFinitePolicy
    stats: SonarStats

    def dense_params(self) -> list[Tensor]: ...

    def model_order(self) -> dict[int, int]: ...

    def dense_name(self, param: Tensor) -> str: ...


def backward(opt: Optimizer, loss: Callable[[], Tensor] | Tensor) -> Tensor:
    """Both passes of one step (see the module docstring); returns pass 1's loss, detached."""
    if not callable(loss):
        raise SonarUsageError(
            "expert_clip='global' runs the forward twice (the global norm is known only after a first "
            "backward): pass the forward as a closure, optimizer.backward(lambda: model(**batch).loss)."
        )
    clipper = opt.clipper
    if clipper.backward_pass is not None or clipper.current.experts:
        raise SonarUsageError(
            "optimizer.backward() was called twice before step(): expert_clip='global' applies the "
            "update of a step once; call step() (or abandon_step()) after each backward."
        )
    rng = _rng_state()
    clipper.backward_pass = "norm"
    try:
        first = loss()
        first.backward()
    except BaseException:
        clipper.abandon()
        raise
    experts = _global_norm(opt)
    if experts is None:  # non-finite under nonfinite="skip": the step is skipped
        return first.detach()
    _set_rng_state(rng)  # pass 2 draws what pass 1 drew (dropout): the same forward, bit for bit
    clipper.backward_pass = "update"
    replay = nullcontext(experts) if opt.distributed is None else opt.distributed.replay(experts)
    try:
        with replay as inputs:  # an engine's own setting for pass 2 (DDP: its reducer left out)
            torch.autograd.backward(loss(), inputs=inputs)
    finally:
        clipper.backward_pass = None
    return first.detach()


def norm_pass(opt: Optimizer, name: str, param: Tensor, grad: Tensor) -> bool:
    """In pass 1, record the norm of `name`'s gradient and update nothing: True if it did."""
    clipper = opt.clipper
    if opt.cfg.expert_clip != "global":
        return False
    if clipper.backward_pass is None:
        raise SonarUsageError(
            f"{name}: expert_clip='global' clips by the norm of ALL gradients, known only after a "
            "first backward pass: call optimizer.backward(lambda: model(**batch).loss) (it runs both "
            "passes) instead of loss.backward()."
        )
    if clipper.backward_pass == "update":
        return False
    if name in clipper.current.experts:
        raise SonarUsageError(
            f"{name} received two gradients in one backward (a module that runs twice per forward): "
            "expert_clip='global' needs each expert gradient whole; use expert_clip='per_tensor' or None."
        )
    clipper.norm_of(name, grad_like_param(param, grad))  # recorded for the update pass
    return True


@torch.no_grad()
def _global_norm(opt: Optimizer) -> list[Tensor] | None:
    """Between the passes: the global norm and clip coefficient; the experts pass 2 must update
    (None: the step is skipped for a non-finite norm)."""
    norms, names = opt.clipper.current, opt.experts.names_by_id()
    dense = [p for p in opt.dense_params() if p.grad is not None]
    dense_norms = torch._foreach_norm([p.grad for p in dense if p.grad is not None], 2.0) if dense else []
    by_param: dict[int, Tensor] = {id(p): n for p, n in zip(dense, dense_norms, strict=True)}
    ids = {name: pid for pid, name in names.items()}
    experts: list[Tensor] = [p for p in opt.experts.params if names[id(p)] in norms.experts]
    by_param.update({ids[n]: opt.clipper.clip_norm(n) for n in norms.experts})
    in_order = sorted(by_param, key=opt.model_order().__getitem__)
    ordered = [by_param[pid] for pid in in_order]
    if opt.distributed is None:
        norms.total = total_norm(ordered)
    else:  # the engine's reduction of the norms (FSDP2 shards, each rank's own experts)
        norms.total = opt.distributed.global_norm(ordered, [pid in names for pid in in_order])
    norms.dense = plain(total_norm(list(dense_norms))) if dense_norms else None
    assert opt.cfg.max_grad_norm is not None  # the config refuses "global" without a threshold
    opt.clipper.coef = clip_coefficient(norms.total, opt.cfg.max_grad_norm)

    def dense_bad() -> list[str]:
        return [opt.dense_name(p) for p in dense if not finite(p.grad)]

    try:
        skip = opt.nonfinite_policy.at_global_norm(norms.total, norms.experts, dense_bad, opt.stats)
    except BaseException:
        opt.clipper.abandon()
        raise
    if not skip:
        return experts
    for p in opt.dense_params():
        p.grad = None
    opt.clipper.skip_step = True
    return None


def _rng_state() -> tuple[Tensor, list[Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
