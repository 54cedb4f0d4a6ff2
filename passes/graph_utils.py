"""Small FX helpers shared by the Sonar passes: view ops, node order, fake-tensor storage identity.

Pure FX code: never imports training code, never runs a graph.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

# Ops whose output aliases their first input (no new storage, no arithmetic).
VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.transpose.int,
        aten.t.default,
        aten.permute.default,
        aten.expand.default,
        aten.alias.default,
        aten.detach.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.unbind.int,
        aten.as_strided.default,
        aten._reshape_alias.default,
    }
)


def is_view(node: Node) -> bool:
    """A view of its first argument (getitem of a split/unbind counts as one)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, Node) and parent.target in VIEW_OPS
    return node.target in VIEW_OPS


def node_order(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def storage_of(node: Node) -> StorageWeakRef | None:
    """Identity of the (fake) storage behind a node's tensor value, if it has one."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse or storage-less subclasses
        return None


def shares_storage(node: Node, storage: StorageWeakRef) -> bool:
    """Whether `node`'s tensor value lives in `storage` (False for non-tensor values)."""
    mine = storage_of(node)
    return mine is not None and mine == storage


def view_closure(roots: list[Node]) -> list[Node]:
    """`roots` and every node reachable from them through view ops, in discovery order."""
    seen: dict[Node, None] = dict.fromkeys(roots)
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in seen and is_view(user):
                seen[user] = None
                frontier.append(user)
    return list(seen)
