"""The deferred store's entries and their sums: what one contribution to an expert gradient is (kept
operands with their recipe, or a gradient that arrived whole), and how the step sums them, in the
order autograd would: within a backward in arrival order (`sum_backward`), the backwards' sums as
AccumulateGrad adds them (`accumulate`). Split from `deferred`, which keeps them per tensor and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from sonar_fx.optim.kept_storages import StorageId
from sonar_fx.optim.sliced_sum import add_by_slices
from sonar_fx.passes.recipe import Into, Program, load_recipe, region_of
from sonar_fx.runtime.meter import ExpertGradMeter


@dataclass(frozen=True)
class WeightView:
    """An operand that is the expert weight (or a view of it): rebuilt from the parameter when the
    gradient is computed, since the weight has not moved by then; never kept as memory."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Kept:
    recipe: str
    operands: list[Tensor | WeightView]
    storages: dict[StorageId, int]
    """The storages its kept operands live in, each once (`kept_storages.storages_of`)."""

    def into(self) -> Into | None:
        """Where in the parameter this contribution lies alone (`Program.into`), or None: everywhere."""
        recipe = load_recipe(self.recipe)
        return recipe.into if isinstance(recipe, Program) else None

    def gradient(self, param: Tensor) -> Tensor:
        ops = [
            param.as_strided(o.size, o.stride, o.offset) if isinstance(o, WeightView) else o
            for o in self.operands
        ]
        return load_recipe(self.recipe).run(ops)


Entry = Kept | Tensor
"""One contribution to an expert gradient: the operands of a weight-gradient GEMM, or a gradient that
arrived whole (a use of the weight outside any captured GEMM, taken out of `.grad` by its hook)."""


def pieces(group: list[Entry]) -> int:
    """Gradient-sized tensors `sum_backward` makes of `group`: one per whole entry, one for all its slices."""
    sliced = [isinstance(e, Kept) and e.into() is not None for e in group]
    return sliced.count(False) + any(sliced)


def nothing() -> None:
    return None


def alive_for_a_moment(meter: ExpertGradMeter, nbytes: int) -> None:
    """A gradient-sized temporary that lived beside what the meter counts now, and is freed."""
    temporary = object()
    meter.appeared(temporary, nbytes)
    meter.freed(temporary)


def after_first(call: Callable[[], None] | None) -> Callable[[], None]:
    """`call` on every call but the first (None: nothing)."""
    if call is None:
        return nothing
    first = [True]

    def each() -> None:
        if first[0]:
            first[0] = False
        else:
            call()

    return each


def sum_backward(
    group: list[Entry], param: Tensor, *, own: bool, before_piece: Callable[[], None] = nothing
) -> Tensor | None:
    """One backward's contributions summed in arrival order: the first as is, each next added in
    place (`a.add_(b)` is `a + b`, bit for bit). `own`: its whole gradients may be written. A slice's
    contribution is added into its slice of the sum (a zero-filled one if it comes first): autograd adds
    it padded with zeros, and x + 0 is x (a -0.0 may come out +0.0, equal values no update tells apart).
    `before_piece` is called before each gradient-sized tensor is made (a slice's is not one)."""
    total = None
    for entry in group:
        into = entry.into() if isinstance(entry, Kept) else None
        if isinstance(entry, Kept) and into is not None:  # one slice's gradient: into the sum's slice
            if total is None:
                before_piece()
                total = param.new_zeros(param.shape)  # SelectBackward's zeros: contiguous, param's dtype
            region_of(total, into).add_(entry.gradient(param))
            continue
        before_piece()
        grad = entry.gradient(param) if isinstance(entry, Kept) else entry
        if total is None:
            total = grad if own or isinstance(entry, Kept) else grad.clone()
        else:
            total.add_(grad)
        del grad  # freed before the next piece is computed: the sum and one piece alive, not two
    return total


def accumulate(
    groups: list[list[Entry]],
    param: Tensor,
    *,
    own: bool,
    before_piece: Callable[[], None] = nothing,
    before_slice: Callable[[int], None] | None = None,
) -> Tensor | None:
    """The backwards' sums accumulated as AccumulateGrad does: the first assigned, each next added.
    `before_slice` (given: a gradient is in flight beside this one): a backward's sum after the first
    is added one run of experts at a time where its recipe allows (`sliced_sum`; the same additions),
    `before_slice(nbytes)` called before each slice is made, rather than made whole beside the total."""
    total = None
    for group in groups:
        if total is not None and before_slice is not None and by_slices(total, group, before_slice):
            continue
        part = sum_backward(group, param, own=own, before_piece=before_piece)
        if part is None:
            continue
        if total is None:
            total = part
        else:
            total.add_(part)
        del part  # freed before the next backward's sum is made: the total and one piece, never two
    return total


def by_slices(total: Tensor, group: list[Entry], before_slice: Callable[[int], None]) -> bool:
    """`group`'s sum added into `total` by expert slices where every entry allows it (`sliced_sum`)."""
    kept = [(e.recipe, e.operands) for e in group if isinstance(e, Kept)]
    return len(kept) == len(group) and add_by_slices(total, kept, before_slice)
