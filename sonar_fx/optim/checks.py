"""What `SonarOptimizer` refuses, naming the fix: settings that cannot hold their promise together, and an
expert update whose tensor, gradient or state would make it train differently from the twin it equals.
It only checks; it never changes a tensor or a setting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError


def refuse_unsupported(
    cfg: OptimizerConfig,
    expert_rule: str,
    granularity: str,
    accumulation: Any,
    schedule: str = "in_backward",
) -> None:
    """Combinations that would train differently from what they promise, refused naming the fix."""
    if schedule == "deferred" and accumulation is not None:
        raise SonarUsageError(
            "schedule='deferred' with accumulation='per_microbatch': the deferred schedule accumulates "
            "exactly, any number of backwards per step, as standard training does. Drop accumulation=."
        )
    if cfg.expert_clip == "global" and accumulation is not None:
        raise SonarUsageError(
            "expert_clip='global' with accumulation='per_microbatch': the global norm of one micro-batch is "
            "not the norm of the step's gradient. Use expert_clip='per_tensor' or None to accumulate."
        )
    if granularity == "per_expert" and expert_rule.endswith("bit"):
        raise SonarUsageError(
            "granularity='per_expert' with low-bit states: torchao quantizes a whole tensor in blocks, not "
            "one expert slice at a time. Use granularity='batched' or state_bits=32."
        )


def check_tensor(name: str, param: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
    """Refuse an expert update that would train differently from what it promises (fp16 weights, a
    gradient in another dtype or device, a model cast or moved after its state was made)."""
    if param.dtype == torch.float16:
        raise SonarUsageError(
            f"{name} is float16: fp16 weights need a GradScaler, whose unscale and inf check would run "
            "after Sonar has already applied the update in backward. Train in bf16 or fp32."
        )
    if grad.dtype != param.dtype or grad.device != param.device:
        raise SonarUsageError(
            f"{name}: gradient is {grad.dtype} on {grad.device} but the parameter is {param.dtype} on "
            f"{param.device}; Sonar updates weights in their own dtype. Keep expert weights and their "
            "gradients in one dtype (e.g. model.to(torch.bfloat16)), without fp32 master copies."
        )
    moment = next((v for v in state.values() if isinstance(v, Tensor) and v.dim()), None)
    if moment is not None and (moment.dtype, moment.device) != (param.dtype, param.device):
        raise SonarUsageError(
            f"{name} is now {param.dtype} on {param.device} but its optimizer state is "
            f"{moment.dtype} on {moment.device}: the model was cast or moved "
            "(model.half(), model.to(...)) after training started. Cast or move the model before "
            "the first step, or load a checkpoint into a model already on its final device and dtype."
        )
