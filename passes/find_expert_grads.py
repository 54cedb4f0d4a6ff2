"""Find, in an AOTAutograd backward graph, the nodes that produce expert weight gradients.

Input: the forward and backward graphs of one partition and `expert_inputs` (the forward input
indices that are expert parameters; the backend finds them by identity among its example inputs).
The backward graph returns one output per forward input, in order. For each expert output this
walks back through views to the producing node, classifies it, and finds the backward-graph nodes
that alias the parameter (the saved weight and its saved views: saved forward values reached from the
parameter through views, sharing its fake storage, and the views taken of them in backward).
Analysis only: it never changes a graph.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from sonar_fx.passes.graph_utils import is_view, saved_aliases, view_closure, view_root

aten = torch.ops.aten


@dataclass(frozen=True)
class ExpertGrad:
    """Where one expert tensor's gradient comes from in a backward graph."""

    input_index: int
    """Index of the parameter among the forward inputs (= index of its gradient among the outputs)."""
    grad: Node
    """The node returned as the gradient (possibly a view of `producer`)."""
    producer: Node
    """The first non-view node behind `grad`: the weight-gradient computation."""
    kind: str
    """Classification of `producer`: grouped_mm, bmm, mm, a custom op's name (e.g.
    "sonar_fx::scatter_group_xty"), auto_functionalized:<op>, or other:<aten op>."""
    aliases: tuple[Node, ...]
    """Backward-graph nodes that alias the parameter's storage (saved weight, its views)."""
    readers: tuple[Node, ...]
    """Non-view users of `aliases`: every node that reads the weight in backward."""


def find_expert_grads(
    fw_gm: GraphModule, bw_gm: GraphModule, expert_inputs: Collection[int]
) -> list[ExpertGrad]:
    """One `ExpertGrad` per expert input whose gradient the backward graph returns."""
    primals = fw_gm.graph.find_nodes(op="placeholder")
    outputs = _outputs(bw_gm)
    if len(outputs) != len(primals):
        raise ValueError(
            f"backward graph returns {len(outputs)} gradients for {len(primals)} forward inputs; "
            "cannot map gradients to expert parameters"
        )
    found = []
    for index in sorted(expert_inputs):
        grad = outputs[index]
        if not isinstance(grad, Node):
            continue  # no gradient for this input in this graph
        producer = view_root(grad)
        aliases = tuple(view_closure(saved_aliases(fw_gm, bw_gm, primals[index])))
        readers = tuple(u for a in aliases for u in a.users if not is_view(u) and u.op != "output")
        found.append(ExpertGrad(index, grad, producer, classify(producer), aliases, readers))
    return found


def returned_expert_grads(bw_gm: GraphModule, expert_inputs: Collection[int]) -> list[tuple[int, str]]:
    """(input index, producer kind) of each expert gradient `bw_gm` still returns as an output: what
    a pass left for the hooks, to run after the graph returns."""
    outputs = _outputs(bw_gm)
    found = []
    for index in sorted(i for i in expert_inputs if i < len(outputs)):
        grad = outputs[index]
        if isinstance(grad, Node):
            found.append((index, classify(view_root(grad))))
    return found


def classify(producer: Node) -> str:
    """A short name for the kind of node that computes a weight gradient."""
    target = producer.target
    if target is aten._grouped_mm.default:
        return "grouped_mm"
    if target in (aten.bmm.default, aten.mm.default):
        return "bmm" if target is aten.bmm.default else "mm"
    if target is operator.getitem and isinstance(producer.args[0], Node):
        inner = producer.args[0].target
        if isinstance(inner, torch._ops.HigherOrderOperator) and "auto_functionalized" in inner.name():
            op = producer.args[0].args[0]
            return f"auto_functionalized:{getattr(op, '_name', op)}"
        if isinstance(inner, torch._ops.HigherOrderOperator):
            return f"hop:{inner.name()}"  # e.g. the backward of a nested compile region (invoke_subgraph)
        if isinstance(inner, torch._ops.OpOverload):
            return inner._schema.name
    if isinstance(target, torch._ops.OpOverload):
        # A kernel library's own weight-gradient op (not aten): name it as it is.
        name = target._schema.name
        return name if target.namespace != "aten" else f"other:{name}"
    return f"other:{target}"


def _outputs(gm: GraphModule) -> list[object]:
    (output,) = gm.graph.find_nodes(op="output")
    return list(output.args[0])
