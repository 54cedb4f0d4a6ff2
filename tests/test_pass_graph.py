"""The backward-graph rewrite, inspected: 2L update nodes, each placed after its weight gradient and
after every reader of the weight's aliases, and no gradient returned for expert tensors."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch.fx import GraphModule, Node

import sonar_fx
from sonar_fx.backend import SonarPartitioner
from sonar_fx.models import build_model
from sonar_fx.passes.graph_utils import is_view, node_order, shares_storage, storage_of
from sonar_fx.runtime import EXPERT_UPDATE_OP, registry

from helpers import CFG, batches


def capture(model_name: str, dtype: torch.dtype, *, sonar: bool = True) -> tuple[GraphModule, GraphModule]:
    """Compile one forward/backward with aot_eager and return the (forward, backward) graphs."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=dtype, seed=0)
    sonar_fx.prepare(model, CFG)
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

    torch.compile(model, backend=backend)(**batches(1)[0]).loss.backward()
    assert len(graphs) == 1, "expected one graph: no graph break in these models"
    return graphs[0]


def updates(bw: GraphModule) -> list[Node]:
    return [n for n in bw.graph.nodes if n.target is EXPERT_UPDATE_OP]


CASES = [
    ("tiny-olmoe", torch.bfloat16, "grouped_mm"),
    ("tiny-olmoe", torch.float32, "transformers::grouped_mm_fallback_backward"),
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
