"""The plain Trainer's end of a step, where SonarTrainer's differs: what happens around `step()` under
the deferred schedule (the norm logged, accelerate's skipped-step flag, the kept operands dropped),
and the norm over every gradient the Trainer logs, from what Sonar holds (`norm_over_every_parameter`).
Never: clip, or move a weight (Sonar's `step()` does both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

from sonar_fx.optim.norms import total_norm
from sonar_fx.optim.optimizer import SonarOptimizer


class DeferredStep(TrainerCallback):
    """The Trainer's end of a deferred step, where its loop assumes the gradients were all in `.grad`:
    - the norm it logs is the one Sonar's step() clipped by (the Trainer's clip is off), or without a
      clip the norm over every parameter that the Trainer takes (`norm_over_every_parameter`);
    - accelerate reports a step skipped (and the Trainer then holds the LR scheduler) when the scaler
      did not call `step()`. The plain Trainer's fused AdamW (`_step_supports_amp_scaling`) is always
      called and skips inside, so its LR schedule advances on every step; Sonar's step is not called
      when the DENSE gradients overflowed, so the flag is cleared, as the fused AdamW leaves it;
    - the kept operands of a skipped step are dropped with the gradients: the Trainer zeroes the
      model's gradients, not the optimizer's, and kept operands are the optimizer's."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.scale: float | None = None

    def _scaler(self) -> Any:
        return getattr(getattr(self.trainer, "accelerator", None), "scaler", None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.sonar.schedule != "deferred":
            return
        scaler = self._scaler()
        self.scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.sonar.schedule != "deferred":
            return
        scaler, optimizer = self._scaler(), kwargs["optimizer"]
        backed_off = self.scale is not None and scaler.get_scale() < self.scale
        if self.scale is not None and hasattr(optimizer, "_is_overflow"):
            optimizer._is_overflow = False  # behind `optimizer_step_was_skipped`
        sonar = self.trainer.sonar
        norms = sonar.clipper.last  # the step's; its dense gradients are in `.grad` until zero_grad
        norm = norms.total if norms.total is not None else norm_over_every_parameter(sonar, norms.experts)
        if self.trainer._sonar_norm is not None and norm is not None and not backed_off:
            self.trainer._sonar_norm.copy_(norm)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.sonar.schedule == "deferred":
            self.trainer.sonar.zero_grad()


def norm_over_every_parameter(opt: SonarOptimizer, expert_norms: Mapping[str, Tensor]) -> Tensor | None:
    """The norm `clip_grad_norm_(model.parameters(), ...)` returns over every gradient, from what Sonar
    holds: each dense `.grad`'s norm and `expert_norms` (name -> the norm of that expert gradient, taken
    in its update before it was freed), combined in the model's order as `get_total_norm` combines them.
    None when no gradient exists."""
    order, ids = opt.model_order(), {name: pid for pid, name in opt.experts.names_by_id().items()}
    dense = [p for p in opt.dense_params() if p.grad is not None]
    norms = torch._foreach_norm([p.grad for p in dense if p.grad is not None], 2.0) if dense else []
    by_rank = {order[id(p)]: n for p, n in zip(dense, norms, strict=True)}
    by_rank.update({order[ids[name]]: n for name, n in expert_norms.items()})
    return total_norm([by_rank[r] for r in sorted(by_rank)]) if by_rank else None
