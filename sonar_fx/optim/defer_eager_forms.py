"""The eager deferred capture's per-expert forms: an expert weight read one expert at a time (a view of
its slice in a loop), and per-expert vectors read by row (biases, embedding-style experts).

Each `capture_*` takes a call the capture mode saw (`defer_eager.DeferGemms`) and returns a `Capture`,
or None where the call is not one it knows (autograd then computes that gradient, whole, as before).
What autograd would run is read off the call itself or off the graph node it makes (`grad_fn`'s name
and saved arguments), and the recipe runs THAT op again on the same operands:
- a GEMM on a view of one expert's slice, as the second operand of `mm` (transformers' eager loop:
  `linear(x, W[e])`, `x @ W[e]`; dbrx's fused 2-D experts: `x.matmul(W.view(E, f, h)[e].T)`; jetmoe's
  attention experts): mm's weight gradient (`mm_mat2_backward`: `dy^T.mm(x)^T` for a column-major
  operand, else `x^T.mm(dy)`), a contribution to the elements that view reads alone (`Program.into`).
  Autograd's view backwards (select, permute, view) place it there among zeros and its input buffer
  sums the padded pieces in arrival order; the store adds each into its region of one zero-filled sum
  (`deferred_entries.sum_backward`): the same values, as off its region each piece is zero and 0 + x is x;
- rows of a 2-D expert tensor (a per-expert vector: gpt-oss's biases) read by `b[e]` or `b[ids]`: the
  rows' gradient as backward hands it on (after the engine's `sum_to` of a broadcast add), then
  SelectBackward's placement or IndexBackward's zero-filled, accumulating `_index_put_impl_`;
- `embedding(ids, W)` (doge's embedding-style experts): `embedding_backward` over (dy, ids) with the
  node's own saved arguments.
A 3-D expert tensor read by rows is left to the GEMM captures (`defer_eager_paths`): the GEMM behind
it keeps operands smaller than its rows' gradient. A row's or an embedding's gradient is often larger
than the tensor it lands in (many tokens, few experts): the store then crosses it over (computes it in
backward and holds it, as standard training does) by its rule, never by an unknown form.
Pure torch over what the call hands over; never updates a weight.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sonar_fx.optim.defer_eager_paths import Capture, Keep, deferred_param
from sonar_fx.passes.recipe import Program, Recipe

MM_CALLS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm)
"""Calls that run `mm(x, w)` for a 2-D x and w (matmul's 2-D case is mm)."""


def _expert_view(w: Any) -> tuple[Tensor, tuple[Any, ...]] | None:
    """(param, its region) when `w` is a view of a deferred expert parameter whose backward only places
    its gradient (distinct elements, the parameter's dtype, made with grad enabled), the parameter
    contiguous (so the region is the same in the zero-filled sum the store makes)."""
    if not isinstance(w, Tensor) or w._base is None or w.grad_fn is None:
        return None
    found = deferred_param(w)
    if found is None:
        return None
    param = found[0]
    if w.dtype != param.dtype or w.is_complex() or not param.is_contiguous():
        return None
    if not _distinct_elements(w.size(), w.stride()):
        return None  # an expanded view: its backward sums, not places
    region = (tuple(w.size()), tuple(w.stride()), w.storage_offset() - param.storage_offset())
    return param, region


def _distinct_elements(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    dims = sorted((st, sz) for sz, st in zip(size, stride, strict=True) if sz > 1)
    reach = 1
    for st, sz in dims:
        if st < reach:
            return False
        reach = st * sz
    return True


# ------------------------------------------------------- a GEMM on one expert's slice (eager loops)


def capture_slice_gemm(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    """`linear(x, w)` (mm(x, w^T)) or `x @ w` / `matmul` / `mm` (mm(x, w)), w a view of one expert's
    slice, x 2-D: the GEMM on the detached weight; kept: x (dy comes in backward)."""
    linear = func is torch.nn.functional.linear
    x, w = args[0], (args[1] if len(args) > 1 else kwargs.get("weight"))
    if linear and (args[2] if len(args) > 2 else kwargs.get("bias")) is not None:
        return None  # addmm: another derivative, left to autograd
    if not linear and (len(args) != 2 or kwargs):
        return None
    if not isinstance(x, Tensor) or not isinstance(w, Tensor) or x.dim() != 2 or w.dim() != 2:
        return None
    if w._base is None or deferred_param(w) is None:
        return None  # not a view of an expert tensor (a dense layer's weight): nothing to look at
    mat2 = w.t() if linear else w  # linear's mm reads the weight transposed
    found = _expert_view(mat2)
    if found is None:
        return None
    param, region = found
    y = func(x, w.detach(), *args[2:], **kwargs)
    recipe = _mm_mat2_program(mat2, region).to_json()
    return Capture(y, param, (x.detach(),), Keep(recipe, _dy_x))


def _mm_mat2_program(mat2: Tensor, region: tuple[Any, ...]) -> Program:
    """mm's derivative for its second operand over operands [dy, x] (torch's `mm_mat2_backward`: a
    column-major operand gets `dy^T.mm(x)^T`, any other `x^T.mm(dy)`), into `region`, the elements
    `mat2` reads. A region transposed to the parameter's order (linear's `W[e].t()`) is added through
    the transposed result into the untransposed region: the same elements, read in the sum's order."""
    Step = tuple[str, list[Any], dict[str, Any]]
    size, stride = mat2.size(), mat2.stride()
    steps: list[Step]
    if stride[0] == 1 and stride[1] == size[0]:
        steps = [
            ("aten.t.default", [{"operand": 0}], {}),
            ("aten.mm.default", [{"step": 0}, {"operand": 1}], {}),
            ("aten.t.default", [{"step": 1}], {}),
        ]
    else:
        steps = [
            ("aten.t.default", [{"operand": 1}], {}),
            ("aten.mm.default", [{"step": 0}, {"operand": 0}], {}),
        ]
    (rows, cols), (row_stride, col_stride), offset = region
    if row_stride < col_stride:  # a transposed view of the slice: add in the slice's own order
        steps.append(("aten.t.default", [{"step": len(steps) - 1}], {}))
        region = ((cols, rows), (col_stride, row_stride), offset)
    return Program(steps, into=region)


def _dy_x(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    return [dy, saved[0]]


# ------------------------------------------------------------- rows of a per-expert vector (biases)


def capture_vector_rows(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    """`b[e]` or `b[ids]` on a 2-D deferred expert tensor itself: the rows of the detached tensor; kept:
    their gradient as backward hands it on (and ids)."""
    b = args[0]
    if len(args) != 2 or kwargs or not isinstance(b, Tensor) or b.dim() != 2 or b._base is not None:
        return None
    found = deferred_param(b)
    if found is None:
        return None
    param = found[0]
    rows = func(*args)  # with autograd: its node says which backward plain torch would run
    node = rows.grad_fn.name() if rows.grad_fn is not None else None
    if node == "SelectBackward0" and param.is_contiguous():
        # a copy: the detached view would let an in-place op write the weight, which plain torch refuses
        region = (tuple(rows.size()), tuple(rows.stride()), rows.storage_offset() - param.storage_offset())
        recipe = Program([("aten.alias.default", [{"operand": 0}], {})], into=region).to_json()
        return Capture(rows.detach().clone(), param, (), Keep(recipe, _dy_alone))
    if node == "IndexBackward0":
        indices = rows.grad_fn._saved_indices
        if len(indices) == 1 and isinstance(indices[0], Tensor):
            recipe = _index_backward_program(tuple(param.shape)).to_json()
            return Capture(rows.detach(), param, (indices[0],), Keep(recipe, _dy_ids))
    return None


def _index_backward_program(shape: tuple[int, ...]) -> Program:
    """IndexBackward0 over operands [dy, ids]: dy's rows accumulated into zeros in slot order
    (`_index_put_impl_` with accumulate=True, unsafe=True, as autograd's `index_backward` calls it)."""
    Step = tuple[str, list[Any], dict[str, Any]]
    zeros: Step = ("aten.new_zeros.default", [{"operand": 0}, list(shape)], {})
    ids_dy = [[{"operand": 1}], {"operand": 0}]
    put: Step = ("aten._index_put_impl_.default", [{"step": 0}, *ids_dy, True, True], {})
    return Program([zeros, put], result=0)


def _dy_alone(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    return [dy]


def _dy_ids(dy: Tensor, saved: tuple[Tensor, ...]) -> list[Tensor]:
    return [dy, saved[0]]


# ------------------------------------------------------------- embedding-style experts (doge)

_EMBEDDING = inspect.signature(torch.nn.functional.embedding)


def capture_embedding(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Capture | None:
    """`embedding(ids, W)` on a deferred expert tensor (dense gradient, no max_norm renormalisation):
    the gather on the detached weight; kept: ids (dy comes in backward)."""
    call = _EMBEDDING.bind(*args, **kwargs).arguments
    weight = call.get("weight")
    if call.get("max_norm") is not None or call.get("sparse") or not isinstance(weight, Tensor):
        return None
    if weight._base is not None or deferred_param(weight) is None:
        return None
    out = func(*args, **kwargs)  # with autograd: EmbeddingBackward0's saved arguments are autograd's own
    node = out.grad_fn
    if node is None or node.name() != "EmbeddingBackward0":
        return None
    recipe = Recipe(
        "aten.embedding_backward.default",
        [
            {"operand": 0},
            {"operand": 1},
            int(node._saved_weight_sym_argsize_0),
            _signed(node._saved_padding_idx),
            bool(node._saved_scale_grad_by_freq),
            bool(node._saved_sparse),
        ],
        {},
        None,
        [],
    ).to_json()
    return Capture(out.detach(), weight, (node._saved_indices,), Keep(recipe, _dy_ids))


def _signed(value: int) -> int:
    """A saved int64 the node reports as unsigned (padding_idx -1 reads 2**64 - 1)."""
    return value - 2**64 if value >= 2**63 else value
