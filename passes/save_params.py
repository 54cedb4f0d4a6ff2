"""Hand an expert weight to the backward graph when the partition saved none of its aliases.

The update op finds its parameter at run time from an alias of it in the backward graph (the saved
weight or a view of it). A forward that reads the weight only through a copy, such as a gather of the
selected experts (`w[expert_ids]`, transformers' `batched_mm`, whose weight gradient is an
`index_put` accumulation into zeros), saves the copy, not the weight: the backward graph then holds
no alias, and the update could not bind. Such a backward never reads the weight either, so updating
it right after its gradient is exact; it only needs the weight as an input. This adds the forward's
parameter input to the saved tensors (it is alive anyway: no memory) and gives the backward graph a
placeholder for it, so the update pass finds it like any saved weight.

Before (forward outputs and backward inputs of one partition):

    fw: return (*outs, *saved, *symints)          bw(*symints, *saved, *tangents)

After, for the expert parameter `w` (forward input `i`):

    fw: return (*outs, w, *saved, *symints)       bw(*symints, w, *saved, *tangents)

Pure FX over the two partitioned graphs; it never runs a graph or imports training code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch
from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput
from torch.fx import GraphModule, Node

from sonar_fx.passes.graph_utils import saved_aliases, storage_of


def save_expert_params(
    fw_gm: GraphModule, bw_gm: GraphModule, expert_inputs: Collection[int], *, num_fwd_outputs: int
) -> list[int]:
    """Save each expert input of `fw_gm` whose gradient `bw_gm` returns but whose weight it does not
    hold; returns the input indices added. `num_fwd_outputs`: the forward's own outputs (the rest of
    its outputs are saved for backward)."""
    primals = fw_gm.graph.find_nodes(op="placeholder")
    (fw_out,) = fw_gm.graph.find_nodes(op="output")
    (bw_out,) = bw_gm.graph.find_nodes(op="output")
    grads = list(bw_out.args[0])
    bw_inputs = bw_gm.graph.find_nodes(op="placeholder")
    saved = list(fw_out.args[0][num_fwd_outputs:])
    # Saved values come first among the backward inputs, after the symbolic sizes (which the forward
    # returns last): the new value goes in front of the saved tensors in both graphs.
    num_symbolic = sum(
        1 for n in saved if isinstance(n, Node) and not isinstance(n.meta.get("val"), torch.Tensor)
    )
    if len(grads) != len(primals) or len(bw_inputs) <= num_symbolic:
        return []
    anchor = bw_inputs[num_symbolic]
    added = []
    for index in sorted(expert_inputs):
        primal = primals[index]
        if not isinstance(grads[index], Node) or storage_of(primal) is None:
            continue
        if saved_aliases(fw_gm, bw_gm, primal):
            continue  # the weight (or a view of it) is saved already
        with bw_gm.graph.inserting_before(anchor):
            # The forward's name: the pass matches saved values to forward values by name.
            placeholder = bw_gm.graph.placeholder(primal.name)
        placeholder.meta.update({k: v for k, v in primal.meta.items() if k in ("val", "tensor_meta")})
        added.append(index)  # before the same anchor each time: the placeholders keep this order
    if not added:
        return []
    outputs = list(fw_out.args[0])
    new = [primals[i] for i in added]
    fw_out.args = ((*outputs[:num_fwd_outputs], *new, *outputs[num_fwd_outputs:]),)
    _shift_descs(fw_out, num_fwd_outputs, len(new))
    for gm in (fw_gm, bw_gm):
        gm.graph.lint()
        gm.recompile()
    return added


def _shift_descs(fw_out: Node, num_fwd_outputs: int, count: int) -> None:
    """Keep AOTAutograd's output descriptors (one per output, saved values numbered) in step."""
    descs = fw_out.meta.get("desc")
    if not isinstance(descs, list) or len(descs) < num_fwd_outputs:
        return
    rest = [
        dataclasses.replace(d, idx=d.idx + count) if hasattr(d, "idx") else d for d in descs[num_fwd_outputs:]
    ]
    added = [SavedForBackwardsAOTOutput(i) for i in range(count)]
    fw_out.meta["desc"] = [*descs[:num_fwd_outputs], *added, *rest]
