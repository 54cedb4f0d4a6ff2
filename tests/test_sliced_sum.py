"""A micro-batch's piece added into the running sum by expert slices (`sonar_fx.optim.sliced_sum`):
bitwise `total.add_(torch._grouped_mm(a, b, offs=offs))`, the plain torch autograd's accumulation runs,
with one slice alive at a time; anything it cannot slice is left whole."""

from __future__ import annotations

import pytest
import torch

from sonar_fx.optim.sliced_sum import _GROUPED_MM, SLICES, add_by_slices

RECIPE = _GROUPED_MM.to_json()


def operands(experts: int, m: int, n: int, dtype: torch.dtype, seed: int, *, transposed: bool):
    """A grouped GEMM's weight-gradient operands as the eager capture keeps them: (x^T, dy) or, for
    a transposed weight, (dy^T, x); uneven token counts, some experts with none."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (experts,), generator=g)
    counts[1] = 0
    counts[-1] = 0
    tokens = int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if transposed:
        dy = torch.randn(tokens, m, generator=g).to(dtype)
        return dy.t(), torch.randn(tokens, n, generator=g).to(dtype), offs
    x = torch.randn(tokens, m, generator=g).to(dtype)
    return x.t(), torch.randn(tokens, n, generator=g).to(dtype), offs


def grouped(ops) -> torch.Tensor:
    a, b, offs = ops
    return torch._grouped_mm(a, b, offs=offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [10, 3])  # 10: slices of 2 experts and a last, shorter run; 3 < SLICES
@pytest.mark.parametrize("transposed", [False, True])
def test_sliced_sum_is_the_whole_pieces_sum_bitwise(dtype, experts, transposed):
    m, n = 24, 16
    pieces = [operands(experts, m, n, dtype, seed, transposed=transposed) for seed in range(3)]
    plain = grouped(pieces[0])  # autograd's accumulation: the first assigned, each next added whole
    for ops in pieces[1:]:
        plain.add_(grouped(ops))
    total = grouped(pieces[0])
    made: list[int] = []
    for ops in pieces[1:]:
        assert add_by_slices(total, [(RECIPE, list(ops))], made.append)
    assert torch.equal(total, plain)
    per_slice = -(-experts // SLICES)
    assert made and max(made) == per_slice * m * n * total.element_size()  # a slice alive, never a piece
    assert sum(made) == 2 * total.numel() * total.element_size()  # each piece made once, all of it
    # Negative control: the same pieces added in another order differ (so the test can see an order).
    if dtype == torch.bfloat16 and experts == 10:
        other = grouped(pieces[0]).add_(grouped(pieces[1]).add_(grouped(pieces[2])))
        assert not torch.equal(other, plain)


def test_one_backwards_contributions_are_summed_before_they_join_the_total():
    """A backward that reads the weight twice (two GEMMs): (e0 + e1) is added to the total, as
    `deferred_entries.sum_backward` then `accumulate` add them, slice by slice."""
    first, e0, e1 = (operands(10, 24, 16, torch.bfloat16, seed, transposed=True) for seed in range(3))
    plain = grouped(first).add_(grouped(e0).add_(grouped(e1)))
    total = grouped(first)
    assert add_by_slices(total, [(RECIPE, list(e0)), (RECIPE, list(e1))], lambda nbytes: None)
    assert torch.equal(total, plain)


def test_what_it_cannot_slice_is_left_whole():
    a, b, offs = operands(10, 24, 16, torch.float32, 0, transposed=False)
    total = grouped((a, b, offs))
    before = total.clone()
    bmm = '["aten.bmm.default",[{"operand":0},{"operand":1}],{},null,[]]'
    assert not add_by_slices(total, [(bmm, [a, b])], lambda nbytes: None)  # another recipe
    assert not add_by_slices(total[:5], [(RECIPE, [a, b, offs])], lambda nbytes: None)  # another shape
    assert not add_by_slices(total, [], lambda nbytes: None)  # nothing to add
    assert torch.equal(total, before)
