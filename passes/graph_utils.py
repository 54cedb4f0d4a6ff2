"""Small FX helpers shared by the Sonar passes: views and aliases from torch's own information.

A node is a view when its op's schema says so (`OpOverload.is_view`), or when its fake value lives in
its input's storage (ops such as `_unsafe_view` alias without declaring it). Aliases of a tensor are
found by fake-tensor storage identity. Pure FX code: never imports training code, never runs a graph.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node
from torch.multiprocessing.reductions import StorageWeakRef


def is_view(node: Node) -> bool:
    """Whether `node` only re-views its first argument (getitem of a split/unbind counts as one)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    parent = node.args[0]
    if node.target is operator.getitem:
        return is_view(parent)
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return True
    mine = storage_of(node)
    return mine is not None and mine == storage_of(parent)


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
    """`roots` and every node reachable from them through views, in discovery order."""
    seen: dict[Node, None] = dict.fromkeys(roots)
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in seen and is_view(user):
                seen[user] = None
                frontier.append(user)
    return list(seen)
