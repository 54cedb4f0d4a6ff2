"""Lion update math (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): a
multi-tensor update, a pure single-tensor reference, and the end-of-step optimizer built on it.

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

torch has no Lion, so the reference is written here in torchao's style (one pure function per
tensor, computed in fp32 and stored in the parameter's dtype, as torch's fused kernels do for bf16).
`lion_` runs the same element-wise operations in the same order on every tensor of a list, in place
where it can (fewer temporaries while the layer's gradient is alive), so the two agree bitwise.
Legend: `params`, `grads`, `exp_avgs` share each parameter's shape and dtype. Never decides WHEN to
update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from sonar_fx.optim.adamw import grad_like_param


def lion_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    found_inf: Tensor | None = None,
) -> None:
    """Lion on every tensor of `params`, in place. `found_inf` (0-d float32, 1.0 = skip) leaves every
    tensor untouched without a sync (the new values are selected against the old on the device)."""
    if not params:
        return
    skip = None if found_inf is None else found_inf.to(torch.bool)
    for p, grad, m in zip(params, grads, exp_avgs, strict=True):
        # One tensor at a time, in place where the arithmetic allows: each product is rounded and
        # then added, exactly as `lion_ref` writes it, with a few layer-sized temporaries at most.
        p32, g32, m32 = p.float(), grad_like_param(p, grad).float(), m.float()
        update = m32 * beta1
        update.add_(g32 * (1 - beta1)).sign_()
        new_m = m32 * beta2
        new_m.add_(g32 * (1 - beta2))
        new_p = p32 * (1 - lr * weight_decay)
        new_p.sub_(update.mul_(lr))
        if skip is not None:
            new_p, new_m = torch.where(skip, p32, new_p), torch.where(skip, m32, new_m)
        p.copy_(new_p)
        m.copy_(new_m)


def lion_ref(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion on one tensor, in place: the textbook formula in fp32, stored in the parameter's dtype."""
    p32, g32, m32 = param.float(), grad.float(), exp_avg.float()
    update = (m32 * beta1 + g32 * (1 - beta1)).sign()
    new_p = p32 * (1 - lr * weight_decay) - update * lr
    new_m = m32 * beta2 + g32 * (1 - beta2)
    param.copy_(new_p)
    exp_avg.copy_(new_m)


class LionRef(torch.optim.Optimizer):
    """End-of-step Lion over `lion_ref`, one tensor at a time: the baseline Sonar's Lion is compared with."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LionRef.step() takes no closure.")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lion_ref(p, p.grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                         weight_decay=group["weight_decay"])  # fmt: skip
