"""The eager deferred capture's paths: for each way an experts module reads an expert weight in a GEMM,
how to run the GEMM on the detached weight and which operands and recipe give autograd's weight gradient
again at `step()`.

Each `capture_*` takes a call the capture mode saw (`defer_eager.DeferGemms`) and returns a `Capture`,
or None where the call is not one it knows (autograd then computes that gradient, whole, as before). A
recipe repeats autograd's own derivative ops on the same operands (torch's derivatives.yaml), so the
gradient is bitwise autograd's:
- `torch._grouped_mm` on the weight or its transpose (transformers' grouped_mm): one grouped GEMM;
  on a copy of the weight cast to another dtype, or its transpose (torchtitan's experts with fp32
  weights: `w.bfloat16().transpose(-2, -1)`): the same GEMM in the copy's dtype, then ToCopyBackward's
  cast back to the parameter's;
- `sonar_fx::grouped_mm` (the reference model's kernel): its backward op, weight output;
- `bmm` on gathered rows `W[ids]` (transformers' batched_mm): `dy.bmm(x^T)` (or `x^T.bmm(dy)` for a
  transposed layout), then IndexBackward's zero-filled, accumulating `_index_put_impl_` in slot order;
  `bmm` on the batched weight itself (Llama-4's experts): the bmm derivative alone;
- the per-expert forms (a GEMM on one expert's slice in a loop, rows of per-expert vectors, embedding
  gathers): `defer_eager_forms`.
Pure torch over what the call hands over; never updates a weight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sonar_fx.passes.recipe import Program, Recipe
from sonar_fx.runtime.registry import owner_of


@dataclass(frozen=True)
class Keep:
    """What backward hands the owner for one captured GEMM; holds no tensor (the autograd node saves
    them, and frees them when its backward ends)."""

    recipe: str
    operands: Callable[[Tensor, tuple[Tensor, ...]], list[Tensor]]
    """(dy, saved) -> the recipe's operands."""


@dataclass(frozen=True)
class Capture:
    """A GEMM run on the detached expert weight, and what backward must keep for its weight gradient."""

    output: Tensor
    """The GEMM's result (no autograd edge to the weight)."""
    param: Tensor
    saved: tuple[Tensor, ...]
    """Forward tensors the recipe reads (detached: never the graph upstream of them)."""
    keep: Keep


def deferred_param(w: Tensor) -> Any:
    """(param, owner) when `w` is an expert parameter (or its view) trained by the deferred schedule."""
    param = w._base if w._base is not None else w
    owner = owner_of(param)
    if owner is None or getattr(owner, "schedule", None) != "deferred" or not param.requires_grad:
        return None
    return param, owner


def _gathered_from(w: Tensor, node: str) -> tuple[Tensor, Any] | None:
    """(param, its grad_fn) when `w` was read straight off a deferred expert parameter by `node`
    (IndexBackward0: `W[ids]`, SelectBackward0: `W[e]`)."""
    fn = w.grad_fn
    if fn is None or fn.name() != node or len(fn.next_functions) != 1:
        return None
    acc = fn.next_functions[0][0]
    param = getattr(acc, "variable", None)
    if param is None or deferred_param(param) is None or param._base is not None:
        return None
    return param, fn


# ------------------------------------------------------------------ torch._grouped_mm (transformers)

_GROUPED_MM_RECIPE = Recipe(
    "aten._grouped_mm.default", [{"operand": 0}, {"operand": 1}], {"offs": {"operand": 2}}, None, []
).to_json()
"""`_grouped_mm(a, b, offs)` over the kept operands [a, b, offs]: (x^T, dy) or, transposed, (dy^T, x)."""


