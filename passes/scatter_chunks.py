"""A program's scattered product run in chunks of experts, so the step never holds it whole.

The weight gradient of a gathered weight (`W[ids]` read by a bmm: transformers' batched_mm) is, as
autograd and the compiled graph compute it,

    product = bmm(a, b)                                  # (S, m, n): one expert's matrix per slot
    grad    = zeros(E, m, n).index_put_([ids], product, accumulate=True)

and `product` holds S/E expert gradients' worth of bytes (S routed slots, E experts): at the step it
would sit beside the gradient it is summed into. `ScatteredProduct.run` computes it a group of experts
at a time instead (every slot of those experts, gathered in slot order: a bmm, then the same
accumulating index_put of those slots into the gradient), freeing each group's product before the
next one, so at most `max_slots` slots' product is alive.

Under inductor the graph holds no bmm there: inductor decomposes a contraction of one into an
elementwise float32 multiply, `downcast(mul(upcast(a), upcast(b)))`, and the program is that (see
`sonar_fx.passes.fused_precision`). The same chunks apply: the multiply and the casts after it (the
"tail", each read by the next alone) run on each chunk's slots, element by element as on the whole.

Why this is bitwise the whole computation, and why only so:
- the contraction is one (a: (S, m, 1), b: (S, 1, n)), so each product element is one multiplication
  rounded once, whatever GEMM kernel the batch size selects; with a longer contraction a kernel chosen
  for another batch size may sum in another order, so such a product is run whole;
- an expert's slots are never split between chunks and keep their slot order: each gradient row
  receives the same contributions, in the same order, in one index_put call. CPU's accumulating
  index_put adds them one by one in slot order; CUDA's sorts the indices (stably) and sums each
  index's contributions before adding them once, so splitting one expert's slots over two calls
  would round its partial sums on CUDA (slot ranges would be bitwise on CPU only).
Legend: S slots, E experts, m x n one expert's matrix. Pure torch: never imports training code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PRODUCT_OPS = ("aten.bmm.default", "aten.mul.Tensor")
"""The product: a bmm, or (inductor's decomposition of a contraction of one) an elementwise multiply."""
TAIL_OPS = {"prims.convert_element_type.default"}
"""Elementwise casts between the product and the put, run on each chunk after its product."""
ACCUMULATING_PUTS = {"aten._index_put_impl_.default", "aten.index_put_.default"}
"""In-place puts: each chunk adds into the gradient the first one wrote (a functional index_put,
a clone per call, is run whole; the compiled pass writes it in place on its own zero buffer)."""
FRESH = {"aten.new_zeros.default", "aten.zeros.default", "aten.full.default"}
SLAB_SHARE = 8
"""Chunks hold at most 1/SLAB_SHARE of the gradient's bytes of product (at least one expert's slots):
the step's transient beside the gradient stays an eighth of a tensor, for about SLAB_SHARE x S/E
chunks (S/E: the whole product's size in gradients), each a bmm and an index_put over its slots."""

Step = tuple[str, list[Any], dict[str, Any]]


@dataclass(frozen=True)
class ScatteredProduct:
    """Where a program computes `index_put_(zeros, [ids], bmm(a, b), accumulate=True)`."""

    product: int
    """The bmm's (or multiply's) step (read by the put or the tail alone: the put computes it chunk by
    chunk)."""
    put: int
    """The accumulating index_put's step, writing into a buffer a zeros step made for it."""
    tail: tuple[int, ...] = ()
    """Casts from the product to the put's values, in order, each read by the next (then the put)."""

    @staticmethod
    def find(steps: Sequence[Step]) -> ScatteredProduct | None:
        """The scattered product of `steps`, or None where they hold none in this form."""
        readers = readers_of(steps)
        for put, (name, args, kwargs) in enumerate(steps):
            if name not in ACCUMULATING_PUTS or kwargs or len(args) < 4 or args[3] is not True:
                continue
            buffer, indices, product = _step_of(args[0]), args[1], _step_of(args[2])
            if buffer is None or product is None or not isinstance(indices, list) or len(indices) != 1:
                continue
            product, tail, consumer = _behind_casts(steps, readers, product, put)
            op, operands, options = steps[product]
            two_tensors = len(operands) == 2 and all(isinstance(t, dict) for t in operands) and not options
            if op not in PRODUCT_OPS or not two_tensors:
                continue
            if steps[buffer][0] not in FRESH or readers[buffer] != [put]:
                continue
            # The buffer's `new_zeros(product, size)` reads the product for its dtype and device alone
            # (a product in another dtype than the values, behind casts, is read by nothing else).
            template = {buffer} if not tail else set()
            if set(readers[product]) <= {consumer, *template} and _template_only(steps[buffer], product):
                return ScatteredProduct(product, put, tail)
        return None

    def run(
        self, put: Callable[..., Any], args: list[Any], product: Callable[..., Tensor], a: Tensor, b: Tensor,
        tail: Sequence[Callable[[Tensor], Tensor]] = (),
    ) -> Any:  # fmt: skip
        """The put step over its decoded `args` (whose values, `args[2]`, were not computed), from the
        product's op and operands `a` and `b` and the `tail` casts; returns what the put returns."""
        buffer, (ids,), rest = args[0], args[1], args[3:]

        def values(a: Tensor, b: Tensor) -> Tensor:
            out = product(a, b)
            for cast in tail:
                out = cast(out)
            return out

        chunks = _expert_chunks(buffer, ids, a, b)
        if chunks is None:  # not the one-contraction form over whole experts: the whole product
            return put(buffer, [ids], values(a, b), *rest)
        out = buffer
        for slots in chunks:
            chunk = values(a.index_select(0, slots), b.index_select(0, slots))
            out = put(buffer, [ids.index_select(0, slots)], chunk, *rest)
            del chunk  # freed before the next chunk's product
        return out


def _behind_casts(
    steps: Sequence[Step], readers: dict[int, list[int]], values: int, put: int
) -> tuple[int, tuple[int, ...], int]:
    """From the put's values step back through casts each read by its successor alone: (the product
    step, the casts in order, the step that reads the product)."""
    casts: list[int] = []
    step, consumer = values, put
    while steps[step][0] in TAIL_OPS and readers.get(step) == [consumer]:
        source = _step_of(steps[step][1][0])
        if source is None:
            break
        casts.insert(0, step)
        step, consumer = source, step
    return step, tuple(casts), consumer


def _expert_chunks(buffer: Tensor, ids: Tensor, a: Tensor, b: Tensor) -> list[Tensor] | None:
    """Slot positions per chunk (whole experts, each expert's slots in slot order), or None where
    the product is run whole: another form, or one chunk would take it all anyway."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[2] != 1 or b.shape[1] != 1 or ids.dim() != 1:
        return None
    if ids.dtype not in (torch.int64, torch.int32) or buffer.dim() != 3 or buffer.shape[0] == 0:
        return None
    if not ids.shape[0] == a.shape[0] == b.shape[0] > 0:
        return None
    slots, experts = ids.shape[0], buffer.shape[0]
    # (a float32 product of a bf16 gradient, as inductor's decomposition computes it, is twice as large)
    per_slot = buffer[0].numel() * max(buffer.element_size(), a.element_size(), b.element_size())
    max_slots = max(1, buffer.nbytes // SLAB_SHARE // per_slot)
    if slots <= max_slots or bool((ids < 0).any()):  # (a negative id wraps: left to the whole put)
        return None
    counts = torch.bincount(ids, minlength=experts).tolist()
    order = torch.argsort(ids, stable=True)  # by expert, each expert's slots in slot order
    chunks, start, size = [], 0, 0
    for count in counts:
        if size and size + count > max_slots:
            chunks.append(order[start : start + size])
            start, size = start + size, 0
        size += count
    if size:
        chunks.append(order[start : start + size])
    return chunks


def _template_only(fresh: Step, product: int) -> bool:
    """`fresh` reads `product` as its first argument alone (`new_zeros`' template) or not at all."""
    name, args, kwargs = fresh
    rest = _steps_in([args[1:], kwargs])
    return product not in rest and (_step_of(args[0]) != product or name == "aten.new_zeros.default")


def _step_of(value: Any) -> int | None:
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("step"), int):
        return int(value["step"])
    return None


def readers_of(steps: Sequence[Step]) -> dict[int, list[int]]:
    """Step -> the steps that read its result (each once per argument naming it)."""
    readers: dict[int, list[int]] = {}
    for i, (_, args, kwargs) in enumerate(steps):
        for j in _steps_in([args, kwargs]):
            readers.setdefault(j, []).append(i)
    return readers


def _steps_in(value: Any) -> list[int]:
    if isinstance(value, list):
        return [j for v in value for j in _steps_in(v)]
    if isinstance(value, dict):
        step = _step_of(value)
        return [step] if step is not None else [j for v in value.values() for j in _steps_in(v)]
    return []
