"""Optimizer configuration shared by every training method.

A frozen, keyword-only dataclass: the one place where hyper-parameters are validated. It never holds
tensors or model state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ConfigFieldError(ValueError):
    """A config value is invalid; `field` names it, so a caller can name its own flag for it."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """AdamW hyper-parameters for dense and expert tensors alike."""

    lr: float = 2e-5
    """Peak learning rate; an LR scheduler on `SonarOptimizer` scales both groups from it."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Exponential decay rates of the first and second moments, each in [0, 1)."""
    eps: float = 1e-8
    """Denominator term, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), >= 0."""
    max_grad_norm: float | None = 1.0
    """Global-norm clip of the DENSE gradients at `step()`; None or inf turns clipping off."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0 and math.isfinite(self.lr), "lr", self.lr, "a finite number >= 0")
        betas = tuple(self.betas)
        _check(len(betas) == 2, "betas", self.betas, "a pair (beta1, beta2)")
        for i, b in enumerate(betas):
            _check(0.0 <= b < 1.0, f"betas[{i}]", b, "in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _check(self.eps > 0 and math.isfinite(self.eps), "eps", self.eps, "a finite number > 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        if self.max_grad_norm is not None:
            _check(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "> 0, or None for no clip")

    @property
    def clips(self) -> bool:
        """Whether `step()` clips the dense gradients."""
        return self.max_grad_norm is not None and math.isfinite(self.max_grad_norm)


def _check(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigFieldError(
            f"AdamWConfig.{field}={value!r} is invalid: expected {expected}.", field=field.split("[")[0]
        )
