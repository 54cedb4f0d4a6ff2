"""Refuse a backward in which a compiled graph would update an expert in-graph while the same backward
also reaches that expert from outside the graph (a penalty on the expert weights added to the loss).

The in-graph update consumes the gradient of the compiled GEMM alone, as the graph's autograd node
runs; autograd adds any other part at the expert's `AccumulateGrad` node, after that node, where
the hook can only refuse it with the expert already moved. Eager hooks (and the deferred schedule)
see the sum there and are exact. So when a backward begins (`backward_root`), before any of its
updates, the autograd graph behind the backward's roots is walked once: an expert that a sonar graph's
node updates in-graph and that any other node also feeds is refused while nothing has moved.

The roots are the tensors handed to `torch.autograd.graph._engine_run_backward`, the one Python entry
of `backward()`, `torch.autograd.backward` and `torch.autograd.grad`, read from its frame: on the
thread that runs the hook (a CPU backward), or else on the one other thread inside it (a device
thread's hook). Where neither finds them, nothing is checked (the hook's refusal after the fact stays).
The walk visits every node behind the roots: only owners with compiled graphs that update in-graph pay
for it, where the graph of a compiled model collapses into few nodes. Nothing here updates.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from sonar_fx.errors import SonarUsageError
from sonar_fx.runtime.engine import gradient_fate
from sonar_fx.runtime.registry import owner_of

UPDATED_IN_GRAPH = "_sonar_updated_in_graph"
"""Attribute of a compiled graph's autograd node (`CompiledFunctionBackward`): the expert parameters
that graph's backward updates in-graph (set at each forward: dynamo reuses a graph for other modules)."""

_ENGINE_ENTRY = torch.autograd.graph._engine_run_backward.__code__
_checked_task: int | None = None  # the graph task walked last: one walk per backward
_owners_updating_in_graph: weakref.WeakSet[Any] = weakref.WeakSet()


def tag_in_graph_updates(node: Any, params: Sequence[Tensor], owners: Iterable[Any]) -> None:
    """Record on the compiled graph's autograd `node` which expert `params` its backward updates in-graph
    (held as long as that node, i.e. this forward's graph), and that their `owners` run such graphs."""
    setattr(node, UPDATED_IN_GRAPH, tuple(params))
    _owners_updating_in_graph.update(owners)


def updates_in_graph(owner: Any) -> bool:
    """Whether a graph that updates `owner`'s experts in-graph ever ran (at run time: dynamo reuses a
    graph for other models): only then is a backward walked, so an eager model pays nothing."""
    return owner in _owners_updating_in_graph


def refuse_reads_outside_graph() -> None:
    """In a backward that began: raise `SonarUsageError` if it reaches an expert that a compiled graph
    updates in-graph from any other node too. Walks once per backward (graph task)."""
    global _checked_task
    task = torch._C._current_graph_task_id()
    if task == _checked_task:
        return
    _checked_task = task
    roots = running_backward_roots()
    if roots is None:
        return
    both = [p for p in experts_reached_outside_graph(roots) if gradient_fate(p) == "accumulate"]
    if both:
        raise SonarUsageError(_message(both))


def experts_reached_outside_graph(roots: Iterable[Node]) -> list[Tensor]:
    """The expert parameters that a tagged compiled node behind `roots` updates in-graph and that some
    other node (eager code, or a graph that returns its gradient) also feeds."""
    in_graph: dict[int, Tensor] = {}
    outside: set[int] = set()
    seen: dict[int, Node] = {}  # id -> node, held so that an id is never reused during the walk
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        updated = {id(p) for p in getattr(node, UPDATED_IN_GRAPH, ())}
        for f, _ in node.next_functions:
            if f is None:
                continue
            if type(f).__name__ != "AccumulateGrad":
                stack.append(f)
                continue
            leaf: Tensor = f.variable  # type: ignore[attr-defined]
            if id(leaf) in updated:
                in_graph[id(leaf)] = leaf
            else:
                outside.add(id(leaf))
    return [p for key, p in in_graph.items() if key in outside]


def running_backward_roots() -> list[Node] | None:
    """The root nodes of the backward running on this thread (the innermost, for a nested one), or of the
    one other thread inside a backward (a device thread runs this one's hooks); None when unknown."""
    frame = _innermost_entry(sys._getframe(1))
    if frame is None:
        others = [_innermost_entry(f) for f in sys._current_frames().values()]
        entries = [f for f in others if f is not None]
        frame = entries[0] if len(entries) == 1 else None
    if frame is None:
        return None
    nodes = (_root_node(t) for t in frame.f_locals.get("t_outputs", ()))
    return [n for n in nodes if n is not None]


def _innermost_entry(frame: FrameType | None) -> FrameType | None:
    while frame is not None and frame.f_code is not _ENGINE_ENTRY:
        frame = frame.f_back
    return frame


def _root_node(root: Tensor | GradientEdge) -> Node | None:
    if isinstance(root, GradientEdge):
        return root.node
    if not isinstance(root, Tensor) or not root.requires_grad:
        return None
    return root.grad_fn if root.grad_fn is not None else get_gradient_edge(root).node


def _message(params: list[Tensor]) -> str:
    names = _names(params)
    shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return (
        f"this backward reaches {len(names)} expert tensor(s) ({shown}) both through the compiled graph "
        "that updates them in-graph and from outside it: the weight is read outside the compiled forward, "
        "e.g. a penalty on the expert weights added to the loss (loss + sum(p.square().sum() ...)). The "
        "in-graph update would use the compiled GEMM's gradient alone. Refused before any weight moved. "
        "Compute the penalty inside the model's forward (the compiled graph then sums it before the "
        "update), use the optimizer's weight_decay instead of an L2 penalty, or schedule='deferred' or "
        "compiler='eager' (exact: they see the whole gradient)."
    )


def _names(params: list[Tensor]) -> list[str]:
    found = []
    for p in params:
        owner = owner_of(p)
        name = getattr(owner, "expert_name", None)
        found.append(name(p) if name is not None else f"a tensor of shape {tuple(p.shape)}")
    return found
