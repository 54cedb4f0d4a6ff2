"""A micro-batch's piece of an expert gradient added into the running sum a few experts at a time.

For: the deferred step while the reduction of the gradient before is in flight (`deferred_pipeline`).
A gradient of an accumulated step is the sum of its micro-batches' pieces; made whole, a piece beside
the running sum is a second gradient-sized tensor, so the gradient in flight would have to be waited
for (and freed) before it: its collective then overlaps only the first piece's GEMM. Made and added
one expert slice at a time, a piece never exists whole: the gradient in flight, the running sum and one
slice are alive (`SLICES`), and the collective overlaps the whole computation.

Bitwise: on the CPU, `torch._grouped_mm(a, b, offs=offs)` of two 2-D operands (the eager capture's
weight gradient, `defer_eager_paths._GROUPED_MM_RECIPE`) is a loop over the experts, `mm_out` of each
expert's columns of `a` and rows of `b` into its own (m, n) matrix of the output (ATen's
`_grouped_mm_fallback`). The same call over a run of experts (`a` and `b` cut at that run's token
boundaries, its offsets shifted) makes the same `mm_out` calls on the same memory, and `total[e0:e1]
.add_(slice)` adds each element as `total.add_(piece)` does: the order of the additions is unchanged.
Never: slice another recipe, another device (a CUDA grouped GEMM is one kernel whose bits this module
has not measured), nor change what is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from sonar_fx.passes.recipe import Recipe, load_recipe

SLICES = 8
"""A piece is made and added in this many runs of experts: one eighth of a gradient beside the two
(olmoe-cpu: 2.25 MiB beside 2 x 18 MiB). Measured on an olmoe-cpu piece (one thread, shared 2-core
machine): 8 runs took the whole piece's time within the noise; 64 one-expert runs 1.4-2x (more calls)."""

_GROUPED_MM = Recipe(
    "aten._grouped_mm.default", [{"operand": 0}, {"operand": 1}], {"offs": {"operand": 2}}, None, []
)


@dataclass(frozen=True)
class ExpertGemm:
    """One kept contribution that is a 2-D x 2-D grouped GEMM on the CPU: each expert's gradient is
    `a[:, its tokens] @ b[its tokens]`."""

    a: Tensor
    """(m, tokens): the rows of each expert's gradient, its tokens along dim 1."""
    b: Tensor
    """(tokens, n)."""
    offs: Tensor
    """(E,) int32: where each expert's tokens end."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """The gradient's: (E, m, n)."""
        return (self.offs.numel(), self.a.shape[0], self.b.shape[1])

    def ends(self) -> list[int]:
        """Each expert's last token + 1. A planned step's fake offsets have no values: any boundaries
        make slices of the same bytes (the plan's concern), so every expert gets no token there."""
        if is_fake(self.offs):
            return [0] * self.offs.numel()
        return [int(e) for e in self.offs.tolist()]

    def experts(self, first: int, stop: int, ends: Sequence[int]) -> Tensor:
        """Experts first..stop-1 of the gradient: (stop - first, m, n), the same `mm_out` calls."""
        start = ends[first - 1] if first else 0
        end = ends[stop - 1]
        offs = torch.tensor([e - start for e in ends[first:stop]], dtype=self.offs.dtype)
        return torch._grouped_mm(self.a[:, start:end], self.b[start:end], offs=offs)


def expert_gemm(recipe: str, operands: Sequence[object]) -> ExpertGemm | None:
    """The contribution as an `ExpertGemm`, or None where its piece is made whole (another recipe,
    another shape or device)."""
    if load_recipe(recipe) != _GROUPED_MM or len(operands) != 3:
        return None
    a, b, offs = operands
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(offs, Tensor)):
        return None
    if a.dim() != 2 or b.dim() != 2 or offs.dim() != 1 or a.device.type != "cpu" or b.device.type != "cpu":
        return None
    return ExpertGemm(a, b, offs)


def add_by_slices(
    total: Tensor, contributions: Sequence[tuple[str, Sequence[object]]], before_slice: Callable[[int], None]
) -> bool:
    """One backward's kept contributions ((recipe, operands), summed in arrival order) added into
    `total` one run of experts at a time; `before_slice(nbytes)` is called before each slice is made.
    False (nothing done) where one is not an `ExpertGemm` making `total`'s shape: the piece is then
    made whole."""
    found = [expert_gemm(recipe, operands) for recipe, operands in contributions]
    gemms = [g for g in found if g is not None and total.shape == g.shape]
    if not gemms or len(gemms) != len(found) or total.shape[0] == 0:
        return False
    ends = [gemm.ends() for gemm in gemms]
    experts = total.shape[0]
    per_slice = -(-experts // SLICES)
    for first in range(0, experts, per_slice):
        stop = min(experts, first + per_slice)
        part = None
        for gemm, bounds in zip(gemms, ends, strict=True):
            before_slice((stop - first) * gemm.a.shape[0] * gemm.b.shape[1] * gemm.a.element_size())
            piece = gemm.experts(first, stop, bounds)
            if part is None:
                part = piece
            else:
                part.add_(piece)  # a backward's contributions summed first, as `sum_backward` does
            del piece
        assert part is not None
        total[first:stop].add_(part)
    return True
