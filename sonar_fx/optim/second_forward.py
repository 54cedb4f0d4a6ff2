"""Two forwards with gradients before one backward, under the in-backward schedule: refused at the second.

Each compiled graph's backward updates the experts it holds, in place; a second forward of the same
expert tensors before any backward would give one step two such backwards (a second update, or
torch's "modified by an inplace operation" part-way through, after the first graph's experts moved).
Refused at that second forward, before any backward runs, so no weight moves. Two watchers, one per
route, with one message: `sonar_fx.compile`'s wrapper (`CompiledForward`, per compiled module) and the
sonar backend's graph wrapper (`mark_graph_backward`, per expert tensor: a regionally compiled layer
runs one graph for several layers' experts in one forward). Nothing here updates anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from sonar_fx.errors import SonarUsageError

ForwardMark = tuple[int, int]
"""(backwards begun, steps ended) of an optimizer when a forward ran: equal marks, no backward between."""


def second_forward_error() -> SonarUsageError:
    """The refusal of a second forward with gradients before any backward (both routes)."""
    return SonarUsageError(
        "a compiled module ran a second forward with gradients before any backward (two losses "
        "backpropagated together, as DPO's chosen and rejected, or a compiled block that runs twice "
        "in one forward): the in-backward schedule updates the experts in each compiled graph's "
        "backward, so one step would update them twice. Use schedule='deferred' (exact: each "
        "forward's operands are kept until step()), run both batches in one forward (torch.cat), "
        "or compiler='eager'. A forward you do not backpropagate belongs under torch.no_grad()."
    )


def forward_mark(optimizer: Any) -> ForwardMark:
    """Where `optimizer` stands now: a backward begun or a step ended since changes it."""
    return (optimizer.tracker.backwards, optimizer.steps_ended)


_graph_forwards: weakref.WeakKeyDictionary[Any, dict[int, ForwardMark]] = weakref.WeakKeyDictionary()
"""Owner -> id of each expert tensor a graph updating it in backward ran a forward of -> that forward's
mark. Held weakly: a dropped optimizer leaves nothing."""


def refuse_second_graph_forward(experts: Iterable[tuple[Any, torch.Tensor]]) -> None:
    """Before a compiled graph's forward with gradients (outside any backward), whose backward updates
    the expert tensors `experts` ((owner, tensor) pairs) in place: refuse when an earlier forward of one
    of them has had no backward begin and no step end since. Told once, like the wrapper: the owner's
    forwards are forgotten, so the forward after the refused one starts afresh (a dropped forward's
    outputs never backpropagate, and a forward is never refused twice for it)."""
    seen: list[tuple[dict[int, ForwardMark], int, ForwardMark]] = []
    for owner, tensor in experts:
        if getattr(owner, "schedule", None) != "in_backward":
            continue
        forwards, mark = _graph_forwards.setdefault(owner, {}), forward_mark(owner)
        if forwards.get(id(tensor)) == mark:
            forwards.clear()
            raise second_forward_error()
        seen.append((forwards, id(tensor), mark))
    for forwards, key, mark in seen:  # recorded only once the whole forward is allowed
        forwards[key] = mark
