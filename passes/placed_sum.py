"""A program's sum of per-expert slice gradients, computed and added one slice at a time.

Where dynamo unrolls a per-expert loop (`linear(x_e, W[e])` for each expert e over static slices), the
backward graph computes each slice's weight gradient, places it in a zero-filled tensor of the whole
weight's shape (SelectBackward) and sums those in the order they arrive:

    g_e  = t(mm(t(dy_e), x_e))                    # one expert's slice (m, n)
    s_e  = select_backward(g_e, [E, m, n], 0, e)  # the whole weight's shape, zero but slice e
    grad = add(add(add(s_3, s_2), s_1), s_0)

The pass keeps that sum as one program (`recipe.build_program`). Run step by step, as written, it holds
every s_e (a whole gradient each), every partial sum and every g_e until it ends: E + E - 1 gradients
and E slices at the step, where standard training held one gradient. `PlacedSum.run` computes instead

    grad = zeros([E, m, n])
    for each term, in the chain's order: compute g_e, grad.select(0, e).add_(g_e), free g_e

so the gradient and one slice's product are alive at once (plus whatever of the program the terms
share, freed after its last reader). Bitwise the chain: an element of slice e receives the same
non-zero terms in the same order (the terms are added in the chain's order, so two terms on one slice
add as the chain adds them); the chain's other terms are zeros there, and x + 0 is x (a -0.0 may come
out +0.0, as in `deferred_entries.sum_backward`: equal values no update tells apart).
`select_backward`'s zeros are the
gradient's dtype and device, contiguous: so is the sum. Found only where the program is exactly that
form (a left-to-right chain of `add`s, each read by the next alone, over at least two
`select_backward`s of one shape, each read by its `add` alone); any other program runs as written.
Pure torch: never imports training code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sonar_fx.passes.scatter_chunks import readers_of

ADD = "aten.add.Tensor"
PLACE = "aten.select_backward.default"

Step = tuple[str, list[Any], dict[str, Any]]
Values = dict[int, Any]
"""Step -> its result, for the steps computed and still to be read."""


@dataclass(frozen=True)
class Term:
    """One `select_backward(product, sizes, dim, index)` of the chain."""

    product: int
    """The step computing the slice's gradient (what `select_backward` places)."""
    dim: int
    index: int


@dataclass(frozen=True)
class PlacedSum:
    """Where a program's result is a chain of `add`s over slice gradients placed by `select_backward`."""

    terms: tuple[Term, ...]
    """In the chain's order of additions."""
    sizes: tuple[int, ...]
    """The whole gradient's shape (every `select_backward`'s)."""
    reads: dict[int, tuple[int, ...]]
    """Step -> the steps it reads (each once per argument naming it), for the steps the terms need."""

    @staticmethod
    def find(steps: Sequence[Step], result: int) -> PlacedSum | None:
        """The placed sum `steps` computes as step `result`, or None where the program has another form."""
        if not steps:
            return None
        readers = readers_of(steps)
        chain = _chain(steps, readers, result % len(steps))
        if chain is None or len(chain) < 2:
            return None
        terms, sizes = [], None
        for leaf in chain:
            name, args, kwargs = steps[leaf]
            if name != PLACE or kwargs or len(args) != 4 or len(readers.get(leaf, [])) != 1:
                return None
            product, shape, dim, index = _step_of(args[0]), args[1], args[2], args[3]
            if product is None or not isinstance(dim, int) or not isinstance(index, int):
                return None
            if not isinstance(shape, list) or not all(isinstance(s, int) for s in shape):
                return None
            if sizes is not None and tuple(shape) != sizes:
                return None
            sizes = tuple(shape)
            terms.append(Term(product, dim, index))
        assert sizes is not None
        reads = _reads_of(steps, {t.product for t in terms})
        return PlacedSum(tuple(terms), sizes, reads)

    def run(self, compute: Callable[[Values, int], Any]) -> Tensor:
        """The sum, from `compute(values, i)` (step i's result, its inputs in `values`): each term's
        product computed when the chain reaches it, added into its slice, and freed."""
        left = {j: 0 for j in self.reads}
        for i in self.reads:
            for j in self.reads[i]:
                left[j] += 1
        for term in self.terms:
            left[term.product] += 1  # read by its select_backward
        values: Values = {}
        total: Tensor | None = None
        for term in self.terms:
            _compute(term.product, values, left, self.reads, compute)
            product = values[term.product]
            if total is None:
                total = product.new_zeros(self.sizes)  # select_backward's zeros: the gradient's dtype
            assert product.dtype == total.dtype, "one sum's slices in two dtypes: not a chain of one weight"
            total.select(term.dim, term.index).add_(product)
            del product
            _release(term.product, values, left)
        assert total is not None
        return total


def _chain(steps: Sequence[Step], readers: dict[int, list[int]], result: int) -> list[int] | None:
    """The leaves of the `add` chain ending at `result`, in the order the chain adds them, or None where
    `result` is not such a chain (each inner `add` read by the next alone, default alpha)."""
    leaves: list[int] = []
    node = result
    while True:
        name, args, kwargs = steps[node]
        if name != ADD or kwargs or len(args) != 2:
            return None
        left, right = _step_of(args[0]), _step_of(args[1])
        if left is None or right is None:
            return None
        if steps[left][0] == ADD:  # (x + y is y + x, bit for bit: which side a leaf is on is no order)
            inner, leaf = left, right
        elif steps[right][0] == ADD:
            inner, leaf = right, left
        else:
            leaves += [right, left]
            return leaves[::-1]
        if readers.get(inner, []) != [node]:
            return None
        leaves.append(leaf)
        node = inner


def _reads_of(steps: Sequence[Step], wanted: set[int]) -> dict[int, tuple[int, ...]]:
    """Step -> the steps it reads, for `wanted` and every step they need."""
    readers = readers_of(steps)
    reads: dict[int, list[int]] = {}
    for j, by in readers.items():
        for i in by:
            reads.setdefault(i, []).append(j)
    found: dict[int, tuple[int, ...]] = {}
    todo = list(wanted)
    while todo:
        i = todo.pop()
        if i not in found:
            found[i] = tuple(reads.get(i, ()))
            todo.extend(found[i])
    return found


def _compute(
    step: int,
    values: Values,
    left: dict[int, int],
    reads: dict[int, tuple[int, ...]],
    compute: Callable[[Values, int], Any],
) -> None:
    """Step `step`'s result into `values`, computing what it reads first; what it read is released."""
    if step in values:
        return
    for j in reads[step]:
        _compute(j, values, left, reads, compute)
    values[step] = compute(values, step)
    for j in reads[step]:
        _release(j, values, left)


def _release(step: int, values: Values, left: dict[int, int]) -> None:
    """One read of `step` done: its result freed after its last reader."""
    left[step] -= 1
    if left[step] == 0:
        del values[step]


def _step_of(value: Any) -> int | None:
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("step"), int):
        return int(value["step"])
    return None
