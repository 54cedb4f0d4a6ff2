"""The in-graph hand-over of the deferred schedule: `torch.ops.sonar_fx.expert_defer_`.

Inserted by `sonar_fx.passes.defer_grads` where an expert weight gradient would have been computed:
it gives the gradient's operands and recipe to the parameter's owner, which computes the gradient at
`step()`. As for the update op, which parameter is found at run time from the aliases the graph hands
over. The op changes no tensor of the graph: it names a fresh empty `token` as mutated so that no
dead-code elimination removes it. Naming the weight instead would bump the weight's version counter
in each backward, and a second backward of the same step (two forwards before one backward) would
then refuse its saved weight as "modified by an inplace operation".
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_fx.runtime.registry import resolve, same_storage


@torch.library.custom_op(
    "sonar_fx::expert_defer_", mutates_args=("token",), tags=(torch.Tag.cudagraph_unsafe,)
)
def expert_defer_(
    token: Tensor, operands: list[Tensor], param_aliases: list[Tensor], recipe: str, own: bool
) -> None:
    """Hand `operands` (copied first when `own`) and `recipe` (`sonar_fx.passes.recipe.Recipe` as
    JSON) to the owner of the expert parameter that `param_aliases` alias."""
    if not param_aliases:
        raise RuntimeError("sonar_fx::expert_defer_ needs at least one alias of the expert parameter.")
    param, owner = resolve(param_aliases[0])
    # The weight itself (read by an op that also computes the input gradient) is never copied: it
    # does not change before its own update, which comes after its gradient is computed.
    kept = [owned_copy(t) if own and not same_storage(param, t) else t for t in operands]
    owner.defer_expert_(param, recipe, kept)


@expert_defer_.register_fake
def _expert_defer_fake(
    token: Tensor, operands: list[Tensor], param_aliases: list[Tensor], recipe: str, own: bool
) -> None:
    return None


def owned_copy(t: Tensor) -> Tensor:
    """`t` in storage of its own: `clone` keeps the strides of a dense tensor (a transposed view stays
    transposed), so the recipe's kernels see the layout the graph's would have."""
    return t.clone()


EXPERT_DEFER_OP = torch.ops.sonar_fx.expert_defer_.default
