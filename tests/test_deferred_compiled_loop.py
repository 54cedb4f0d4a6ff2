"""transformers' eager experts implementation (a Python loop over experts) under torch.compile, deferred.

Dynamo cannot compile the loop: `nonzero()` gives the experts hit, and the loop branches on a tensor
(`if expert_idx == num_experts`), so it skips the loop's frame and runs it eagerly, in every compiled
model. The eager capture keeps its operands there (`sonar_fx.optim.defer_eager`: the experts' hooks run
as eager frames, never compiled on their own), so no gradient is kept whole. Against the same model's
standard run compiled the same way (`test_deferred.Twin`: fused AdamW, the clip over every parameter),
`torch.equal` on every parameter; and at one micro-batch the operands kept plus the one gradient the step
computes at a time stay below the whole gradients. A loop dynamo does unroll (static slices) is one graph,
whose sum of slice gradients the pass keeps as one program, which the step runs slice by slice.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from test_deferred_paths import pair
from torch._dynamo.utils import counters

import sonar_fx
from sonar_fx.memory import ExpertGradBytes, measure_peak
from sonar_fx.passes import placed_sum
from sonar_fx.passes.recipe import Program, load_recipe

from helpers import assert_same_weights, batches
from test_deferred import MAX_NORM, Twin, cfg_for

ACCUM = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def micro_batches(model, opt, twin, data) -> float:
    """One step of `data` on the deferred model and its twin; the step's total norm."""
    for b in data:
        model(**b).loss.backward()
        twin.run(**b).loss.backward()
    opt.step()
    opt.zero_grad()
    twin.step()
    return opt.grad_norms()["total"]


@pytest.mark.slow  # dynamo compiles the frames around the loop, and the activation per expert's shape
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches of a tiny model cross over
def test_the_eager_loop_under_compile_keeps_operands_and_is_its_standard_run():
    counters.clear()
    model, opt, twin_model, twin = pair("loop", "aot_eager", torch.bfloat16)
    initial = copy.deepcopy(twin_model.state_dict())
    data = batches(1 + ACCUM)

    # One micro-batch (below the crossover): operands kept, not gradients.
    micro_batches(model, opt, twin, data[:1])
    bounds = ExpertGradBytes.of(opt.expert_layers)
    kept = opt.report()["deferred"]["kept_operand_peak"]
    assert kept > 0 and kept + max(bounds.tensor_sizes) < bounds.total, (kept, bounds)

    total = micro_batches(model, opt, twin, data[1:])
    assert total > MAX_NORM  # the clip over every parameter was active
    assert_same_weights(model, twin_model)
    experts = len(opt.expert_group["params"])
    moved = [n for n, p in model.named_parameters() if ".experts." in n and not torch.equal(p, initial[n])]
    assert len(moved) == experts, moved  # every expert tensor trained (twins that never moved prove nothing)
    report = opt.report()
    assert report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == 2 * experts, report
    assert counters["stats"]["unique_graphs"] > 0  # compiled: the model around the loop ran as graphs
    assert counters["sonar"]["deferred"] == 0  # no graph holds an expert GEMM: the capture kept them all


