"""The LR schedule of a fine-tuning run: linear warm-up, then cosine decay to a floor.

Never: step itself (the trainer steps one `LambdaLR` per optimizer after each optimizer step, so the
LR of step t is set before its backward, where Sonar reads it).
"""

from __future__ import annotations

import math


class WarmupCosine:
    """LR multiplier: linear warm-up to 1, then cosine to `min_ratio` at the last step.

    A class, not a closure, so `LambdaLR.state_dict()` saves its fields with the checkpoint.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup  # +1: the first step already learns
        progress = min(1.0, (step - self.warmup) / max(1, self.total - 1 - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
