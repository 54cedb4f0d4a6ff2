"""The deferred step computes a gathered weight's gradient (batched_mm: `index_put_(zeros, [ids],
bmm(a, b), accumulate=True)`) a few experts at a time (`sonar_fx.passes.scatter_chunks`): bitwise
autograd's gradient of `W[ids]` then bmm, over random routings (skewed, experts with no slot, fp32 and
bf16, both layouts, the eager and the compiled programs: aot_eager's bmm, inductor's float32 multiply),
with far less of the product alive; the
backward of the eager capture gathers the rows again instead of saving them (`_GatheredBmm`).
"""

from __future__ import annotations

import pytest
import torch

from sonar_fx.memory import measure_peak
from sonar_fx.optim.defer_eager_paths import _gather_program, _GatheredBmm
from sonar_fx.passes import scatter_chunks
from sonar_fx.passes.recipe import Program

DTYPES = (torch.float32, torch.bfloat16)


def compiled_program(shape: tuple[int, ...], dtype: torch.dtype) -> Program:
    """The program the compiled pass builds for batched_mm (as the graph holds it: operands [a, b, ids],
    a functional index_put on its own zero buffer written in place)."""
    zeros_kwargs = {"dtype": {"dtype": str(dtype).removeprefix("torch.")}, "layout": {"layout": "strided"}}
    return Program(
        [
            ("aten.bmm.default", [{"operand": 0}, {"operand": 1}], {}),
            (
                "aten.new_zeros.default",
                [{"step": 0}, list(shape)],
                {**zeros_kwargs, "device": {"device": "cpu"}},
            ),
            ("aten.index_put_.default", [{"step": 1}, [{"operand": 2}], {"step": 0}, True], {}),
        ],
        result=2,
    )


def inductor_program(shape: tuple[int, ...], dtype: torch.dtype) -> Program:
    """The program the compiled pass builds under inductor, which decomposes the bmm (a contraction of
    one) into a float32 multiply of the upcast operands, cast back to the gradient's dtype."""
    name = str(dtype).removeprefix("torch.")
    convert, float32 = "prims.convert_element_type.default", {"dtype": "float32"}
    full_kwargs = {"dtype": {"dtype": name}, "layout": {"layout": "strided"}, "device": {"device": "cpu"}}
    return Program(
        [
            (convert, [{"operand": 0}, float32], {}),
            (convert, [{"operand": 1}, float32], {}),
            ("aten.mul.Tensor", [{"step": 0}, {"step": 1}], {}),
            (convert, [{"step": 2}, {"dtype": name}], {}),
            ("aten.full.default", [list(shape), 0], full_kwargs),
            ("aten.index_put_.default", [{"step": 4}, [{"operand": 2}], {"step": 3}, True], {}),
        ],
        result=5,
    )


def routing(gen: torch.Generator, experts: int, slots: int) -> torch.Tensor:
    """Skewed expert ids: a few experts take most slots, some none."""
    weights = torch.rand(experts, generator=gen) ** 4
    return torch.multinomial(weights, slots, replacement=True, generator=gen)


def case(seed: int, dtype: torch.dtype, weight_first: bool):
    """(W, ids, other, dy, autograd's gradient of W) for `bmm(W[ids], x)` or `bmm(x, W[ids])`."""
    gen = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(2, 33, (1,), generator=gen))
    slots = int(torch.randint(1, 6 * experts, (1,), generator=gen))
    m, n = (int(v) for v in torch.randint(1, 96, (2,), generator=gen))
    w = torch.randn(experts, m, n, generator=gen).to(dtype).requires_grad_()
    ids = routing(gen, experts, slots)
    if weight_first:  # transformers' layout: y (S, m, 1) = W[ids] (S, m, n) @ x (S, n, 1)
        other = torch.randn(slots, n, 1, generator=gen).to(dtype)
        y = torch.bmm(w[ids], other)
    else:  # transposed: y (S, 1, n) = x (S, 1, m) @ W[ids] (S, m, n)
        other = torch.randn(slots, 1, m, generator=gen).to(dtype)
        y = torch.bmm(other, w[ids])
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    return w, ids, other, dy, w.grad


def eager_operands(other, dy, ids, weight_first: bool) -> list[torch.Tensor]:
    return [dy, other, ids] if weight_first else [other, dy, ids]


def compiled_operands(other, dy, ids, weight_first: bool) -> list[torch.Tensor]:
    return [dy, other.transpose(1, 2), ids] if weight_first else [other.transpose(1, 2), dy, ids]


SEEDS = range(24)


@pytest.mark.parametrize("weight_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slab_share", [scatter_chunks.SLAB_SHARE, 10**9], ids=["default", "one_expert"])
def test_chunked_gradient_is_autograds_bitwise(monkeypatch, dtype, weight_first, slab_share):
    """Every random routing: the eager and the compiled program, run a chunk of experts at a time
    (the default share, and one expert per chunk), give autograd's gradient bit for bit."""
    monkeypatch.setattr(scatter_chunks, "SLAB_SHARE", slab_share)
    chunked = 0
    for seed in SEEDS:
        w, ids, other, dy, expected = case(seed, dtype, weight_first)
        a, b = (dy, other.transpose(1, 2)) if weight_first else (other.transpose(1, 2), dy)
        chunks = scatter_chunks._expert_chunks(expected, ids, a, b)
        chunked += chunks is not None and len(chunks) > 1
        shape = tuple(w.shape)
        eager = _gather_program(shape, weight_first).run(eager_operands(other, dy, ids, weight_first))
        compiled = compiled_program(shape, dtype).run(compiled_operands(other, dy, ids, weight_first))
        inductor = inductor_program(shape, dtype).run(compiled_operands(other, dy, ids, weight_first))
        assert torch.equal(eager, expected) and torch.equal(compiled, expected), seed
        assert torch.equal(inductor, expected), seed
    assert chunked >= len(SEEDS) // 2, chunked  # most cases ran in several chunks (not all whole)


