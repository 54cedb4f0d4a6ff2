"""Small FX helpers shared by the Sonar passes: views and aliases from torch's own information.

A node is a view when its op's schema says so (`OpOverload.is_view`), or when its fake value lives in
its input's storage (ops such as `_unsafe_view` alias without declaring it). Aliases of a tensor are
found by fake-tensor storage identity. Pure FX code: never imports training code, never runs a graph.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node
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


def view_root(node: Node) -> Node:
    """The first non-view node behind `node` (itself when it is no view)."""
    while is_view(node):
        parent = node.args[0]
        assert isinstance(parent, Node)
        node = parent
    return node


def saved_aliases(fw_gm: GraphModule, bw_gm: GraphModule, primal: Node) -> list[Node]:
    """The backward placeholders that hold the forward input `primal` or a view of it: the forward value
    saved under the same name is `primal` or is reached from it through views only, and shares its
    storage. Storage identity alone is not enough: the outputs of a nested compile region are cached
    fake tensors shared by every call of the region, so one call's saved weight would pass for
    another's."""
    storage = storage_of(primal)
    if storage is None:
        return []
    forward = {n.name: n for n in fw_gm.graph.nodes}
    found = []
    for p in bw_gm.graph.find_nodes(op="placeholder"):
        source = forward.get(p.name)
        if source is not None and shares_storage(p, storage) and view_root(source) is primal:
            found.append(p)
    return found


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
