"""SGD update math: torch's fused kernel over tensors (momentum, dampening, Nesterov, L2 decay), and a
plain-tensor reference.

Legend: every tensor argument has the shape and dtype of its parameter; a momentum buffer is None
until the tensor's first update (as `torch.optim.SGD` keeps it). This module never decides WHEN to
update; it only computes the update.

MEASURED (torch 2.13 CPU): `torch._fused_sgd_` leaves bf16 (and fp16) CPU tensors UNCHANGED, with or
without momentum, and raises nothing: `torch.optim.SGD(fused=True)` silently does not train them. Such
tensors take torch's foreach SGD instead (`torch.optim.SGD(foreach=True)`'s arithmetic), and
`torch_sgd` builds the matching twin, so no path trains silently wrong.

MEASURED (torch 2.13 CPU, bf16): torch's foreach SGD steps the momentum of a param group whose tensors
all hold a buffer with `_foreach_mul_` / `_foreach_add_`, and that of a group where some tensor has
none yet with `buf.mul_(momentum).add_(grad)` per tensor: other bits. Sonar updates each expert tensor
on its own, so an expert group with some buffers and not others would train differently from torch's
step over the group: `refuse_mixed_momentum` refuses it before any weight moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd as sgd_functional

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.adamw import grad_like_param


def fused_sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor | None],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    found_inf: Tensor | None = None,
) -> list[Tensor | None]:
    """Fused SGD, bitwise identical to `torch.optim.SGD(fused=True)` (the same `_fused_sgd_` call);
    returns the momentum buffers after the update (new ones for tensors updated the first time).

    On a tensor's first update the kernel sets its buffer to the gradient (`is_first_step`), as
    torch does. torch decides that per call ("no buffer yet for every tensor"); tensors with and
    without a buffer go to separate calls here, where torch would fail. `found_inf` (0-d float32,
    1.0 = skip) leaves every tensor untouched, without a sync.
    """
    buffers = list(momentum_buffers)
    if not params:
        return buffers
    grads = [grad_like_param(p, g) for p, g in zip(params, grads, strict=True)]
    if not fused_kernel_works(params):
        # The foreach path takes no skip flag: a non-finite gradient is checked on the host (one sync).
        if found_inf is None or not bool(found_inf):
            sgd_functional(
                list(params), grads, buffers, foreach=True, weight_decay=weight_decay, momentum=momentum,
                lr=lr, dampening=dampening, nesterov=nesterov, maximize=False,
            )  # fmt: skip
        return buffers
    hyper = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov)
    if momentum == 0:
        _kernel(list(params), grads, [], first=False, found_inf=found_inf, **hyper)
        return buffers
    fresh = [i for i, b in enumerate(buffers) if b is None]
    kept = [i for i, b in enumerate(buffers) if b is not None]
    # A fresh buffer: the kernel writes the gradient into it.
    full: list[Tensor] = [torch.empty_like(grads[i]) if b is None else b for i, b in enumerate(buffers)]
    for group, first in ((fresh, True), (kept, False)):
        if group:
            _kernel([params[i] for i in group], [grads[i] for i in group], [full[i] for i in group],
                    first=first, found_inf=found_inf, **hyper)  # fmt: skip
    return list(full)


def fused_kernel_works(params: Sequence[Tensor]) -> bool:
    """Whether `torch._fused_sgd_` updates these tensors (see the module docstring); DTensors (FSDP2
    shards) take foreach SGD too: the fused kernel has no DTensor sharding strategy (torch 2.13)."""
    return not any(
        (p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)) or hasattr(p, "device_mesh")
        for p in params
    )


def torch_sgd(params: Sequence[Any], **hyper: Any) -> torch.optim.SGD:
    """`torch.optim.SGD(fused=True)`, or `foreach=True` where the fused kernel does not update."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    if fused_kernel_works(tensors):
        return torch.optim.SGD(params, fused=True, **hyper)
    return torch.optim.SGD(params, foreach=True, **hyper)


def refuse_mixed_momentum(
    group: dict[str, Any], state: Mapping[Tensor, dict[str, Any]], name_of: Callable[[Tensor], str]
) -> None:
    """Raise if some tensors of the expert param group `group` hold a momentum buffer and others none
    while they take torch's foreach SGD (see the module docstring): Sonar steps each on its own, torch
    would step the group on its per-tensor path. `state`: the optimizer's, read without adding keys."""
    params = group["params"]
    if not group.get("momentum") or fused_kernel_works(params):
        return
    held = [p for p in params if "momentum_buffer" in state.get(p, {})]
    if not held or len(held) == len(params):
        return
    lacking = [p for p in params if "momentum_buffer" not in state.get(p, {})]
    raise SonarUsageError(
        f"SGD with momentum on {params[0].dtype} CPU expert tensors: {name_of(held[0])} holds a momentum "
        f"buffer and {name_of(lacking[0])} ({len(lacking)} tensor(s) in all) none yet, because some expert "
        "tensors stepped before the others (a backward(inputs=...) naming some of them). torch's foreach "
        "SGD, the path these tensors take, steps such a group with other bf16 roundings than one whose "
        "tensors all hold a buffer, and Sonar updates each expert tensor on its own: the bits would differ "
        "from torch.optim.SGD. Step every expert tensor from the first step on (leave expert tensors out "
        "of backward(inputs=...)), train the experts in fp32 (torch's fused SGD), or use momentum=0."
    )


def _kernel(
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[Tensor],
    *,
    first: bool,
    found_inf: Tensor | None,
    **hyper: Any,
) -> None:
    torch._fused_sgd_(
        params, grads, buffers, **hyper, maximize=False, is_first_step=first, grad_scale=None,
        found_inf=found_inf,
    )  # fmt: skip


def sgd_ref(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
) -> Tensor | None:
    """Plain-tensor SGD in fp32 (torch's documented algorithm); returns the new momentum buffer."""
    p32, g32 = param.float(), grad.float()
    if weight_decay:
        g32 = g32 + weight_decay * p32
    buf = None
    if momentum:
        if momentum_buffer is None:
            buf = g32.clone()
        else:
            buf = momentum_buffer.float() * momentum + (1 - dampening) * g32
        g32 = g32 + momentum * buf if nesterov else buf
    param.copy_(p32 - lr * g32)
    return None if buf is None else buf.to(param.dtype)
