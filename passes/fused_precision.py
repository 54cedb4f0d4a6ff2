"""Where a program would round a low-precision intermediate that inductor keeps in float32.

A program (`sonar_fx.passes.recipe.Program`) runs its ops one by one at `step()`, each rounding its
bf16/fp16 result as eager torch does. Inductor, compiling the same nodes in standard training, fuses a
chain of pointwise ops into one kernel that computes in float32 and rounds only what it stores (its
default `emulate_precision_casts=False` elides a downcast followed by an upcast). transformers'
batched_mm under inductor is such a chain: inductor decomposes the weight gradient's bmm (a
contraction of one) into `mul(upcast(dy), upcast(x))`, and the partition recomputes x, the activation
`act(gate) * up`, in backward; the fused kernel feeds the unrounded float32 x into the product, the
program fed the rounded bf16 one: other bits in the expert gradient (then in every parameter).

The fix computes that intermediate as the fused kernel does: a node of the program computing a
low-precision value that the program reads only through upcasts (through value-preserving views) runs
on its inputs upcast to float32 and stays float32 (its upcasts then change nothing). Only for ops whose
float32 result is one correctly rounded operation (mul, add, sub, neg: the same bits in eager and in
inductor's vector code); inputs that are operands are stored by the graph (the defer op reads them),
as inductor stores them in standard training (tested on transformers' batched_mm). A low-precision
intermediate read by other arithmetic of the program, or computed by another op (a transcendental
whose float32 code differs), is not rerunnable: the caller keeps what a single op would keep, exact.

Before (program steps; x = act(gate) * up, computed for this gradient alone, rounded at the step):

    x = mul(silu_gate, up); p = mul(upcast(dy), upcast(permute(unsqueeze(x)))); index_put_(.., downcast(p))

After:

    x = mul(upcast(silu_gate), upcast(up)); p = mul(upcast(dy), upcast(permute(unsqueeze(x)))); ...

Pure FX: never runs a graph or imports training code.
"""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
from torch.fx import Node

LOW_PRECISION = (torch.bfloat16, torch.float16)
UPCASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}
VALUE_PRESERVING = {torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default}
"""Ops that copy or re-view values without arithmetic (besides view ops, read from the op's schema)."""
EXACT_IN_FLOAT32 = {
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.sub.Tensor,
    torch.ops.aten.neg.default,
}
"""Ops whose float32 result on float32 inputs is one IEEE operation, rounded once: the same bits
whichever code computes it (eager's kernels, inductor's vectorized C++)."""
REALIZING = {
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten._index_put_impl_.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.mm.default,
}
"""Readers whose input inductor stores in its own dtype first (fallback or extern kernels: an
accumulating index_put falls back under deterministic algorithms, as the exact comparison needs), so
the value they read is rounded as in eager."""


class LowPrecisionFused(ValueError):
    """A low-precision intermediate of the program is read by arithmetic inductor would fuse."""


def float32_sources(cone: Collection[Node], result: Node) -> set[Node]:
    """The nodes of `cone` (a program's nodes; `result` its gradient) computing a low-precision value
    that the cone reads only through upcasts: the program computes them in float32. Raises
    `LowPrecisionFused` where such a value is read by other arithmetic of the cone, or computed by an
    op whose float32 result is not one correctly rounded operation."""
    sources = set()
    for node in cone:
        if node is result or not _rounds(node):
            continue
        readers = _readers_through_views(node, cone, result)
        if readers and all(_is_upcast(r) for r in readers):
            if node.target not in EXACT_IN_FLOAT32:
                raise LowPrecisionFused(
                    f"{node.target} computes a {_dtype(node)} value that inductor's fused kernel keeps "
                    "in float32, with float32 code of its own a program cannot reproduce bitwise"
                )
            sources.add(node)
        elif not all(r.target in REALIZING or r is result for r in readers):
            names = sorted({str(r.target) for r in readers})
            raise LowPrecisionFused(
                f"{node.target} computes a {_dtype(node)} value that {names} read inside one fused "
                "kernel under inductor (float32, unrounded): a program run op by op would round it"
            )
    return sources


def is_low_precision(node: Node) -> bool:
    return _dtype(node) in LOW_PRECISION


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _rounds(node: Node) -> bool:
    """`node` computes a low-precision value from tensors (eager rounds it; a fused kernel may not)."""
    if node.op != "call_function" or not is_low_precision(node) or _preserves_values(node):
        return False
    return bool(node.all_input_nodes)


def _preserves_values(node: Node) -> bool:
    target = node.target
    if target is operator.getitem or target in VALUE_PRESERVING:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _is_upcast(node: Node) -> bool:
    return node.target in UPCASTS and _dtype(node) in (torch.float32, torch.float64)


def _readers_through_views(node: Node, cone: Collection[Node], result: Node) -> list[Node]:
    """The cone's readers of `node`'s values, following value-preserving nodes to their readers (the
    result, a view or not, counts as one: the graph returns it in its own dtype)."""
    readers, todo = [], [u for u in node.users if u in cone]
    while todo:
        user = todo.pop()
        if _preserves_values(user) and user is not result:
            todo.extend(u for u in user.users if u in cone)
        else:
            readers.append(user)
    return readers
