"""The optimizer-in-backward of PyTorch's tutorial, written by hand for the experts: what Sonar's eager
hooks are timed against.

PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass" gives each
tensor its own optimizer and steps it in a post-accumulate-grad hook. Here: one
`torch.optim.AdamW(fused=True)` per batched expert tensor, stepped and zeroed in its hook; the dense
tensors keep one fused AdamW at the end of the step, their global norm clipped. That is Sonar's
arithmetic with expert_clip=None (the same updates in the same order, so the same weights bitwise) and
its memory, without anything else Sonar does: no logged norms, no non-finite check, no step
bookkeeping. This module never measures; `benchmarks.methods` times it (and `--profile`, op by op).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.methods import Execution, GradClip, Method, TrainingMethod

METHOD = "expert_hooks_by_hand"
KIND = Method(METHOD, clip="dense", expert_clips=(None,))
"""Not a `sonar_fx.methods` method (no command line, no engines): its own kind, dense gradients clipped."""


class _HandwrittenHooks(TrainingMethod):
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The dense optimizer and every expert tensor's (all hold state: memory tables count them)."""
        assert self.optimizer is not None
        return [self.optimizer, *self.hook_optimizers.values()]

    def optimizer_step(self) -> None:
        """The dense step only (the hooks stepped the experts): clip the dense gradients, update."""
        assert self.optimizer is not None
        self.clip.apply_()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def handwritten_expert_hooks(model: nn.Module, cfg: AdamWConfig) -> TrainingMethod:
    """`model` trained by the tutorial's hooks on its expert tensors (eager): see the module docstring."""
    split = ExpertSet.discover(model).split(model)

    def adamw(params: list[nn.Parameter]) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
        )

    per_tensor: dict[Tensor, torch.optim.AdamW] = {p: adamw([p]) for p in split.expert_params}

    def optimizer_hook(parameter: Tensor) -> None:
        per_tensor[parameter].step()
        per_tensor[parameter].zero_grad()

    for p in split.expert_params:
        p.register_post_accumulate_grad_hook(optimizer_hook)
    return _HandwrittenHooks(
        KIND,
        Execution(compiler="eager"),
        model,
        adamw(split.dense_params),
        GradClip.of(KIND, cfg, split),
        hook_optimizers={id(p): o for p, o in per_tensor.items()},
    )
