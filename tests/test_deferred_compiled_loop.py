"""transformers' eager experts implementation (a Python loop over experts) under torch.compile, deferred.

Dynamo cannot compile the loop: `nonzero()` gives the experts hit, and the loop branches on a tensor
(`if expert_idx == num_experts`), so it skips the loop's frame and runs it eagerly, in every compiled
model. The eager capture keeps its operands there (`sonar_fx.optim.defer_eager`: the experts' hooks run
as eager frames, never compiled on their own), so no gradient is kept whole. Against the same model's
standard run compiled the same way (`test_deferred.Twin`: fused AdamW, the clip over every parameter),
`torch.equal` on every parameter; and at one micro-batch the operands kept plus the one gradient the step
computes at a time stay below the whole gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_deferred_paths import pair
from torch._dynamo.utils import counters

from sonar_fx.memory import ExpertGradBytes

from helpers import assert_same_weights, batches
from test_deferred import MAX_NORM

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
