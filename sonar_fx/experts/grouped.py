"""Grouped GEMM for the reference expert kernel, as opaque `torch.library` custom ops.

Legend: S routed token-slots (sorted by expert), E experts, k input and o output features.
`offs_E` holds int32 cumulative group ends, as `torch._grouped_mm` takes them. The forward and the
backward are each one op, so a compiled backward graph shows the weight gradient as
`getitem(sonar_fx.grouped_mm_backward, 1)`, a producer the graph pass recognises. These ops compute;
they never update weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_fx.passes.recipe import register_output_alone


@torch.library.custom_op("sonar_fx::grouped_mm", mutates_args=())
def grouped_mm(x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    """out_So[s] = x_Sk[s] @ w_Eok[e].T for the rows s of group e; rows past offs_E[-1] are zero."""
    out_So = x_Sk.new_zeros(x_Sk.shape[0], w_Eok.shape[1])
    for e, (start, end) in enumerate(_bounds(offs_E)):
        if end > start:
            torch.mm(x_Sk[start:end], w_Eok[e].t(), out=out_So[start:end])
    return out_So


@grouped_mm.register_fake
def _grouped_mm_fake(x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    return x_Sk.new_empty(x_Sk.shape[0], w_Eok.shape[1])


@torch.library.custom_op("sonar_fx::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(
    grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor
) -> tuple[Tensor, Tensor]:
    """(dx_Sk, dw_Eok) of `grouped_mm`; dw_Eok comes out contiguous, in the weight's layout."""
    return _input_grad(grad_So, x_Sk, w_Eok, offs_E), _weight_grad(grad_So, x_Sk, w_Eok, offs_E)


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(
    grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x_Sk), torch.empty_like(w_Eok, memory_format=torch.contiguous_format)


@torch.library.custom_op("sonar_fx::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    """`grouped_mm_backward`'s dw_Eok alone, the same arithmetic (`w_Eok` gives its shape): what the
    deferred schedule runs at `step()`, without the input gradient it does not need (as many FLOPs as
    the weight gradient's, and a zero-filled slot-sized tensor)."""
    return _weight_grad(grad_So, x_Sk, w_Eok, offs_E)


@grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_fake(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    return torch.empty_like(w_Eok, memory_format=torch.contiguous_format)


@torch.library.custom_op("sonar_fx::grouped_mm_input_grad", mutates_args=())
def grouped_mm_input_grad(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    """`grouped_mm_backward`'s dx_Sk alone, the same arithmetic (`x_Sk` gives its shape): the backward
    of a weight whose gradient the deferred schedule computes at `step()` instead."""
    return _input_grad(grad_So, x_Sk, w_Eok, offs_E)


@grouped_mm_input_grad.register_fake
def _grouped_mm_input_grad_fake(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    return torch.empty_like(x_Sk)


def _input_grad(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    dx_Sk = torch.zeros_like(x_Sk)
    for e, (start, end) in enumerate(_bounds(offs_E)):
        if end > start:
            torch.mm(grad_So[start:end], w_Eok[e], out=dx_Sk[start:end])
    return dx_Sk


def _weight_grad(grad_So: Tensor, x_Sk: Tensor, w_Eok: Tensor, offs_E: Tensor) -> Tensor:
    dw_Eok = torch.zeros_like(w_Eok, memory_format=torch.contiguous_format)
    for e, (start, end) in enumerate(_bounds(offs_E)):
        if end > start:
            torch.mm(grad_So[start:end].t(), x_Sk[start:end], out=dw_Eok[e])
    return dw_Eok


register_output_alone("sonar_fx.grouped_mm_backward.default", 0, "sonar_fx.grouped_mm_input_grad.default")
register_output_alone("sonar_fx.grouped_mm_backward.default", 1, "sonar_fx.grouped_mm_weight_grad.default")


def _setup_context(ctx, inputs, output) -> None:
    x_Sk, w_Eok, offs_E = inputs
    ctx.save_for_backward(x_Sk, w_Eok, offs_E)


def _backward(ctx, grad_So: Tensor):
    x_Sk, w_Eok, offs_E = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:  # a weight whose gradient is computed elsewhere (the deferred step)
        return grouped_mm_input_grad(grad_So.contiguous(), x_Sk, w_Eok, offs_E), None, None
    dx_Sk, dw_Eok = grouped_mm_backward(grad_So.contiguous(), x_Sk, w_Eok, offs_E)
    return dx_Sk, dw_Eok, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def _bounds(offs_E: Tensor) -> list[tuple[int, int]]:
    ends = offs_E.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))
