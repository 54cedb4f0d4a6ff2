"""Eager Sonar-MoE: one post-accumulate-grad hook per batched expert tensor (the paper's method).

Each hook applies the owner's update as soon as the tensor's gradient is complete and frees it, so at
most one layer of expert gradients is alive. Under the compiled pass the same hooks are the safety
net for gradients computed outside any compiled graph (a hook finds no gradient, and does nothing,
for a tensor whose gradient the graph consumed). The hook holds no reference to its owner: it looks
the owner up when it fires, so a dropped optimizer is freed and its tensors train as plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from sonar_fx.runtime.registry import owner_of


def register_expert_hooks(params: Iterable[Tensor]) -> list[RemovableHandle]:
    """Hook every tensor in `params`; returns the handles (remove them to detach)."""
    return [p.register_post_accumulate_grad_hook(update_and_free) for p in params]


def update_and_free(param: Tensor) -> None:
    """The hook: update `param` through its owner, then free its gradient."""
    if param.grad is None:
        return  # the compiled graph consumed this gradient (it returned None) and updated in-graph
    owner = owner_of(param)
    if owner is None:
        return  # no live owner: the gradient stays in .grad, as without Sonar
    owner.update_expert_(param, param.grad, path="hook")
    param.grad = None
