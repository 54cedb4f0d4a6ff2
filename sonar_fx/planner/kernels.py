"""The expert kernels a plan models: the backend's own forward and backward, run on the fake model.

For: `sonar_fx.plan(kernels=...)` and `sonar-fx plan --kernels`. `torch` is the model as transformers
builds it (its default experts implementation, torch's grouped GEMM); `scattermoe` and `sonicmoe` are
`sonar_fx.experts.kernels` backends, selected on the fake model exactly as `use_kernel_backend` selects
them for training, less the check of the device the plan runs on (a plan for a GPU runs on fake CPU
tensors). Each backend's expert block is a set of `torch.library` custom ops with registered fake
kernels and autograd, so the step on fake tensors allocates each op's outputs and saves what its
autograd saves (`ctx.save_for_backward`), from the backend's own code.
What a fake kernel cannot show is what the real op allocates and frees inside itself. For the
project's ScatterMoE kernels that is nothing (`triton_kernels.py` writes into the op's output). For
sonic-moe the op bodies in `sonar_fx/experts/kernels/sonicmoe.py` allocate, besides their outputs,
`a_Sn` and `y_Sd` in the forward and `dx_Sd` in the backward's input-gradient op, all alive until the
op returns (`dh_S2n` and `a_prime_Sn` are that op's outputs, read by the weight-gradient ops):
`op_scratch` counts them (sonic-moe's kernels themselves are documented to write into these buffers;
any workspace of their own is not modelled).
Never: run a backend's real kernels (no package or GPU is needed to plan one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from sonar_fx.planner.fake import PlanError

Kernels = Literal["torch", "scattermoe", "sonicmoe"]
KERNELS: dict[str, str] = {
    "torch": "transformers' default experts (torch grouped GEMM)",
    "scattermoe": "ScatterMoE scatter GEMMs (sonar-fx's Triton kernels): its ops' forward and autograd",
    "sonicmoe": "sonic-moe fused kernels: the adapter's ops on fake tensors, with the buffers its op "
    "bodies allocate (sonic-moe's documented saved tensors: x, scores, the pre-activation h, routing)",
}


def select_kernels(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Make the fake `model` compute its experts with backend `name` ("torch": leave it as built)."""
    if name == "torch":
        return
    if name not in KERNELS:
        raise PlanError(f"kernels {name!r}: choose from {', '.join(KERNELS)}.")
    from sonar_fx.experts.kernels.registry import use_kernel_backend

    if name == "sonicmoe" and dtype not in (torch.bfloat16, torch.float16):
        raise PlanError(
            "kernels 'sonicmoe': sonic-moe's GEMMs take bf16 (or fp16) weights: plan --dtype bf16."
        )
    try:
        use_kernel_backend(model, name, check_device=False)
    except ValueError as err:
        raise PlanError(f"kernels {name!r}: {err}") from err


def op_scratch(kernels: str, round_bytes: Callable[[int], int]) -> Callable[[Any, Any, dict[str, Any]], int]:
    """Bytes a backend's real op allocates and frees inside itself beyond its outputs (module docstring),
    each buffer rounded by the device's allocator; 0 for every other op."""
    if kernels != "sonicmoe":
        return lambda func, args, kwargs: 0
    forward = torch.ops.sonar_fx.sonicmoe_forward.default
    backward = torch.ops.sonar_fx.sonicmoe_backward_act.default

    def scratch(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        if func is forward:  # (x_Td, scores_S, w_up, w_down, routing, ...): a_Sn, y_Sd
            x, w_down, routing = args[0], args[3], args[4]
            s, d, n, size = routing[1].shape[0], x.shape[1], w_down.shape[2], x.element_size()
            return round_bytes(s * n * size) + round_bytes(s * d * size)
        if func is backward:  # (dout, x_Td, scores, w_up, w_down, h_S2n, routing, ...): dx_Sd
            x, h = args[1], args[5]
            return round_bytes(h.shape[0] * x.shape[1] * x.element_size())
        return 0

    return scratch
