"""A program built for an inductor graph computes in float32 the low-precision intermediates that
inductor's fused kernels keep in float32 (`sonar_fx.passes.fused_precision`), and refuses the ones it
cannot reproduce bitwise. Graphs traced here with fake tensors; the programs run on real ones against
the same arithmetic written in plain torch. (The whole path, transformers' batched_mm under inductor
against its inductor standard run: tests/test_deferred_paths.py, slow.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from sonar_fx.passes.recipe import NotRerunnable, build_program

S, N, M = 12, 8, 6
"""slots, the activation's width, the output's width (dy)."""


def operands() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).bfloat16() for shape in [(S, N), (S, N), (S, M, 1)]]


def batched_mm_weight_grad(gate, up, dy):
    """Inductor's decomposed `bmm(dy, x^T)` over x = act * up recomputed in backward (bf16)."""
    x = (gate * up).unsqueeze(-1).permute(0, 2, 1)
    return (dy.float() * x.float()).to(torch.bfloat16)


def program_of(fn, *, fused: bool):
    gm = make_fx(fn, tracing_mode="fake")(*operands())
    (output,) = gm.graph.find_nodes(op="output")
    grad = output.args[0]
    program, operand_nodes, _ = build_program(grad, fused_precision=fused)
    assert all(n.op == "placeholder" for n in operand_nodes)  # nothing else stays in the graph
    order = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return program, [order.index(n.name) for n in operand_nodes]


def run(program, positions) -> torch.Tensor:
    values = operands()
    return program.run([values[i] for i in positions])


def test_the_intermediate_an_upcast_reads_is_computed_in_float32():
    gate, up, dy = operands()
    x = (gate.float() * up.float()).unsqueeze(-1).permute(0, 2, 1)  # never rounded to bf16
    fused_kernel = (dy.float() * x).to(torch.bfloat16)
    op_by_op = batched_mm_weight_grad(gate, up, dy)
    assert not torch.equal(fused_kernel, op_by_op)  # the rounding of x matters on this data
    assert torch.equal(run(*program_of(batched_mm_weight_grad, fused=True)), fused_kernel)
    assert torch.equal(run(*program_of(batched_mm_weight_grad, fused=False)), op_by_op)  # aot_eager's


def _silu_then_upcast(gate, up, dy):
    return (dy.float() * F.silu(gate).unsqueeze(-1).permute(0, 2, 1).float()).to(torch.bfloat16)


def _mul_read_by_arithmetic(gate, up, dy):
    x = (gate * up) * 2
    return (dy.float() * x.unsqueeze(-1).permute(0, 2, 1).float()).to(torch.bfloat16)


REFUSED = [
    (_silu_then_upcast, "float32 code of its own"),
    (_mul_read_by_arithmetic, "inside one fused kernel"),
]


@pytest.mark.parametrize(("fn", "why"), REFUSED)
def test_an_intermediate_it_cannot_reproduce_is_not_rerunnable(fn, why):
    """A transcendental's float32 code differs between eager and inductor; a bf16 value read by more
    bf16 arithmetic is fused with another rounding: refused, so the pass keeps the single op's operands."""
    with pytest.raises(NotRerunnable, match=why):
        program_of(fn, fused=True)
    program_of(fn, fused=False)  # aot_eager runs op by op, as the program does


def _product_put(gate, up, dy):
    ids = torch.arange(S) % 4
    return torch.zeros(4, N, dtype=torch.bfloat16).index_put((ids,), gate * up, accumulate=True)


def _product_returned_as_a_view(gate, up, dy):
    return (gate * up).t()


@pytest.mark.parametrize("fn", [_product_put, _product_returned_as_a_view])
def test_a_value_stored_before_it_is_read_keeps_its_rounding(fn):
    """A bf16 product read by an accumulating index_put (a fallback kernel under inductor: it reads the
    values stored in bf16, rounded as in eager), or returned, is left as it is."""
    fused, unfused = program_of(fn, fused=True), program_of(fn, fused=False)
    assert fused[0].steps == unfused[0].steps
    assert "aten.mul.Tensor" in [name for name, _, _ in fused[0].steps]  # the product is in the program
    assert run(*fused).dtype == torch.bfloat16


def test_a_zero_buffer_the_graph_shares_is_made_by_each_program():
    """Inductor's CSE merges the layers' `full` zero buffers of one shape into one node: a program makes
    its own rather than keep that gradient-sized buffer as an operand (which crossed every batched_mm
    tensor over under inductor: no saving left)."""

    def two_puts(gate, up, dy):
        ids = torch.arange(S) % 4
        zeros = torch.zeros(4, N, dtype=torch.bfloat16)
        first = zeros.index_put((ids,), gate * up, accumulate=True)
        return first, zeros.index_put((ids,), gate * dy[:, :N, 0].repeat(1, 2)[:, :N], accumulate=True)

    gm = make_fx(two_puts, tracing_mode="fake")(*operands())
    (output,) = gm.graph.find_nodes(op="output")
    (zeros,) = [n for n in gm.graph.nodes if str(n.target) in ("aten.zeros.default", "aten.full.default")]
    assert len(zeros.users) == 2  # one buffer read by both gradients
    for grad in output.args[0]:
        program, operand_nodes, _ = build_program(grad)
        assert zeros not in operand_nodes  # (the ids, shared too, are kept: they are small)
        assert str(zeros.target) in [name for name, _, _ in program.steps]
