"""The Sonar backward pass: update each expert tensor in the backward graph and return no gradient.

Before (one MoE layer's down projection, as inductor's partition leaves it):

    dw   = aten._grouped_mm(dy_T, h, offs)        # weight gradient
    dx   = aten._grouped_mm(dy, w_T, offs)        # input gradient, still READS the weight (w_T = saved view)
    g    = transpose(dw)
    return (..., g, ...)

After:

    dw   = aten._grouped_mm(dy_T, h, offs)
    dx   = aten._grouped_mm(dy, w_T, offs)
    g    = transpose(dw)
    sonar_fx.expert_update_(g, [w_T], slot)       # after dW AND after the last reader of w's aliases
    return (..., None, ...)

The update names the aliases as mutated arguments, so a scheduler that reorders nodes (inductor) still
runs it after every read of the weight. `placement="naive"` (an ablation that silently corrupts dx)
puts it right after dW and names no alias. Counters in `counters` record every insertion by kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch.fx import GraphModule, Node

from sonar_fx.optim.update_op import EXPERT_UPDATE_OP
from sonar_fx.passes.find_expert_grads import ExpertGrad, find_expert_grads
from sonar_fx.passes.graph_utils import is_view, node_order

Placement = Literal["after_alias_readers", "naive"]
PLACEMENTS = ("after_alias_readers", "naive")

counters: Counter[str] = Counter()
"""Process-wide pass counters: "graphs", "updates", and "kind:<producer kind>" per inserted update."""

_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr", "original_aten")


def expert_update_pass(
    bw_gm: GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    fw_gm: GraphModule,
    slots_by_input: Mapping[int, int],
    placement: Placement = "after_alias_readers",
) -> GraphModule:
    """Insert one `sonar_fx.expert_update_` per expert gradient of `bw_gm`; return it rewritten.

    `example_inputs` is accepted for the common pass signature; the pass reads fake values from node
    metadata instead. Raises if an expert gradient cannot be placed (the backend then falls back).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: expected one of {PLACEMENTS}")
    grads = find_expert_grads(fw_gm, bw_gm, slots_by_input)
    (output,) = bw_gm.graph.find_nodes(op="output")
    returned = list(output.args[0])
    for eg in grads:
        _insert_update(bw_gm, eg, placement)
        returned[eg.input_index] = None
        counters["updates"] += 1
        counters[f"kind:{eg.kind}"] += 1
    output.args = (tuple(returned),)
    bw_gm.graph.lint()
    bw_gm.recompile()
    counters["graphs"] += 1
    # Plain data only: AOTAutograd deep-copies the backward module before its (lazy) compile.
    bw_gm.meta["sonar_updates"] = [(eg.input_index, eg.slot, eg.kind) for eg in grads]
    return bw_gm


def _insert_update(bw_gm: GraphModule, eg: ExpertGrad, placement: Placement) -> Node:
    graph = bw_gm.graph
    if placement == "naive":
        anchor = _hoist_view_chain(eg)
        aliases: list[Node] = []
    else:
        order = node_order(graph)
        anchor = max((eg.grad, *eg.readers), key=order.__getitem__)
        aliases = list(eg.aliases)
    with graph.inserting_after(anchor):
        update = graph.call_function(EXPERT_UPDATE_OP, (eg.grad, aliases, eg.slot))
    update.meta = {k: eg.producer.meta[k] for k in _META_KEYS if k in eg.producer.meta}
    update.meta["val"] = None
    return update


def _hoist_view_chain(eg: ExpertGrad) -> Node:
    """Move the views between producer and grad right after the producer; return the last one."""
    chain = []
    node = eg.grad
    while node is not eg.producer:
        chain.append(node)
        node = node.args[0]
    anchor = eg.producer
    for view in reversed(chain):
        assert is_view(view)
        anchor.append(view)
        anchor = view
    return anchor
