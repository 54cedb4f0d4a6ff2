"""The in-graph expert update: `torch.ops.sonar_fx.expert_update_`, inserted by the graph pass.

A `torch.library.custom_op` with a mutable schema, so no dead-code elimination removes it and
inductor orders it after every earlier reader of the tensors it names as mutated: the parameter's
aliases in the backward graph (the saved weight and its saved views). Parameter, optimizer state,
step and hyper-parameters live outside the graph, found by `slot`, so an LR change never recompiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_fx.optim.slots import update_from_slot


@torch.library.custom_op("sonar_fx::expert_update_", mutates_args=("param_aliases",))
def expert_update_(grad: Tensor, param_aliases: list[Tensor], slot: int) -> None:
    """AdamW on the expert tensor in `slot` with `grad`; `param_aliases` are views of that tensor."""
    update_from_slot(slot, grad, path="graph")


@expert_update_.register_fake
def _expert_update_fake(grad: Tensor, param_aliases: list[Tensor], slot: int) -> None:
    return None


EXPERT_UPDATE_OP = torch.ops.sonar_fx.expert_update_.default
