"""The backward-graph rewrite, inspected: 2L update nodes, each placed after its weight gradient and
after every reader of the weight's aliases, and no gradient returned for expert tensors."""

import copy
import warnings

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch.fx import GraphModule, Node

import sonar_fx
from sonar_fx.backend import SonarPartitioner
from sonar_fx.models import build_model
from sonar_fx.passes import expert_update_pass
from sonar_fx.passes.graph_utils import is_view, node_order, shares_storage, storage_of
from sonar_fx.runtime import EXPERT_UPDATE_OP, registry

from helpers import CFG, batches, known_library_failure


def capture(model_name: str, dtype: torch.dtype, *, sonar: bool = True) -> tuple[GraphModule, GraphModule]:
    """Compile one forward/backward with aot_eager and return the (forward, backward) graphs."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=dtype, seed=0)
    # sonar=False captures the standard graph, which returns the expert gradients: the saving guard
    # would refuse it (it is the point of the capture, not a user's training run).
    sonar_fx.prepare(model, CFG, on_saving_lost="raise" if sonar else "warn")
    graphs = []

    class Capturing(SonarPartitioner):
        def __call__(self, gm, joint_inputs, **kwargs):
            fw, bw = super().__call__(gm, joint_inputs, **kwargs)
            graphs.append((fw, bw))
            return fw, bw

    def backend(gm, example_inputs):
        found = [i for i, x in enumerate(example_inputs) if sonar and registry.owner_of(x) is not None]
        partitioner = Capturing(found)
        return aot_autograd(fw_compiler=boxed_nop, partition_fn=partitioner)(gm, example_inputs)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*backend other than sonar's")
        torch.compile(model, backend=backend)(**batches(1)[0]).loss.backward()
    assert len(graphs) == 1, "expected one graph: no graph break in these models"
    return graphs[0]


def updates(bw: GraphModule) -> list[Node]:
    return [n for n in bw.graph.nodes if n.target is EXPERT_UPDATE_OP]


CASES = [
    ("tiny-olmoe", torch.bfloat16, "grouped_mm"),
    pytest.param(
        "tiny-olmoe",
        torch.float32,
        "transformers::grouped_mm_fallback_backward",
        marks=known_library_failure(grouped_mm_compiled=torch.float32),
    ),
    ("tiny-granitemoe", torch.bfloat16, "grouped_mm"),
    ("tiny-reference", torch.float32, "sonar_fx::grouped_mm_backward"),
]


@pytest.mark.parametrize(("model_name", "dtype", "kind"), CASES)
def test_one_update_per_expert_tensor_placed_after_every_weight_reader(model_name, dtype, kind):
    fw, bw = capture(model_name, dtype)
    num_layers = 2
    inserted = updates(bw)
    assert len(inserted) == 2 * num_layers
    assert {k for _, k in bw.meta["sonar_updates"]} == {kind}
    assert sorted(_input_of(u, fw.graph.find_nodes(op="placeholder")) for u in inserted) == sorted(
        i for i, _ in bw.meta["sonar_updates"]
    )
    order = node_order(bw.graph)
    primals = fw.graph.find_nodes(op="placeholder")
    (output,) = bw.graph.find_nodes(op="output")
    for update in inserted:
        grad, aliases = update.args
        index = _input_of(update, primals)
        assert output.args[0][index] is None, "an updated expert tensor must return no gradient"
        producer = grad
        while is_view(producer):
            producer = producer.args[0]
        assert order[producer] < order[update] and order[grad] < order[update]
        # Every backward node sharing the weight's storage is named as mutated, and read before.
        storage = storage_of(primals[index])
        sharing = {
            n for n in bw.graph.nodes if n.op != "output" and n is not update and shares_storage(n, storage)
        }
        assert sharing <= set(aliases)
        readers = [u for a in aliases for u in a.users if u is not update and not is_view(u)]
        assert all(order[r] < order[update] for r in readers)
        if kind == "grouped_mm":
            assert readers, "the input gradient reads the weight after dW: the placement hazard exists here"


def test_standard_graph_has_no_update_nodes():
    _, bw = capture("tiny-olmoe", torch.bfloat16, sonar=False)
    assert updates(bw) == []
    (output,) = bw.graph.find_nodes(op="output")
    assert sum(isinstance(x, Node) for x in output.args[0]) >= 4  # expert gradients are returned


def _input_of(update: Node, primals: list[Node]) -> int:
    """The forward input whose storage the update's first alias lives in (its parameter)."""
    storage = storage_of(update.args[1][0])
    (index,) = [i for i, p in enumerate(primals) if storage_of(p) == storage]
    return index


def _copy(gm: GraphModule) -> GraphModule:
    return GraphModule(gm, copy.deepcopy(gm.graph))


def _captured(model_name="tiny-olmoe", dtype=torch.bfloat16):
    """A standard (unrewritten) forward/backward pair and the expert input indices of its forward."""
    fw, bw = capture(model_name, dtype, sonar=False)
    primals = fw.graph.find_nodes(op="placeholder")
    experts = [i for i, p in enumerate(primals) if p.meta["val"].dim() == 3]  # batched (E, ., .) tensors
    return fw, bw, experts


def test_pass_without_experts_leaves_the_graph_as_it_was():
    fw, bw, _ = _captured()
    before = str(bw.graph)
    out = expert_update_pass(_copy(bw), fw_gm=fw, expert_inputs=[])
    assert str(out.graph) == before and out.meta["sonar_updates"] == []


def test_pass_is_idempotent():
    fw, bw, experts = _captured()
    assert len(experts) == 2 * 2, "two layers, two batched expert tensors each"
    once = expert_update_pass(_copy(bw), fw_gm=fw, expert_inputs=experts)
    text = str(once.graph)
    twice = expert_update_pass(once, fw_gm=fw, expert_inputs=experts)
    assert len(updates(twice)) == len(experts) and str(twice.graph) == text
    assert twice.meta["sonar_updates"] == [], "the second run found no gradient left to consume"


def test_pass_refuses_a_backward_whose_outputs_do_not_match_the_forward_inputs():
    fw, bw, experts = _captured()
    broken = _copy(bw)
    (output,) = broken.graph.find_nodes(op="output")
    output.args = (tuple(output.args[0])[:-1],)
    with pytest.raises(ValueError, match="cannot map gradients to expert parameters"):
        expert_update_pass(broken, fw_gm=fw, expert_inputs=experts)
