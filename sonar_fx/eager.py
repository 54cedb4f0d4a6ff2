"""Eager Sonar-MoE: one post-accumulate-grad hook per batched expert tensor (the paper's method).

Each hook applies the fused AdamW update as soon as the tensor's gradient is complete and frees it,
so at most one layer of expert gradients is alive. Under the compiled pass the same hooks are the
safety net for gradients computed outside any compiled graph (a hook finds no gradient, and does
nothing, for a tensor whose gradient the graph consumed). Hooks never clip, never scale, and never
touch dense parameters.
"""

from __future__ import annotations

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from sonar_fx.optim.optimizer import SonarOptimizer


def register_expert_hooks(optimizer: SonarOptimizer) -> list[RemovableHandle]:
    """Hook every expert tensor of `optimizer`; returns the handles (remove them to detach)."""
    handles = []
    for layer in optimizer.expert_layers:
        for t in layer.tensors:
            handles.append(t.param.register_post_accumulate_grad_hook(_make_hook(optimizer)))
    return handles


def _make_hook(optimizer: SonarOptimizer):
    def update_and_free(param: Tensor) -> None:
        if param.grad is None:
            return  # the compiled graph consumed this gradient (it returned None) and updated in-graph
        optimizer.update_expert_(param, param.grad, path="hook")
        param.grad = None

    return update_and_free
