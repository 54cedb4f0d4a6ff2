"""What backward hands the deferred schedule, and what it costs: the operands of a weight-gradient GEMM
(from the graph pass's op or the eager capture), or a gradient that autograd computed whole (from the
expert's hook). Both are kept per backward in `deferred.DeferredGrads`; a gradient held from backward to
`step()` (arrived whole, or past the crossover) is counted alive by the meter and explained by the
saving guard when it arrives. Never updates a weight.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim import deferred, group_checks
from sonar_fx.optim.saving import SavingGuard
from sonar_fx.runtime.meter import ExpertGradMeter


class SonarOptimizer(group_checks.Optimizer, Protocol):
    """What the intake reads of `SonarOptimizer` (which imports this module)."""

    _names: dict[int, str]
    compiler: str
    deferred: deferred.DeferredGrads
    meter: ExpertGradMeter
    saving: SavingGuard

    @property
    def schedule(self) -> str: ...


@torch.no_grad()
def keep_operands(
    opt: SonarOptimizer, param: Tensor, recipe: str, operands: list[Tensor], *, reached: Tensor | None = None
) -> None:
    """Keep one backward's operands of `param`'s weight gradient for `step()`, if this backward would
    accumulate into `param` at all (`deferred.wanted_by_this_backward`). `reached`: the tensor autograd
    differentiates for `param` where that is another (FSDP2's unsharded parameter of a sharded one)."""
    name = opt._names.get(id(param))
    if name is None:
        raise KeyError("defer_expert_ got a tensor that is not one of this optimizer's experts.")
    if opt.schedule != "deferred":
        raise SonarUsageError(
            f"{name}: a graph compiled for schedule='deferred' ran for a model prepared with "
            f"schedule={opt.schedule!r} (a graph dynamo reused across models of one class). Prepare "
            "every model of one class with the same schedule, or call torch._dynamo.reset() between them."
        )
    group_checks.refuse_before_update(opt, "deferred")
    target = param if reached is None else reached
    node = deferred.accumulation_node(target)
    # Plain torch would not accumulate into it: keep nothing.
    if not deferred.wanted_by_this_backward(target, name, node):
        return
    crossed = opt.deferred.crossed_over(param)
    opt.deferred.add(param, name, recipe, operands, reached=reached, node=node)
    if opt.deferred.crossed_over(param) and not crossed:
        # Past the crossover: its gradient is held from now until step() (the store counts it alive).
        nbytes = param.numel() * param.element_size()
        opt.saving.crossed_over(name, operand_bytes=opt.deferred.crossed[name], grad_bytes=nbytes)


def keep_whole(opt: SonarOptimizer, param: Tensor) -> None:
    """`param.grad` arrived whole (autograd computed it; no operands were kept): moved to its kept
    contributions, alive until `step()`, and the saving guard says why."""
    name, nbytes = opt.expert_name(param), param.grad.nbytes if param.grad is not None else 0
    opt.saving.kept_whole(name, nbytes, compiler=opt.compiler)
    opt.meter.freed(param)  # counted as a graph returned it: the store counts it from here on
    opt.deferred.add_whole(param, name)
