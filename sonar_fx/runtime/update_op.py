"""The in-graph expert update: `torch.ops.sonar_fx.expert_update_`, inserted by the graph pass.

A `torch.library.custom_op` with a mutable schema, so no dead-code elimination removes it and
inductor orders it after every earlier reader of the tensors it names as mutated: the parameter's
aliases in the backward graph (the saved weight and its saved views). WHICH parameter, its owner,
state and hyper-parameters are all found when the op runs, from the aliases the graph hands it: a
graph dynamo reuses for another module updates that module's tensor, and an LR change never
recompiles. WHETHER to update is asked of autograd's engine when the op runs (`engine`): the graph
runs whole for every backward that reaches it, but only a backward that would add to the expert's
`.grad` may move it (not `torch.autograd.grad`, nor `backward(inputs=...)` leaving it out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_fx.runtime.engine import gradient_fate
from sonar_fx.runtime.registry import resolve


# cudagraph_unsafe: the op decides in Python, at run time, which tensor to update and with which LR; a
# CUDA graph replay would freeze those decisions, so inductor must keep it out of captured regions.
@torch.library.custom_op(
    "sonar_fx::expert_update_", mutates_args=("param_aliases",), tags=(torch.Tag.cudagraph_unsafe,)
)
def expert_update_(grad: Tensor, param_aliases: list[Tensor], reduced: str = "") -> None:
    """Update the expert parameter that `param_aliases` (the weight or views of it) alias with `grad`.

    `reduced` names the all-reduce the graph applied to `grad` before this op ("" for none); the owner
    refuses a gradient reduced otherwise than its distributed setup expects."""
    if not param_aliases:
        raise RuntimeError("sonar_fx::expert_update_ needs at least one alias of the expert parameter.")
    param, owner = resolve(param_aliases[0])
    fate = gradient_fate(param)
    if fate != "accumulate":
        owner.not_accumulated(param, fate)  # the gradient is dropped, as torch computes none for .grad
        return
    meter = owner.meter
    meter.appeared(param, grad.nbytes)
    try:
        owner.update_expert_(param, grad, path="graph", reduced=reduced)
    finally:
        meter.freed(param)  # the op is the gradient's last use: the graph frees it as the op returns


@expert_update_.register_fake
def _expert_update_fake(grad: Tensor, param_aliases: list[Tensor], reduced: str = "") -> None:
    return None


EXPERT_UPDATE_OP = torch.ops.sonar_fx.expert_update_.default
