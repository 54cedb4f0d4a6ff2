"""Gather an expert weight's rows again in backward rather than save the copy (deferred schedule).

transformers' batched_mm reads its expert weights as gathered rows, `w[expert_ids]`: one expert's
matrix per routed slot. The partition saves that copy for the input gradient (dx = w[ids]^T dy), so
every layer's copies are alive when backward begins, several times the expert gradients the deferred
schedule frees. Under the deferred schedule no expert weight moves before `step()`, so the backward
can gather the same rows from the weight itself (saved as is: no memory) and the ids; the gather
gives the same values in the same layout, so the input gradient keeps its bits.

Before (joint graph, one gather of an expert primal `w`):

    rows = aten.index.Tensor(w, [ids])        # saved for backward: S x one expert's matrix
    y    = aten.bmm(rows, x)

After: the same node, tagged `recompute=MUST_RECOMPUTE` (the min-cut partitioner then computes it in
the backward graph from `w` and `ids`; the forward frees it after its bmm).

Counted in `torch._dynamo.utils.counters["sonar"]["gathers_recomputed"]`.
Not used by the in-backward schedule (untried there): its weights move during backward, so each update
would have to wait for the recomputed gather as for any other reader of the weight.
Pure FX over the joint graph: never runs a graph or imports training code.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

GATHER = torch.ops.aten.index.Tensor


def recompute_expert_gathers_pass(joint_gm: GraphModule, expert_inputs: Collection[int]) -> list[Node]:
    """Tag each single-index gather of an expert primal of `joint_gm` (the first placeholders are the
    primals) to be recomputed in backward; returns the tagged nodes."""
    placeholders = joint_gm.graph.find_nodes(op="placeholder")
    tagged = []
    for index in sorted(expert_inputs):
        if index >= len(placeholders):
            continue
        for user in placeholders[index].users:
            indices = user.args[1] if user.target is GATHER else None
            if (
                isinstance(indices, (list, tuple))
                and len(indices) == 1
                and user.args[0] is placeholders[index]
            ):
                user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                tagged.append(user)
                counters["sonar"]["gathers_recomputed"] += 1
    return tagged
