"""AdamW update math: one fused in-place update over tensors, and a plain-tensor reference.

Legend: every tensor argument of `fused_adamw_` has the shape and dtype of its parameter, except
`steps` (0-d float32 on the parameter's device, as `torch.optim.AdamW(fused=True)` keeps them).
This module never decides WHEN to update; it only computes the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def grad_like_param(param: Tensor, grad: Tensor) -> Tensor:
    """`grad` with `param`'s strides (a copy only when they differ).

    CPU `_fused_adamw_` walks param and grad as flat buffers: a transposed gradient view (as graph
    outputs often are) gives silently wrong results, so its layout must match the parameter's.
    """
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param).copy_(grad)


def fused_adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    increment_steps: bool = True,
    found_inf: Tensor | None = None,
) -> None:
    """Fused AdamW, bitwise identical to `torch.optim.AdamW(fused=True)` (it makes the same calls).

    Hyper-parameters are Python floats read at call time, so changing the LR never recompiles a
    graph that calls this through an opaque op. `increment_steps=False` lets several calls share one
    step count (the per-expert ablation updates E slices of one tensor per step). `found_inf` (0-d
    float32, 1.0 = skip) makes the kernel leave every tensor untouched and takes the step back, as
    torch's AdamW does for a GradScaler's inf check: a skip decided on the device, without a sync.
    """
    if not params:
        return
    grads = [grad_like_param(p, g) for p, g in zip(params, grads, strict=True)]
    if increment_steps:
        torch._foreach_add_(list(steps), 1)
    torch._fused_adamw_(
        list(params),
        grads,
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        list(steps),
        amsgrad=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
        grad_scale=None,
        found_inf=found_inf,
    )
    if found_inf is not None and increment_steps:
        torch._foreach_sub_(list(steps), [found_inf] * len(steps))


def nonfinite_flag(grad: Tensor) -> Tensor:
    """0-d float32: 1.0 if `grad` holds an inf or NaN, else 0.0 (no sync, no grad-sized temporary).

    min and max propagate NaN and reach any inf, so one reduction pass decides it.
    """
    lo, hi = torch.aminmax(grad)
    return (~torch.isfinite(torch.stack((lo, hi))).all()).to(torch.float32)


def adamw_ref(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Plain-tensor AdamW in fp32 (the textbook formula); `step` is the count AFTER this update."""
    p32, g32 = param.float(), grad.float()
    m32 = exp_avg.float().mul_(beta1).add_(g32, alpha=1 - beta1)
    v32 = exp_avg_sq.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    p32.mul_(1 - lr * weight_decay)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = (v32 / bias2).sqrt_().add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / bias1)
    param.copy_(p32)
    exp_avg.copy_(m32)
    exp_avg_sq.copy_(v32)
