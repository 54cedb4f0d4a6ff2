"""A plain-torch stand-in for `sonicmoe.functional` (sonic-moe 0.1.2's kernel signatures) for CPU tests.

It lets the CPU suite check the sonicmoe adapter's plumbing (custom ops, autograd wiring, weight
permutes, gradients in the backward graph) where the real package cannot install. The routing
metadata follow one self-consistent convention, and the saved pre-activation h is kept interleaved
whatever the weight layout: the adapter must treat both as opaque and only pass them between kernels.
Like the real kernels (QuACK GEMMs on sm90), the GEMMs take fp16/bf16 operands only, "swiglu" is
silu(gate) * up and "geglu" uses the tanh approximation of GELU.
Legend: TK routed slots in expert order (position p), T tokens, H width, I expert width, E experts.
"""

from __future__ import annotations

import itertools
import sys
import types

import torch
import torch.nn.functional as F
from torch import Tensor


def _ranges(offs: Tensor):
    ends = offs.tolist()
    return [(e, a, b) for e, (a, b) in enumerate(itertools.pairwise(ends)) if b > a]


def _gemm_operands(*tensors: Tensor) -> None:
    """The real GEMMs reject fp32 deep inside kernel compilation; the stub fails as plainly."""
    for t in tensors:
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"a_dtype should be float16 or float8 (stub of QuACK's sm90 GEMM; got {t.dtype})")


