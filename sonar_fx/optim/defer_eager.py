"""The deferred schedule without a compiler: the experts' grouped GEMMs keep their operands, eagerly.

While an experts module runs its forward (a pre-hook enters `DeferGemms`, a hook leaves it), a
grouped GEMM whose weight operand is an owned expert tensor (or its transpose) runs on the DETACHED
weight, so autograd computes the input gradient exactly as before and no weight gradient at all; a
node after the GEMM receives dy when backward reaches it and hands the operands of autograd's weight
gradient to the owner, with its recipe: `_grouped_mm(x^T, dy, offs)` for a weight used as stored, and
`_grouped_mm(dy^T, x, offs)` for a weight used transposed (`x @ W[e]^T`), so that the gradient comes
out in the parameter's own layout and the step never copies it to another (one gradient alive, not
two). Any other use of an expert weight (a gather of expert rows for
bmm, a per-expert loop) is left to autograd: its gradient arrives whole in `.grad` and the deferred
step says it kept it. Never active under dynamo: compiled graphs get the graph pass instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from sonar_fx.passes.recipe import Recipe
from sonar_fx.runtime.registry import owner_of

_GROUPED_MM = {torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm)}


_RECIPE = Recipe(
    "aten._grouped_mm.default", [{"operand": 0}, {"operand": 1}], {"offs": {"operand": 2}}, None, []
).to_json()
"""`_grouped_mm(a, b, offs)` over the kept operands [a, b, offs]: (x^T, dy) or, transposed, (dy^T, x)."""


class DeferGemms(TorchFunctionMode):
    """Grouped GEMMs on expert weights keep their operands instead of computing the weight gradient."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM and torch.is_grad_enabled() and len(args) >= 2:
            deferred = _defer(func, args, kwargs)
            if deferred is not None:
                return deferred
        return func(*args, **kwargs)


def _defer(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Tensor | None:
    x, w = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if not isinstance(w, Tensor) or not isinstance(x, Tensor) or offs is None or x.dim() != 2:
        return None
    param = w._base if w._base is not None else w
    owner = owner_of(param)
    if owner is None or getattr(owner, "schedule", None) != "deferred" or not param.requires_grad:
        return None
    if w is param:
        transposed = False
    elif w.shape == param.transpose(-2, -1).shape and w.stride() == param.transpose(-2, -1).stride():
        transposed = True
    else:
        return None  # another view of the weight: autograd keeps its gradient whole
    y = func(x, w.detach(), *args[2:], **kwargs)
    # `param` is an input of the capture: its output needs a gradient (so dy comes) even where nothing
    # upstream does (a frozen layer before the experts), and its node has the edge to `param` by which
    # the engine says whether this backward accumulates into it (`inputs=`, `autograd.grad`).
    # x detached: the kept operand never holds the autograd graph upstream of x alive.
    return _KeepOperands.apply(y, x.detach(), offs, owner, param, transposed)


class _KeepOperands(torch.autograd.Function):
    """Identity on the GEMM's output whose backward hands the weight gradient's operands to the owner:
    (x^T, dy, offs), or (dy^T, x, offs) for a transposed weight (both views, never copies).

    The operands are the node's saved tensors, not a hook's closure: autograd frees them when the
    backward ends (unless the graph is retained, where a second backward keeps them again), so a loop
    that holds `loss` through `step()` does not hold every layer's inputs with it."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor, offs: Tensor, owner: Any, param: Tensor, transposed: bool):
        ctx.save_for_backward(x, offs)
        ctx.owner, ctx.param, ctx.transposed = owner, param, transposed
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, offs = ctx.saved_tensors
        operands = [dy.t(), x, offs] if ctx.transposed else [x.t(), dy, offs]
        ctx.owner.defer_expert_(ctx.param, _RECIPE, operands)
        return dy, None, None, None, None, None


def register_defer_hooks(modules: Iterable[nn.Module]) -> list[RemovableHandle]:
    """Enter `DeferGemms` for the eager forward of each module in `modules` (the experts modules);
    a forward dynamo traces is left alone (the graph pass defers there)."""
    handles = []
    for module in modules:
        entered: list[DeferGemms] = []

        def enter(_m: nn.Module, _a: Any, entered: list[DeferGemms] = entered) -> None:
            if not torch.compiler.is_compiling():
                mode = DeferGemms()
                mode.__enter__()
                entered.append(mode)

        def leave(_m: nn.Module, _a: Any, _o: Any, entered: list[DeferGemms] = entered) -> None:
            if entered and not torch.compiler.is_compiling():
                entered.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles
