"""The deferred-schedule backward pass: keep each expert weight gradient's operands, not the gradient.

Before (one MoE layer's down projection):

    dw   = aten._grouped_mm(h_T, dy, offs)        # weight gradient (a layer's worth of memory)
    dx   = aten._grouped_mm(dy, w_T, offs)        # input gradient, reads the weight
    g    = transpose(dw)
    return (..., g, ...)

After:

    dx   = aten._grouped_mm(dy, w_T, offs)
    token = aten.empty([0])
    sonar_fx.expert_defer_(token, [h_T, dy, offs], [w_T], recipe, own)  # "_grouped_mm, transpose"
    return (..., None, ...)

The op hands the operands (copies that own their storage when `own`: inductor may reuse a buffer it
thinks dead) to the expert's optimizer, which computes the gradient at `step()` with the same ops on
the same operands, when the whole step's facts (all micro-batches, the global norm, a GradScaler's
verdict) are known. The weight-gradient node is removed when nothing else reads it, so a backward
computes no expert weight gradient at all. Where the producer's own operands include a tensor the
graph computes for this gradient alone (batched_mm: `index_put(new_zeros(..), [ids], bmm(dy, x^T),
True)`, whose bmm product is one expert-sized slab per routed token), the recipe is a program of every
such node instead, over the tensors the graph holds anyway (dy, x, ids). A producer that cannot be
written as a recipe keeps its gradient output (the optimizer then keeps that gradient until `step()`,
as standard training does).
Counters in `torch._dynamo.utils.counters["sonar"]`: "deferred", "kept:<producer kind>".
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from sonar_fx.passes.find_expert_grads import ExpertGrad, find_expert_grads
from sonar_fx.passes.graph_utils import node_order
from sonar_fx.passes.insert_updates import META_KEYS, last_reader, registered_op
from sonar_fx.passes.recipe import (
    ALONE,
    NotRerunnable,
    Program,
    Recipe,
    build_program,
    build_recipe,
    needs_program,
    op_named,
)

DEFER_OP_NAME = "sonar_fx::expert_defer_"


def expert_defer_pass(
    bw_gm: GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    fw_gm: GraphModule,
    expert_inputs: Collection[int],
    own_operands: bool = True,
    fused_precision: bool = False,
) -> GraphModule:
    """Replace each expert gradient output of `bw_gm` by one `sonar_fx::expert_defer_`; return it.

    `own_operands`: the op copies its operands (needed under inductor, whose generated code reuses
    the storage of buffers it considers dead; aot_eager runs the graph as written).
    `fused_precision`: a program computes in float32 the low-precision intermediates that inductor's
    fused kernels keep in float32 (`sonar_fx.passes.fused_precision`; inductor only: aot_eager rounds
    them as the program does)."""
    grads = find_expert_grads(fw_gm, bw_gm, expert_inputs)
    (output,) = bw_gm.graph.find_nodes(op="output")
    returned = list(output.args[0])
    order = node_order(bw_gm.graph)
    inserted = []
    erase: dict[int, list[Node]] = {}
    for eg in grads:
        if not eg.aliases:
            counters["sonar"]["left_to_hooks"] += 1
            continue
        try:
            recipe, operands, computed = _recipe(eg, fused_precision=fused_precision)
        except NotRerunnable:
            counters["sonar"][f"kept:{eg.kind}"] += 1
            continue
        anchor = last_reader(eg, order)
        with bw_gm.graph.inserting_after(anchor):
            token = _token(bw_gm, eg.aliases[0])
        with bw_gm.graph.inserting_after(token):
            node = bw_gm.graph.call_function(
                defer_op(), (token, operands, list(eg.aliases), recipe.to_json(), own_operands)
            )
        node.meta = {k: eg.producer.meta[k] for k in META_KEYS if k in eg.producer.meta}
        node.meta["val"] = None
        returned[eg.input_index] = None
        inserted.append((eg.input_index, eg.kind))
        erase[eg.input_index] = computed
        counters["sonar"]["deferred"] += 1
        counters["sonar"][f"kind:{eg.kind}"] += 1
    output.args = (tuple(returned),)
    for nodes in erase.values():
        _erase_unused(nodes)
    bw_gm.graph.lint()
    bw_gm.recompile()
    counters["sonar"]["graphs"] += 1
    bw_gm.meta["sonar_updates"] = inserted  # plain data: rewritten expert outputs, as the update pass
    return bw_gm


def _token(bw_gm: GraphModule, like: Node) -> Node:
    """A fresh empty tensor for the defer op to name as mutated (see `sonar_fx.runtime.defer_op`)."""
    val = like.meta["val"]
    node = bw_gm.graph.call_function(
        torch.ops.aten.empty.memory_format, ([0],), {"dtype": torch.uint8, "device": val.device}
    )
    with val.fake_mode:
        node.meta["val"] = torch.empty(0, dtype=torch.uint8, device=val.device)
    return node


def _recipe(eg: ExpertGrad, *, fused_precision: bool) -> tuple[Recipe | Program, list[Node], list[Node]]:
    """The recipe of `eg`'s gradient, its operand nodes, and the nodes it computes again (in graph
    order): the producer and its views, or a program where a single op would keep a tensor the graph
    computes only for this gradient (`recipe.needs_program`)."""
    recipe, operands = build_recipe(eg.producer, eg.grad)
    chain = _chain(eg.grad, eg.producer)
    if not needs_program(operands, set(chain)):
        return recipe, operands, chain
    try:
        return build_program(eg.grad, fused_precision=fused_precision)
    except NotRerunnable:
        return recipe, operands, chain  # the single op still re-runs: its operands kept as they are


def _chain(grad: Node, producer: Node) -> list[Node]:
    """The producer (a multi-output op behind a getitem with it) and its views up to `grad`, in order."""
    chain = []
    node = grad
    while node is not producer:
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    chain.append(producer)
    if producer.target is operator.getitem:
        chain.append(producer.args[0])  # type: ignore[arg-type]
    return chain[::-1]


def _erase_unused(nodes: list[Node]) -> None:
    """Drop the nodes a recipe computes again, last first, where nothing else reads them: the backward
    then never computes that weight gradient. A multi-output op whose other output the graph still
    reads computes that output alone where an op does (`recipe.ALONE`: a backward op's input gradient
    without the weight gradient the step computes)."""
    for node in reversed(nodes):
        if not node.users:
            node.graph.erase_node(node)
        elif isinstance(node.target, torch._ops.OpOverload):
            _keep_the_output_read(node)


def _keep_the_output_read(call: Node) -> None:
    items = {u.args[1] for u in call.users if u.target is operator.getitem}
    if len(items) != 1 or len(call.users) != sum(u.target is operator.getitem for u in call.users):
        return
    (item,) = items
    alone = ALONE.get((str(call.target), item))
    if alone is None:
        return
    with call.graph.inserting_before(call):
        single = call.graph.call_function(op_named(alone), call.args, call.kwargs)
    readers = list(call.users)
    single.meta = {**call.meta, "val": readers[0].meta.get("val")}
    for getitem in readers:
        getitem.replace_all_uses_with(single)
        call.graph.erase_node(getitem)
    call.graph.erase_node(call)


def defer_op() -> torch._ops.OpOverload:
    """The defer op: registered by `sonar_fx.runtime`, which this package never imports."""
    return registered_op(DEFER_OP_NAME)