class StaticSliceExperts(torch.nn.Module):
    """A per-expert loop dynamo unrolls (static token slices, no data-dependent shape): one graph."""

    def __init__(self, experts: int, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(experts, dim, dim, generator=torch.Generator().manual_seed(0))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        rows = x.shape[0] // self.weight.shape[0]
        for e in range(self.weight.shape[0]):
            out[e * rows : (e + 1) * rows] = torch.nn.functional.linear(
                x[e * rows : (e + 1) * rows], self.weight[e]
            )
        return out


class StaticSliceLM(torch.nn.Module):
    def __init__(self, experts: int = 4, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dim = dim
        self.embed = torch.nn.Embedding(32, dim)
        self.experts = StaticSliceExperts(experts, dim)
        self.head = torch.nn.Linear(dim, 32, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).view(-1, self.dim)
        h = h + 0.1 * self.experts(h)
        return torch.nn.functional.cross_entropy(self.head(h), labels.view(-1))


@pytest.mark.usefixtures("deferred_saving_lost")  # a toy layer: its operands outgrow its gradient
def test_a_loop_dynamo_unrolls_is_one_program_over_each_slices_operands():
    """Where dynamo does unroll a per-expert loop, the backward graph sums each expert's zero-padded
    slice gradient (`select_backward(mm(dy_e^T, x_e))`, added in order): the pass keeps that sum as one
    program over every slice's operands (the graph's own ops, so its own order of additions). Exact; at
    `step()` the program adds slice by slice into one gradient (`passes.placed_sum`: the next test)."""
    counters.clear()
    model = StaticSliceLM()
    twin_model = copy.deepcopy(model)
    sonar_fx.compile(
        model, cfg_for("all"), compiler="aot_eager", schedule="deferred", experts=["experts.weight"]
    )
    opt, twin = model.sonar, Twin(twin_model, {"experts.weight"}, "all", "aot_eager")
    generator = torch.Generator().manual_seed(1)
    recipes = set()
    for _ in range(2):
        for _ in range(ACCUM):
            ids, labels = (torch.randint(0, 32, (4, 8), generator=generator) for _ in range(2))
            model(ids, labels).backward()
            twin.run(ids, labels).backward()
            recipes |= {e.recipe for e in opt.deferred.entries()}  # (none once past the crossover)
        opt.step()
        opt.zero_grad()
        twin.step()
    assert_same_weights(model, twin_model)
    assert not torch.equal(model.experts.weight, StaticSliceLM().experts.weight)  # it trained
    assert opt.report()["deferred"]["kept_whole"] == [] and counters["sonar"]["deferred"] == 1
    (recipe,) = recipes
    program = load_recipe(recipe)
    assert isinstance(program, Program)
    ops = [name for name, _, _ in program.steps]
    assert ops.count("aten.mm.default") == 4 and ops.count("aten.select_backward.default") == 4, ops
    assert program.placed is not None and len(program.placed.terms) == 4  # run slice by slice


def test_the_step_adds_an_unrolled_loops_slices_one_at_a_time():
    """The program of a loop dynamo unrolled (8 experts), run at `step()` on the operands backward kept:
    one zero-filled gradient, each slice's product added into it and freed before the next, so its peak
    is the gradient plus one slice's product (and small change); run as the graph wrote it (the negative
    control: the program without `placed`), it holds every slice's zero-padded gradient and every partial
    sum, at least E gradients. The same bits either way."""
    experts, dim = 8, 64
    model = StaticSliceLM(experts, dim)
    sonar_fx.compile(
        model, cfg_for("all"), compiler="aot_eager", schedule="deferred", experts=["experts.weight"]
    )
    ids, labels = (
        torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(2)) for _ in range(2)
    )
    model(ids, labels).backward()
    (entry,) = model.sonar.deferred.entries()
    program = load_recipe(entry.recipe)
    assert isinstance(program, Program)
    grad_bytes, slice_bytes = model.experts.weight.nbytes, model.experts.weight[0].nbytes

    grad, peak = measure_peak(lambda: program.run(entry.operands))
    assert peak.peak_bytes <= grad_bytes + slice_bytes + 4096, (peak.peak_bytes, grad_bytes, slice_bytes)
    assert program.placed is not None

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placed_sum.PlacedSum, "find", staticmethod(lambda *_: None))
        as_written = Program(program.steps, program.result)
    whole, whole_peak = measure_peak(lambda: as_written.run(entry.operands))
    assert whole_peak.peak_bytes >= experts * grad_bytes, (whole_peak.peak_bytes, grad_bytes)
    assert torch.equal(grad, whole) and grad.stride() == whole.stride()


def _unrolled_program(indices: list[int], sizes: list[int]) -> Program:
    """What the backward graph of an unrolled loop computes (`select_backward(t(mm(t(dy_e), x_e)))` per
    term, summed left to right), over operands [dy_0, x_0, dy_1, x_1, ...]: a term per index."""
    steps: list = []
    for k, index in enumerate(indices):
        first = len(steps)
        steps += [
            ("aten.t.default", [{"operand": 2 * k}], {}),
            ("aten.mm.default", [{"step": first}, {"operand": 2 * k + 1}], {}),
            ("aten.t.default", [{"step": first + 1}], {}),
            ("aten.select_backward.default", [{"step": first + 2}, sizes, 0, index], {}),
        ]
        if k > 0:
            steps.append(("aten.add.Tensor", [{"step": first - 1 if k > 1 else 3}, {"step": first + 3}], {}))
    return Program(steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_placed_sum_is_the_chains_arithmetic_bitwise(dtype):
    """Slice by slice, in the chain's order, is the chain's own sum bit for bit, also where two terms
    land on one slice (an expert read twice); the negative control: the same terms added in the
    reverse order give other bits there, so the order the placed sum keeps is the one that matters."""
    generator = torch.Generator().manual_seed(3)
    indices, sizes = [3, 1, 3, 0, 1, 3], [4, 8, 8]
    program = _unrolled_program(indices, sizes)
    assert program.placed is not None and [t.index for t in program.placed.terms] == indices
    operands = [torch.randn(16, 8, generator=generator).to(dtype) for _ in range(2 * len(indices))]
    placed = program.run(operands)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placed_sum.PlacedSum, "find", staticmethod(lambda *_: None))
        as_written = Program(program.steps, program.result).run(operands)
    assert torch.equal(placed, as_written) and placed.dtype == dtype
    reversed_terms = dataclasses.replace(program.placed, terms=program.placed.terms[::-1])
    other_order = reversed_terms.run(functools.partial(program._step, operands))
    assert not torch.equal(other_order, as_written)
