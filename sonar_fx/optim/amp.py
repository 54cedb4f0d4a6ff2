"""The GradScaler stepping this optimizer, if any: so the deferred schedule's expert gradients join its
unscale and inf verdict.

A scaler unscales and checks the gradients it finds in `optimizer.param_groups`; the deferred
schedule's expert gradients do not exist yet when it looks (they are computed at `step()`). When
`GradScaler.step` calls our `step()` (its `_maybe_opt_step`, after finding the dense gradients
finite), the scaler and its per-optimizer state are that frame's locals: `step()` then unscales each
expert gradient with the same kernel and inverse scale, and adds any inf it finds to the scaler's
`found_inf_per_device`, so that `update()` backs off exactly as when the scaler saw every gradient.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_STEP_CODE = torch.amp.GradScaler._maybe_opt_step.__code__


@dataclass
class ScalerStep:
    """A `GradScaler.step` in progress on this optimizer."""

    inv_scale: Tensor
    """1 / scale, in fp32, computed as `GradScaler.unscale_` computes it."""
    state: dict[str, Any]
    """The scaler's state for this optimizer (its "found_inf_per_device" feeds `update()`)."""

    def unscale_(self, grad: Tensor, found_inf: Tensor) -> None:
        """`grad *= inv_scale` in place, with `found_inf` set where it is not finite (the scaler's kernel)."""
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, self.inv_scale.to(grad.device))

    def report_inf(self, found_inf: Tensor) -> None:
        """Add the experts' verdict to the scaler's, which `update()` reads."""
        per_device = self.state["found_inf_per_device"]
        target = per_device.get(found_inf.device)
        if target is None:
            target = next(iter(per_device.values()))
        target.add_(found_inf.to(target.device))


def scaler_step(optimizer: object) -> ScalerStep | None:
    """The `GradScaler.step` that called `optimizer.step()`, found on the call stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _STEP_CODE and frame.f_locals.get("optimizer") is optimizer:
            scaler = frame.f_locals["self"]
            inv_scale = scaler._scale.double().reciprocal().float()
            return ScalerStep(inv_scale, frame.f_locals["optimizer_state"])
        frame = frame.f_back  # type: ignore[assignment]
    return None
