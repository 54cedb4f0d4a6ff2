"""Ablations and fault injection for tests: variants of the backward pass that production never ships.

`naive_update_pass` places each update right after its weight gradient and names no alias: the
placement hazard the production pass avoids (the input gradient then reads an updated weight).
`failing_pass` raises, as a compiler failure would, to exercise the fallback;
`inject_backward_fault` makes a backward raise part-way, after the layers above it were updated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from sonar_fx.passes import find_expert_grads, insert_update
from sonar_fx.passes.find_expert_grads import ExpertGrad
from sonar_fx.passes.graph_utils import is_view


def naive_update_pass(bw_gm: GraphModule, example_inputs=None, *, fw_gm, expert_inputs) -> GraphModule:
    grads = find_expert_grads(fw_gm, bw_gm, expert_inputs)
    (output,) = bw_gm.graph.find_nodes(op="output")
    returned = list(output.args[0])
    for eg in grads:
        # The op still needs one alias to find its parameter at run time; it is not named as mutated
        # anywhere a reader could be ordered against, because the update runs before those readers.
        insert_update(bw_gm, eg, anchor=_hoist_view_chain(eg), aliases=eg.aliases[:1])
        returned[eg.input_index] = None
    output.args = (tuple(returned),)
    bw_gm.graph.lint()
    bw_gm.recompile()
    bw_gm.meta["sonar_updates"] = [(eg.input_index, eg.kind) for eg in grads]
    return bw_gm


def failing_pass(bw_gm: GraphModule, example_inputs=None, *, fw_gm, expert_inputs) -> GraphModule:
    raise RuntimeError("sonar: injected compiler failure")


def _hoist_view_chain(eg: ExpertGrad) -> Node:
    """Move the views between producer and grad right after the producer; return the last one."""
    chain = []
    node = eg.grad
    while node is not eg.producer:
        chain.append(node)
        node = node.args[0]
    anchor = eg.producer
    for view in reversed(chain):
        assert is_view(view)
        anchor.append(view)
        anchor = view
    return anchor


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected fault in backward")


def inject_backward_fault(module: torch.nn.Module, when: Callable[[], bool]) -> None:
    """Make the backward through `module`'s output raise whenever `when()` was true at its forward.

    The fault runs outside compiled graphs (`torch.compiler.disable`), so a compiled model splits there
    and the graph above it has already updated its experts when the fault fires.
    """

    @torch.compiler.disable
    def hook(mod, args, output):
        if not when():
            return output
        if isinstance(output, tuple):
            return (_RaiseInBackward.apply(output[0]), *output[1:])
        return _RaiseInBackward.apply(output)

    module.register_forward_hook(hook)


def inject_backward_hook_fault(module: torch.nn.Module) -> dict[str, bool]:
    """A backward pre-hook on `module` that raises while the returned switch's "on" is true (dynamo
    compiles a module's backward hook into the graph; eager runs it between layers)."""
    fault = {"on": False}

    def pre_hook(mod, grad_output):
        if fault["on"]:
            raise RuntimeError("injected fault in a module backward hook")

    module.register_full_backward_pre_hook(pre_hook)
    return fault


GRAPH_FAULT = {"on": False}
"""Switch of `inject_graph_fault`: read by the op at run time, so one compiled graph serves both."""


@torch.library.custom_op("sonar_test::fault_grad", mutates_args=())
def _fault_grad(grad: torch.Tensor) -> torch.Tensor:
    if GRAPH_FAULT["on"]:
        raise RuntimeError("injected fault inside the compiled backward")
    return grad.clone()


@_fault_grad.register_fake
def _(grad):
    return torch.empty_like(grad)


@torch.library.custom_op("sonar_test::fault_point", mutates_args=())
def _fault_point(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_fault_point.register_fake
def _(x):
    return torch.empty_like(x)


_fault_point.register_autograd(lambda ctx, grad: _fault_grad(grad))


def inject_graph_fault(module: torch.nn.Module) -> None:
    """Route `module`'s output through an op whose backward raises while `GRAPH_FAULT["on"]`: traced into
    the compiled graph (unlike `inject_backward_fault`), so the fault fires in the middle of the one
    autograd node that a compiled backward is, after the updates above it in the same graph ran."""

    def hook(mod, args, output):
        if isinstance(output, tuple):
            return (_fault_point(output[0]), *output[1:])
        return _fault_point(output)

    module.register_forward_hook(hook)
