"""The deferred schedule inside a kernel backend's autograd backward: hand over, not compute, dw.

Under `schedule="deferred"` a weight gradient is computed at `step()` from the operands its op read
(`sonar_fx.optim.deferred`). Compiled, the graph pass finds a backend's weight-gradient op and turns
it into a recipe; eager, nothing traces the backward, so each backend's autograd backward asks here
first: when the weight it read is an expert parameter (or that parameter transposed) whose owner runs
the deferred schedule, the op and its arguments go to the owner as a recipe (the same op, the same
operands, the view back to the parameter's layout: what the pass would have written), and the
backward returns no gradient for the weight. Otherwise (no owner, the in-backward schedule, another
view of the weight, a graph being traced) the backward computes dw as before; a gradient that then
arrives whole under the deferred schedule is still exact, and the saving guard says so.
Never computes a gradient or updates a weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sonar_fx.passes.recipe import Recipe
from sonar_fx.runtime.registry import owner_of, same_storage

_TRANSPOSE: tuple[str, list[Any], dict[str, Any]] = ("aten.transpose.int", [-2, -1], {})


def defer_weight_grad(weight: Tensor, op: torch._ops.OpOverload, args: Sequence[Any]) -> bool:
    """Hand `op(*args)`, the gradient of `weight` as the op lays it out, to the owner of the expert
    parameter behind `weight` if that owner defers; True when handed over (return None for `weight`).

    `args`: the op's arguments in schema order; every tensor among them becomes a kept operand (detached,
    never a copy), everything else a constant of the recipe. `weight` is what the forward's op read:
    the parameter itself, or its last two dimensions transposed (then the recipe transposes dw back).
    """
    if torch.compiler.is_compiling():
        return False  # a traced backward: the graph pass defers the op it records
    param = weight._base if weight._base is not None else weight
    owner = owner_of(param)
    if owner is None or getattr(owner, "schedule", None) != "deferred":
        return False
    views = _views_to_param(weight, param)
    if views is None:
        return False  # another view of the weight: autograd's gradient arrives whole (and is said so)
    operands: list[Tensor] = []
    encoded = [_operand(a, operands) if isinstance(a, Tensor) else a for a in args]
    owner.defer_expert_(param, Recipe(str(op), encoded, {}, None, views).to_json(), operands)
    return True


def _views_to_param(weight: Tensor, param: Tensor) -> list[tuple[str, list[Any], dict[str, Any]]] | None:
    """The views that take a gradient laid out as `weight` to `param`'s layout, or None if unknown."""
    if weight.storage_offset() != param.storage_offset() or not same_storage(weight, param):
        return None
    if weight.shape == param.shape and weight.stride() == param.stride():
        return []
    transposed = param.transpose(-2, -1)
    if weight.shape == transposed.shape and weight.stride() == transposed.stride():
        return [_TRANSPOSE]
    return None


def _operand(t: Tensor, operands: list[Tensor]) -> dict[str, int]:
    # Detached (a view, not a copy): a saved input unpacked in backward carries its grad_fn, which
    # would keep the whole autograd graph upstream of it alive until step().
    operands.append(t.detach())
    return {"operand": len(operands) - 1}
