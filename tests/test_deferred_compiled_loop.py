"""transformers' eager experts implementation (a Python loop over experts) under torch.compile, deferred.

Dynamo cannot compile the loop: `nonzero()` gives the experts hit, and the loop branches on a tensor
(`if expert_idx == num_experts`), so it skips the loop's frame and runs it eagerly, in every compiled
model. The eager capture keeps its operands there (`sonar_fx.optim.defer_eager`: the experts' hooks run
as eager frames, never compiled on their own), so no gradient is kept whole. Against the same model's
standard run compiled the same way (`test_deferred.Twin`: fused AdamW, the clip over every parameter),
`torch.equal` on every parameter; and at one micro-batch the operands kept plus the one gradient the step
computes at a time stay below the whole gradients. A loop dynamo does unroll (static slices) is one graph,
whose sum of slice gradients the pass keeps as one program.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_deferred_paths import pair
from torch._dynamo.utils import counters

import sonar_fx
from sonar_fx.memory import ExpertGradBytes
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
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.experts = StaticSliceExperts(4, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).view(-1, 16)
        h = h + 0.1 * self.experts(h)
        return torch.nn.functional.cross_entropy(self.head(h), labels.view(-1))


@pytest.mark.usefixtures("deferred_saving_lost")  # a toy layer: its operands outgrow its gradient
def test_a_loop_dynamo_unrolls_is_one_program_over_each_slices_operands():
    """Where dynamo does unroll a per-expert loop, the backward graph sums each expert's zero-padded
    slice gradient (`select_backward(mm(dy_e^T, x_e))`, added in order): the pass keeps that sum as one
    program over every slice's operands (the graph's own ops, so its own order of additions). Exact; at
    `step()` the program still holds each slice's zero-padded gradient until it ends (`Program.run` keeps
    every step's result), unlike the eager capture's `into=` slices: no such loop comes from transformers."""
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