def _glu(h_S2I: Tensor, activation: str) -> Tensor:
    gate, up = h_S2I[:, 0::2], h_S2I[:, 1::2]
    return (F.silu(gate) if activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up


def _glu_backward(h_S2I: Tensor, da_SI: Tensor, activation: str) -> Tensor:
    # Analytic: autograd is off inside the custom ops that call these kernels.
    gate, up = h_S2I[:, 0::2], h_S2I[:, 1::2]
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        act, dact = gate * sig, sig * (1 + gate * (1 - sig))
    else:  # gelu(x) = x/2 (1 + tanh(z)), z = c (x + 0.044715 x^3)
        c = (2 / torch.pi) ** 0.5
        tanh_z = torch.tanh(c * (gate + 0.044715 * gate**3))
        act = 0.5 * gate * (1 + tanh_z)
        dact = 0.5 * (1 + tanh_z) + 0.5 * gate * (1 - tanh_z**2) * c * (1 + 3 * 0.044715 * gate**2)
    return torch.stack([da_SI * up * dact, da_SI * act], dim=-1).flatten(1)


def _interleave(w_order_S2I: Tensor, concat: bool) -> Tensor:
    return torch.stack(w_order_S2I.chunk(2, dim=-1), dim=-1).flatten(1) if concat else w_order_S2I


def _weight_order(h_S2I: Tensor, concat: bool) -> Tensor:
    return torch.cat([h_S2I[:, 0::2], h_S2I[:, 1::2]], dim=-1) if concat else h_S2I


def general_routing_router_metadata_triton(
    sorted_selected_T, selected_E, T, E, expert_frequency, expert_frequency_offset, x_gather_idx,
    s_scatter_idx, s_reverse_scatter_idx, num_activated_expert_per_token_offset,
):  # fmt: skip
    _, order = torch.sort(selected_E.long(), stable=True)
    counts = torch.bincount(selected_E.long(), minlength=E)
    expert_frequency.copy_(counts)
    expert_frequency_offset.copy_(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
    s_scatter_idx.copy_(order)
    x_gather_idx.copy_(sorted_selected_T[order])
    s_reverse_scatter_idx[order] = torch.arange(order.numel(), dtype=torch.int32)
    per_token = torch.bincount(sorted_selected_T.long(), minlength=T)
    num_activated_expert_per_token_offset.copy_(torch.cat([per_token.new_zeros(1), per_token.cumsum(0)]))


def _up_projection_forward(
    x, w1, h, a, b1, expert_frequency_offset, x_gather_idx, activation_type,
    is_inference_mode_enabled=False, concat_layout=False,
):  # fmt: skip
    assert w1.shape[2] == expert_frequency_offset.numel() - 1, "w1 must be (2I, H, E)"
    assert activation_type in ("swiglu", "geglu"), activation_type
    _gemm_operands(x, w1)
    pre = torch.empty(x_gather_idx.numel(), w1.shape[0], dtype=x.dtype)
    for e, lo, hi in _ranges(expert_frequency_offset):
        pre[lo:hi] = x[x_gather_idx[lo:hi].long()] @ w1[:, :, e].T
    pre = _interleave(pre, concat_layout)
    a.copy_(_glu(pre, activation_type))
    if h is not None:
        h.copy_(pre)


def _down_projection_forward(w2, a, y, b2, expert_frequency_offset):
    _gemm_operands(w2, a)
    for e, lo, hi in _ranges(expert_frequency_offset):
        y[lo:hi] = a[lo:hi] @ w2[:, :, e].T


def _router_forward(
    y,
    o,
    topk_scores,
    s_reverse_scatter_idx,
    num_activated_expert_per_token_offset,
    varlen_K_max,
    H,
    is_varlen_K,
):
    contrib = y[s_reverse_scatter_idx.long()] * topk_scores.unsqueeze(-1).to(y.dtype)  # token-major
    token = torch.repeat_interleave(torch.diff(num_activated_expert_per_token_offset.long()))
    o.zero_().index_add_(0, token, contrib)


def _down_projection_backward_act(
    dout, h, w2, dh, ds, b2, db2, a_prime, topk_scores, expert_frequency_offset, x_gather_idx,
    s_scatter_idx, activation_type,
):  # fmt: skip
    _gemm_operands(dout, w2)
    s = topk_scores[s_scatter_idx.long()].unsqueeze(-1)
    da = torch.empty(h.shape[0], w2.shape[1], dtype=h.dtype)
    for e, lo, hi in _ranges(expert_frequency_offset):
        da[lo:hi] = dout[x_gather_idx[lo:hi].long()] @ w2[:, :, e]
    a = _glu(h, activation_type)
    dh.copy_(_glu_backward(h, da * s, activation_type))
    a_prime.copy_(a * s)
    ds[s_scatter_idx.long()] = (da * a).sum(-1).to(ds.dtype)


def _down_projection_backward_weight(dout, a_prime, dw2, expert_frequency_offset, x_gather_idx):
    for e, lo, hi in _ranges(expert_frequency_offset):
        dw2[:, :, e] = dout[x_gather_idx[lo:hi].long()].T @ a_prime[lo:hi]


def _up_projection_backward_act(
    w1, dx_expanded, dh, db1, expert_frequency_offset, is_glu_activation, concat_layout=False
):
    for e, lo, hi in _ranges(expert_frequency_offset):
        dx_expanded[lo:hi] = _weight_order(dh[lo:hi], concat_layout) @ w1[:, :, e]


def _up_projection_backward_weight(
    x, dw1, dh, expert_frequency_offset, x_gather_idx, is_glu_activation, concat_layout=False
):
    for e, lo, hi in _ranges(expert_frequency_offset):
        dw1[:, :, e] = _weight_order(dh[lo:hi], concat_layout).T @ x[x_gather_idx[lo:hi].long()]


def _token_broadcast_backward(
    dx_reduced, dx_expanded, s_reverse_scatter_idx, num_activated_expert_per_token_offset, varlen_K_max, H,
    is_varlen_K,
):  # fmt: skip
    token = torch.repeat_interleave(torch.diff(num_activated_expert_per_token_offset.long()))
    dx_reduced.zero_().index_add_(0, token, dx_expanded[s_reverse_scatter_idx.long()])


KERNELS = (
    general_routing_router_metadata_triton,
    _up_projection_forward,
    _down_projection_forward,
    _router_forward,
    _down_projection_backward_act,
    _down_projection_backward_weight,
    _up_projection_backward_act,
    _up_projection_backward_weight,
    _token_broadcast_backward,
)


def install(monkeypatch) -> None:
    """Make `import sonicmoe.functional` return this stub for the duration of a test."""
    functional = types.ModuleType("sonicmoe.functional")
    for fn in KERNELS:
        setattr(functional, fn.__name__, fn)
    package = types.ModuleType("sonicmoe")
    package.functional = functional  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sonicmoe", package)
    monkeypatch.setitem(sys.modules, "sonicmoe.functional", functional)