def capture_grouped_mm(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    x, w = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if not isinstance(w, Tensor) or not isinstance(x, Tensor) or offs is None or x.dim() != 2:
        return None
    found = _grouped_mm_weight(w)
    if found is None:
        return None  # another view of the weight: autograd keeps its gradient whole
    param, transposed, cast = found
    y = func(x, w.detach(), *args[2:], **kwargs)
    # (dy^T, x) for a transposed weight: the gradient comes out in the parameter's own layout, so the
    # step never copies it to another (one gradient alive, not two).
    operands = _transposed_operands if transposed else _plain_operands
    recipe = _cast_back_program(str(param.dtype), str(param.device)) if cast else _GROUPED_MM_RECIPE
    return Capture(y, param, (x.detach(), offs), Keep(recipe, operands))


def _grouped_mm_weight(w: Tensor) -> tuple[Tensor, bool, bool] | None:
    """(param, transposed, cast) when `w` is a deferred expert parameter or its transpose (`cast`
    False), or a copy of it cast to another dtype, or that copy's transpose (`cast` True: torchtitan's
    experts read fp32 weights as `w.bfloat16().transpose(-2, -1)`)."""
    found = deferred_param(w)
    if found is not None:
        source = param = found[0]
        cast = False
    else:
        source = w._base if w._base is not None else w
        param = _cast_from(source)
        if param is None:
            return None
        cast = True
    if w is source:
        return param, False, cast
    flipped = source.transpose(-2, -1)
    if w.shape == flipped.shape and w.stride() == flipped.stride():
        return param, True, cast
    return None


def _cast_from(copy: Tensor) -> Tensor | None:
    """The deferred parameter `copy` was cast from (`param.to(dtype)`, `param.bfloat16()`: autograd's
    ToCopyBackward0 straight onto the parameter's AccumulateGrad), where the copy has the parameter's
    shape, strides and device (so its gradient, cast back, is laid out as the parameter's) and both
    dtypes are real floating point (the cast back is then `to(dtype)` alone)."""
    fn = copy.grad_fn
    if copy._base is not None or fn is None or fn.name() != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    param = getattr(fn.next_functions[0][0], "variable", None)
    if not isinstance(param, Tensor) or param._base is not None or deferred_param(param) is None:
        return None
    same_layout = copy.shape == param.shape and copy.stride() == param.stride()
    floating = copy.dtype.is_floating_point and param.dtype.is_floating_point
    return param if same_layout and copy.device == param.device and floating else None


@functools.cache
def _cast_back_program(dtype: str, device: str) -> str:
    """The grouped GEMM's weight gradient (`_GROUPED_MM_RECIPE`, in the copy's dtype), then autograd's
    ToCopyBackward0 (`_to_copy_backward`: `grad.to(param.options())`, i.e. `_to_copy` to the parameter's
    dtype, layout and device): the gradient autograd accumulates into the parameter, bit for bit."""
    gemm = ("aten._grouped_mm.default", [{"operand": 0}, {"operand": 1}], {"offs": {"operand": 2}})
    options = {
        "dtype": {"dtype": dtype.removeprefix("torch.")},
        "layout": {"layout": "strided"},
        "device": {"device": device},
    }
    return Program([gemm, ("aten._to_copy.default", [{"step": 0}], options)]).to_json()


def _plain_operands(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    x, offs = saved
    return [x.t(), dy, offs]


def _transposed_operands(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    x, offs = saved
    return [dy.t(), x, offs]


# ------------------------------------------------------- sonar_fx::grouped_mm (the reference model)

_SONAR_GROUPED_MM_RECIPE = Recipe(
    "sonar_fx.grouped_mm_weight_grad.default", [{"operand": i} for i in range(4)], {}, None, []
).to_json()
"""The reference kernel's weight gradient over [dy, x, w, offs]: its backward op's weight output alone
(the same arithmetic as its autograd runs, without the input gradient)."""


def capture_sonar_grouped_mm(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    if len(args) != 3 or kwargs or not all(isinstance(t, Tensor) for t in args):
        return None
    x, w, offs = args
    found = deferred_param(w)
    if found is None:
        return None
    # The weight as the op read it (a view of the parameter): the store keeps it as a view, not a copy.
    saved = (x.detach(), w.detach(), offs)
    return Capture(
        func(x, w.detach(), offs), found[0], saved, Keep(_SONAR_GROUPED_MM_RECIPE, _kernel_operands)
    )


def _kernel_operands(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    x, w, offs = saved
    return [dy.contiguous(), x, w, offs]  # the kernel's backward takes dy contiguous


# ---------------------------------------------------------------- bmm on gathered rows (batched_mm)


def capture_gathered_bmm(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    for weight_first, w in ((True, a), (False, b)):
        direct = deferred_param(w) if isinstance(w, Tensor) and w._base is None else None
        if direct is not None:  # the batched weight itself (Llama-4: one bmm over every expert)
            other = b if weight_first else a
            y = func(a.detach(), b) if weight_first else func(a, b.detach())
            recipe = _bmm_program(weight_first).to_json()
            return Capture(
                y, direct[0], (other.detach(),), Keep(recipe, _dy_other if weight_first else _other_dy)
            )
        found = _gathered_from(w, "IndexBackward0") if isinstance(w, Tensor) else None
        if found is None:
            continue
        param, fn = found
        indices = fn._saved_indices
        if len(indices) != 1 or not isinstance(indices[0], Tensor):
            return None  # a gather over several dims: left to autograd
        other = b if weight_first else a
        # Not `func` on the gathered copy: bmm would save it (an expert matrix per routed slot, every
        # layer's alive when backward begins) where the weight, which stays put until `step()`, and
        # the ids give it again for the input gradient.
        y = _GatheredBmm.apply(w.detach(), param, indices[0], other, weight_first)
        recipe = _gather_program(tuple(param.shape), weight_first).to_json()
        operands = _dy_other_ids if weight_first else _other_dy_ids
        return Capture(y, param, (other.detach(), indices[0]), Keep(recipe, operands))
    return None


class _GatheredBmm(torch.autograd.Function):
    """`bmm(W[ids], other)` (or `bmm(other, W[ids])`) on the detached gathered copy, saving the weight
    and the ids instead of the copy: backward gathers it again for `other`'s gradient, the same
    values in the same layout (one gather, as the forward's), so bmm's derivative gives the same bits.
    The weight is saved as itself (no memory): an in-place change before backward is refused by
    autograd's version check, never read stale."""

    @staticmethod
    def forward(
        ctx: Any, gathered: Tensor, param: Tensor, ids: Tensor, other: Tensor, weight_first: bool
    ) -> Tensor:
        ctx.save_for_backward(param, ids)
        ctx.weight_first = weight_first
        return torch.bmm(gathered, other) if weight_first else torch.bmm(other, gathered)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        param, ids = ctx.saved_tensors
        if not ctx.needs_input_grad[3]:  # `other` needs no gradient (a frozen block before the experts)
            return None, None, None, None, None
        gathered = param.detach()[ids]
        # bmm's derivatives (derivatives.yaml): mat2 <- self^T.bmm(grad), self <- grad.bmm(mat2^T)
        if ctx.weight_first:
            return None, None, None, gathered.transpose(1, 2).bmm(dy), None
        return None, None, None, dy.bmm(gathered.transpose(1, 2)), None


def _bmm_program(weight_first: bool) -> Program:
    """bmm's derivative for its weight argument (derivatives.yaml): operands [dy, other] (weight first:
    `dy.bmm(other^T)`) or [other, dy] (`other^T.bmm(dy)`)."""
    Step = tuple[str, list[Any], dict[str, Any]]
    if weight_first:
        transpose: Step = ("aten.transpose.int", [{"operand": 1}, 1, 2], {})
        gemm: Step = ("aten.bmm.default", [{"operand": 0}, {"step": 0}], {})
    else:
        transpose = ("aten.transpose.int", [{"operand": 0}, 1, 2], {})
        gemm = ("aten.bmm.default", [{"step": 0}, {"operand": 1}], {})
    return Program([transpose, gemm])


def _dy_other(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    return [dy, saved[0]]


def _other_dy(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    return [saved[0], dy]


def _gather_program(shape: tuple[int, ...], weight_first: bool) -> Program:
    """bmm's derivative for its weight argument (`_bmm_program`), then IndexBackward: operands
    [dy, other, ids] or [other, dy, ids]."""
    steps = list(_bmm_program(weight_first).steps)
    steps.append(("aten.new_zeros.default", [{"step": 1}, list(shape)], {}))
    # IndexBackward0: accumulate=True, unsafe=True, in slot order (serial on CPU, as autograd runs it)
    steps.append(
        ("aten._index_put_impl_.default", [{"step": 2}, [{"operand": 2}], {"step": 1}, True, True], {})
    )
    return Program(steps, result=2)


def _dy_other_ids(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    other, ids = saved
    return [dy, other, ids]


def _other_dy_ids(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    other, ids = saved
    return [other, dy, ids]
