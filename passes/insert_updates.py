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
    sonar_fx.expert_update_(g, [w_T])             # after dW AND after the last reader of w's aliases
    return (..., None, ...)

The update names the aliases as mutated arguments, so a scheduler that reorders nodes (inductor) still
runs it after every read of the weight; at run time the op finds the parameter (and its optimizer)
from those aliases, so nothing in the graph names a particular parameter and a graph dynamo reuses for
another module updates that module's tensors. An expert whose weight the backward graph never sees
(no saved alias) keeps its gradient output: the eager hook updates it after the graph returns.
With `reduce` (data parallel training, see `reduce_grads`), each gradient is averaged across ranks
by a functional all-reduce before its update. Counters go to `torch._dynamo.utils.counters["sonar"]`:
"graphs", "updates", "all_reduces", "kind:<producer kind>", "left_to_hooks".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from sonar_fx.passes.find_expert_grads import ExpertGrad, find_expert_grads
from sonar_fx.passes.graph_utils import node_order
from sonar_fx.passes.reduce_grads import GraphReduce, insert_all_reduce, insert_wait, wait_anchor

UPDATE_OP_NAME = "sonar_fx::expert_update_"
META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr", "original_aten")


def expert_update_pass(
    bw_gm: GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    fw_gm: GraphModule,
    expert_inputs: Collection[int],
    reduce: GraphReduce | None = None,
) -> GraphModule:
    """Insert one `sonar_fx::expert_update_` per expert gradient of `bw_gm`; return it rewritten.

    `example_inputs` is accepted for the common pass signature; the pass reads fake values from node
    metadata instead. `reduce`: all-reduce each gradient (mean over ranks) before its update. Raises if
    the graph cannot be mapped (the backend then falls back).
    """
    grads = find_expert_grads(fw_gm, bw_gm, expert_inputs)
    (output,) = bw_gm.graph.find_nodes(op="output")
    returned = list(output.args[0])
    inserted = []
    order = node_order(bw_gm.graph)
    producers = [eg.producer for eg in grads if eg.aliases]
    for eg in grads:
        if not eg.aliases:
            counters["sonar"]["left_to_hooks"] += 1
            continue
        reader = last_reader(eg, order)  # insertions keep the original nodes' relative order
        if reduce is None:
            insert_update(bw_gm, eg, anchor=reader, aliases=eg.aliases)
        else:
            work = insert_all_reduce(bw_gm, eg, reduce)
            anchor = wait_anchor(eg, reader, producers, order)
            wait = insert_wait(bw_gm, work, after=work if order[anchor] <= order[eg.grad] else anchor)
            insert_update(bw_gm, eg, anchor=wait, aliases=eg.aliases, grad=wait, reduced=reduce.tag)
            counters["sonar"]["all_reduces"] += 1
        returned[eg.input_index] = None
        inserted.append((eg.input_index, eg.kind))
        counters["sonar"]["updates"] += 1
        counters["sonar"][f"kind:{eg.kind}"] += 1
    output.args = (tuple(returned),)
    bw_gm.graph.lint()
    bw_gm.recompile()
    counters["sonar"]["graphs"] += 1
    # Plain data only: AOTAutograd deep-copies the backward module before its (lazy) compile.
    bw_gm.meta["sonar_updates"] = inserted
    return bw_gm


def last_reader(eg: ExpertGrad, order: dict[Node, int]) -> Node:
    """The node after which the update may run: the gradient and every read of the weight are done.
    `order`: `node_order` of the graph (before or after insertions: they keep the original order)."""
    return max((eg.grad, *eg.readers), key=order.__getitem__)


def insert_update(
    bw_gm: GraphModule,
    eg: ExpertGrad,
    *,
    anchor: Node,
    aliases: Sequence[Node],
    grad: Node | None = None,
    reduced: str = "",
) -> Node:
    """Insert `expert_update_(grad or eg.grad, aliases, reduced)` right after `anchor`."""
    graph = bw_gm.graph
    args: tuple[Any, ...] = (grad or eg.grad, list(aliases), *((reduced,) if reduced else ()))
    with graph.inserting_after(anchor):
        update = graph.call_function(update_op(), args)
    update.meta = {k: eg.producer.meta[k] for k in META_KEYS if k in eg.producer.meta}
    update.meta["val"] = None
    return update


def update_op() -> torch._ops.OpOverload:
    """The update op: registered by `sonar_fx.runtime`, which this package never imports."""
    return registered_op(UPDATE_OP_NAME)


def registered_op(qualified: str) -> torch._ops.OpOverload:
    """The default overload of the op `qualified` ("namespace::name"), looked up by name."""
    namespace, name = qualified.split("::")
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except AttributeError:
        raise RuntimeError(f"{qualified} is not registered: import sonar_fx.runtime first.") from None
