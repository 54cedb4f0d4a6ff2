"""Average an expert gradient across data-parallel ranks inside the backward graph, before its update.

Under DDP every rank's backward computes its local gradient; DDP (which is kept away from expert
tensors, see `sonar_fx.distributed`) would multiply it by 1/world and all-reduce it (sum). This
module inserts the same arithmetic as functional collectives, so the update consumes the averaged
gradient and a compiler can overlap the collective with the backward around it:

    dw   = <weight-gradient op>(...)
    g    = transpose(dw)
    s    = mul(g, 1/world)                                  # right after the gradient
    r    = _c10d_functional.all_reduce(s, "sum", group)     # issued at once, runs in the background
    ...                                                     # the rest of the layer's backward
    w    = _c10d_functional.wait_tensor(r)                  # just before the next expert's dW op
    sonar_fx.expert_update_(w, [aliases], reduced=tag)      # (and after the weight's last reader)

Waiting just before the next expert's weight-gradient op overlaps the all-reduce with compute and
keeps at most one more expert gradient alive. Pure FX code: it names the collectives through
`torch.ops` and never imports training code or torch.distributed state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node

from sonar_fx.passes.find_expert_grads import ExpertGrad

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class GraphReduce:
    """What to reduce expert gradients over: the process group (by its registered name) and its size."""

    group_name: str
    world_size: int

    @property
    def tag(self) -> str:
        """Names this reduction in the update node; the optimizer refuses any other."""
        return f"mean-all-reduce/{self.world_size}@{self.group_name}"


def insert_all_reduce(bw_gm: GraphModule, eg: ExpertGrad, reduce: GraphReduce) -> Node:
    """Insert `all_reduce(grad * 1/world)` right after the gradient; returns the collective's node."""
    graph = bw_gm.graph
    with graph.inserting_after(eg.grad):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (eg.grad, 1.0 / reduce.world_size))
    with graph.inserting_after(scaled):
        work = graph.call_function(c10d.all_reduce.default, (scaled, "sum", reduce.group_name))
    fake_mode = _fake_mode(eg.grad)
    with fake_mode:
        scaled.meta["val"] = eg.grad.meta["val"] * (1.0 / reduce.world_size)
        work.meta["val"] = torch.empty_like(scaled.meta["val"])
    return work


def insert_wait(bw_gm: GraphModule, work: Node, *, after: Node) -> Node:
    """Insert `wait_tensor(work)` right after `after`; returns the reduced gradient's node."""
    with bw_gm.graph.inserting_after(after):
        wait = bw_gm.graph.call_function(c10d.wait_tensor.default, (work,))
    wait.meta["val"] = work.meta["val"]
    return wait


def wait_anchor(eg: ExpertGrad, reader: Node, producers: Sequence[Node], order: dict[Node, int]) -> Node:
    """Where to wait for `eg`'s all-reduce and update: just before the next expert's weight-gradient
    op (the last node before the output when there is none), never before the weight's last reader.
    `order` is the graph's node order before any insertion."""
    nodes = list(order)  # as they were: `.prev` would see nodes inserted since
    later = [p for p in producers if order[p] > order[eg.producer]]
    limit = min(later, key=order.__getitem__) if later else nodes[-1]  # the next dW op, or the output
    return max(reader, nodes[order[limit] - 1], key=order.__getitem__)


def _fake_mode(node: Node) -> FakeTensorMode:
    val = node.meta.get("val")
    mode = getattr(val, "fake_mode", None)
    if not isinstance(mode, FakeTensorMode):
        raise ValueError(f"{node.name} has no fake value; cannot insert the all-reduce of its gradient")
    return mode
