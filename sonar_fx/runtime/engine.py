"""What the running backward does with an expert's gradient, asked of autograd's engine at run time.

A compiled backward graph is one autograd node: it runs whole whenever any of its inputs needs a
gradient, so its in-graph updates would run for a backward that plain torch would never let reach an
expert's `.grad`: `torch.autograd.grad(...)` (it returns gradients and accumulates none) or
`backward(inputs=...)` that leaves the expert out. The engine knows, for the graph task in progress,
which nodes it will execute: an expert's `AccumulateGrad` node runs exactly when plain torch would add
to its `.grad`. The update op asks that here, from the parameter it was handed, each time it runs, so
one compiled graph serving both kinds of backward is right for both (never decided at compile time).
Imports torch only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

GradientFate = Literal["accumulate", "left_out", "requested"]
"""What plain torch's running backward does with a parameter's gradient: adds it to `.grad`
("accumulate"), computes none for it ("left_out": `backward(inputs=...)` without it, or
`torch.autograd.grad` for other tensors), or hands it back to the caller ("requested": it is among
`torch.autograd.grad`'s inputs; its `.grad` is never touched)."""

NO_TASK = -1  # `torch._C._current_graph_task_id()` outside any backward
_REQUESTED_LEAF = "currently running autograd.grad()"  # the engine's refusal for a captured leaf
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)


def gradient_fate(param: Tensor, node: Node | None = None) -> GradientFate:
    """The fate of `param`'s gradient in the backward running on this thread. Outside any backward (the
    op called directly) it is "accumulate": the caller asked for the update itself. `node`: `param`'s
    `accumulate_grad_node`, where the caller looked it up already (it costs more than the question)."""
    if torch._C._current_graph_task_id() == NO_TASK:
        return "accumulate"
    if not param.requires_grad:
        return "left_out"  # frozen since the forward: torch accumulates nothing into it
    try:
        node = node if node is not None else accumulate_grad_node(param)
        executes = torch._C._will_engine_execute_node(node)
    except RuntimeError as err:
        # The engine answers for a leaf of `torch.autograd.grad` by refusing to: it captures that
        # gradient for the caller instead of executing the leaf's node.
        if _REQUESTED_LEAF in str(err):
            return "requested"
        raise
    return "accumulate" if executes else "left_out"


def accumulate_grad_node(param: Tensor) -> Node:
    """`param`'s `AccumulateGrad` node: the one the running graph holds (a leaf keeps one while any
    graph refers to it). Reached through a view, which records its `grad_fn` only with autograd's
    dispatch keys on: a custom op's body runs below them, so they are lifted for this view alone."""
    with (
        torch.enable_grad(),
        torch._C._SetExcludeDispatchKeyGuard(_AUTOGRAD_KEYS[0], False),
        torch._C._SetExcludeDispatchKeyGuard(_AUTOGRAD_KEYS[1], False),
    ):
        return get_gradient_edge(param).node