def test_negative_control_another_order_within_an_expert_differs():
    """The order matters: in bf16, an expert's slots added in reverse slot order give other bits than
    autograd's on some routing (so the bitwise test above would see a chunking that reorders them)."""
    differs = 0
    for seed in SEEDS:
        _, ids, other, dy, expected = case(seed, torch.bfloat16, True)
        product = torch.bmm(dy, other.transpose(1, 2))
        reverse = torch.arange(len(ids) - 1, -1, -1)
        grad = torch.zeros_like(expected).index_put_([ids[reverse]], product[reverse], accumulate=True)
        differs += not torch.equal(grad, expected)
    assert differs > 0


def test_the_step_holds_a_share_of_the_product_not_all_of_it():
    """One gradient of 32 experts with 4 slots each (the product: 4 gradients' bytes): chunked, the
    program's peak is the gradient plus at most 1/SLAB_SHARE of it in product and the chunk's gathered
    operands; run whole (the negative control), the whole product sits beside the gradient."""
    experts, m, n, per_expert = 32, 64, 128, 4
    ids = torch.arange(experts).repeat_interleave(per_expert)
    dy, x = torch.randn(len(ids), m, 1), torch.randn(len(ids), n, 1)
    program = _gather_program((experts, m, n), True)
    grad_bytes = experts * m * n * 4
    operand_bytes = (dy.nbytes + x.nbytes + ids.nbytes) // scatter_chunks.SLAB_SHARE
    chunked, peak = measure_peak(lambda: program.run([dy, x, ids]))
    assert peak.peak_bytes <= grad_bytes + grad_bytes // scatter_chunks.SLAB_SHARE + 2 * operand_bytes + 4096
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setattr(scatter_chunks, "_expert_chunks", lambda *_: None)
        whole, whole_peak = measure_peak(lambda: program.run([dy, x, ids]))
    assert whole_peak.peak_bytes >= grad_bytes + per_expert * grad_bytes
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("weight_first", [True, False])
def test_gathered_bmm_saves_the_weight_not_the_rows_and_gives_bmms_input_gradient(weight_first):
    """The eager capture's bmm saves the weight and the ids (no gathered copy) and gathers again in
    backward: the input gradient is bmm's own, bitwise; an in-place change of the weight before backward
    is refused by autograd, never read stale."""
    w, ids, other, dy, _ = case(3, torch.bfloat16, weight_first)
    x = other.clone().requires_grad_()
    rows = w.detach()[ids]
    plain = torch.bmm(rows, x) if weight_first else torch.bmm(x, rows)
    (expected,) = torch.autograd.grad(plain, x, dy)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _GatheredBmm.apply(rows, w, ids, x, weight_first)
    assert torch.equal(y, plain)
    assert all(t.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr() for t in saved)
    assert sum(t.nbytes for t in saved if t is not w) == ids.nbytes  # the ids, besides the weight
    (got,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(got, expected)
    w.grad = None
    _GatheredBmm.apply(rows, w, ids, other, weight_first).sum().backward()  # `other` needs no gradient
    assert w.grad is None  # nor does the weight get one here: its gradient is the step's recipe
    y = _GatheredBmm.apply(rows, w, ids, x, weight_first)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, x, dy)


def test_inductors_float32_product_is_chunked_too():
    """Inductor's form (a float32 multiply, cast to bf16, then the put): the multiply and its cast run
    per chunk, so the step holds a share of the float32 product (twice the bf16 gradient's bytes per
    slot), not all of it; run whole (the negative control), the whole float32 product is alive."""
    experts, m, n, per_expert = 32, 64, 128, 4
    ids = torch.arange(experts).repeat_interleave(per_expert)
    dy, x = torch.randn(len(ids), m, 1).bfloat16(), torch.randn(len(ids), 1, n).bfloat16()
    program = inductor_program((experts, m, n), torch.bfloat16)
    assert program.scattered is not None and len(program.scattered.tail) == 1
    grad_bytes = experts * m * n * 2
    upcast_operands = 2 * (dy.nbytes + x.nbytes)  # the float32 operands, whole, and a chunk's share
    chunked, peak = measure_peak(lambda: program.run([dy, x, ids]))
    share = 2 * grad_bytes // scatter_chunks.SLAB_SHARE  # a chunk's float32 product
    assert peak.peak_bytes <= grad_bytes + share + share // 2 + 2 * upcast_operands + 4096
    with pytest.MonkeyPatch().context() as patch:
        patch.setattr(scatter_chunks, "_expert_chunks", lambda *_: None)
        whole, whole_peak = measure_peak(lambda: program.run([dy, x, ids]))
    assert whole_peak.peak_bytes >= grad_bytes + 2 * per_expert * grad_bytes
    assert torch.equal(chunked, whole)
