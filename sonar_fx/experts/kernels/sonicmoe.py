"""The `sonicmoe` backend: sonic-moe's fused expert kernels behind opaque `torch.library` ops.

Legend: see `base.py`; TK = S routed slots, H = d, I = n (sonic-moe's names). sonic-moe's entry
points wrap its kernels in `autograd.Function`s that assert they are not being compiled, so under
torch.compile its weight gradients never reach a backward graph. Here its functional kernels
(sonic-moe 0.1.2's `sonicmoe.functional`) run inside three ops of our own:
- `sonar_fx::sonicmoe_routing` (routing metadata, no gradient),
- `sonar_fx::sonicmoe_forward(...) -> (out_Td, h_S2n)` (h: the pre-activation sonic-moe saves),
- `sonar_fx::sonicmoe_backward(...) -> (dx_Td, dscores_S, dw_up, dw_down)`, registered as the
  forward's autograd, so the backward graph shows both weight gradients as outputs of one op node
  (`getitem(sonicmoe_backward, 2)` and `3`), which the graph pass finds. sonic-moe's weight-gradient
  kernels write straight into the buffers this op returns: one buffer per weight gradient, no copy.

What sonic-moe computes, read from its sources (sonic-moe 0.1.2.post1 on QuACK 0.4.1):
- dtypes: its GEMMs (QuACK, CUTLASS DSL, sm90) take fp16, bf16 or fp8 operands only; fp32 fails deep
  inside kernel compilation, so fp32 is refused at selection (this adapter routes fp16 and bf16).
- activations: "swiglu" is silu(gate) * up, the same function as `F.silu` (evaluated with fast
  exp/reciprocal instructions); "geglu" is gelu(gate) * up with the TANH APPROXIMATION of GELU
  (`F.gelu(approximate="tanh")`, through `tanh.approx.f32`), which differs from exact erf GELU by up
  to 4.7e-4 per activation. So a model with erf GELU is refused rather than silently changed; only
  layouts whose activation is "silu" or "gelu_tanh" run here.
The package is imported lazily (its pins, torch <= 2.9.1 and Python >= 3.12, do not resolve next to
sonar-fx's torch: `scripts/sonicmoe_env.sh` installs it with --no-deps); Hopper or newer (compute
capability >= 9.0) is required. Weights are passed as sonic-moe's permuted views, never copied.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from sonar_fx.experts.kernels.base import BackendUnavailableError, ExpertLayout, Glu

GLU_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}
"""Layout activation -> sonic-moe activation computing the same function."""
DTYPES = (torch.float16, torch.bfloat16)
INSTALL_HINT = (
    "install it next to this torch with scripts/sonicmoe_env.sh (sonic-moe's own pins, torch<=2.9.1 "
    "and Python>=3.12, do not resolve with sonar-fx's torch; the script installs it with --no-deps)"
)


def functional() -> ModuleType:
    """`sonicmoe.functional`, or a BackendUnavailableError naming how to install it."""
    try:
        return importlib.import_module("sonicmoe.functional")
    except ImportError as err:
        raise BackendUnavailableError(
            "The sonicmoe backend needs the sonic-moe package and a Hopper or Blackwell GPU: "
            f"{INSTALL_HINT}. Import failed: {err}"
        ) from err


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"The sonicmoe backend runs on CUDA GPUs only (model is on {device.type}); use kernel backend "
            "'torch' or 'scattermoe'."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise BackendUnavailableError(
            f"The sonicmoe backend needs compute capability >= 9.0 (Hopper/Blackwell); this GPU has "
            f"{major}.{minor}. Use kernel backend 'scattermoe' or 'torch'."
        )


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise BackendUnavailableError(
            "The sonicmoe backend's GEMMs take fp16 or bf16 weights (sonic-moe's kernels have no fp32 "
            f"path); this model is {dtype}. Cast it (model.to(torch.bfloat16)) or use kernel backend "
            "'scattermoe' or 'torch'."
        )


def check_sonicmoe(device: torch.device, dtype: torch.dtype) -> None:
    functional()
    check_device(device)
    check_dtype(dtype)


def check_layout(layout: ExpertLayout, glu: Glu | None) -> None:
    """sonic-moe fuses its own GLU on (E, out, in) weights with gate/up concatenated or interleaved."""
    if glu is not None:
        raise ValueError(
            "The sonicmoe backend fuses its own SwiGLU/GeGLU and cannot run a model's own gate function "
            "(this model's experts override the gate, or use an activation other than silu, gelu or "
            "gelu_pytorch_tanh). Use kernel backend 'scattermoe' or 'torch'."
        )
    if layout.activation == "gelu":
        raise ValueError(
            "This model's experts use exact (erf) GELU; sonic-moe's GeGLU uses the tanh approximation, a "
            "different function (up to 4.7e-4 apart per activation), so switching would change the model. "
            "Use kernel backend 'scattermoe' or 'torch' (or a model whose hidden_act is gelu_pytorch_tanh)."
        )
    if layout.activation not in GLU_NAMES:
        raise ValueError(
            f"The sonicmoe backend computes SwiGLU or tanh-GeGLU; this model's activation is "
            f"{layout.activation!r}. Use kernel backend 'scattermoe' or 'torch'."
        )
    if layout.transposed or layout.gate_up == "up_first":
        raise ValueError(
            "The sonicmoe backend reads (E, out, in) weights with gate/up concatenated gate-first or "
            f"interleaved; this model stores {layout}. Use kernel backend 'scattermoe' or 'torch'."
        )


@torch.library.custom_op("sonar_fx::sonicmoe_routing", mutates_args=())
def sonicmoe_routing(
    token_S: Tensor, expert_S: Tensor, num_tokens: int, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(expert offsets (E+1), x gather idx, scatter idx, reverse scatter idx, token offsets (T+1))."""
    meta = _new_routing(token_S, num_tokens, num_experts)
    frequency_E = torch.empty(num_experts, dtype=torch.int32, device=token_S.device)
    functional().general_routing_router_metadata_triton(
        token_S, expert_S, num_tokens, num_experts, frequency_E, *meta
    )
    return meta


@sonicmoe_routing.register_fake
def _routing_fake(token_S, expert_S, num_tokens, num_experts):
    return _new_routing(token_S, num_tokens, num_experts)


def _new_routing(
    token_S: Tensor, num_tokens: int, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    def new(n: int) -> Tensor:
        return torch.empty(n, dtype=torch.int32, device=token_S.device)

    s = token_S.shape[0]
    return new(num_experts + 1), new(s), new(s), new(s), new(num_tokens + 1)


@torch.library.custom_op("sonar_fx::sonicmoe_forward", mutates_args=())
def sonicmoe_forward_op(
    x_Td: Tensor, scores_S: Tensor, w_up_E2nd: Tensor, w_down_Edn: Tensor, routing: list[Tensor],
    activation: str, concat_layout: bool, keep_h: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """out_Td and the pre-activation h_S2n that the backward needs (empty when `keep_h` is False)."""
    sm = functional()
    offs, gather, _, reverse, token_offs = routing
    (t, d), s, n = x_Td.shape, gather.shape[0], w_down_Edn.shape[2]
    a_Sn = x_Td.new_empty(s, n)
    h_S2n = x_Td.new_empty(s, 2 * n) if keep_h else None
    sm._up_projection_forward(
        x=x_Td, w1=w_up_E2nd.permute(1, 2, 0), h=h_S2n, a=a_Sn, b1=None, expert_frequency_offset=offs,
        x_gather_idx=gather, activation_type=activation, is_inference_mode_enabled=not keep_h,
        concat_layout=concat_layout,
    )  # fmt: skip
    y_Sd = x_Td.new_empty(s, d)
    sm._down_projection_forward(
        w2=w_down_Edn.permute(1, 2, 0), a=a_Sn, y=y_Sd, b2=None, expert_frequency_offset=offs
    )
    out_Td = x_Td.new_empty(t, d)
    sm._router_forward(
        y=y_Sd, o=out_Td, topk_scores=scores_S, s_reverse_scatter_idx=reverse,
        num_activated_expert_per_token_offset=token_offs, varlen_K_max=w_up_E2nd.shape[0], H=d,
        is_varlen_K=True,
    )  # fmt: skip
    return out_Td, h_S2n if h_S2n is not None else x_Td.new_empty(0, 2 * n)


@sonicmoe_forward_op.register_fake
def _forward_fake(x_Td, scores_S, w_up_E2nd, w_down_Edn, routing, activation, concat_layout, keep_h):
    s, n = routing[1].shape[0], w_down_Edn.shape[2]
    return x_Td.new_empty(x_Td.shape), x_Td.new_empty(s if keep_h else 0, 2 * n)


@torch.library.custom_op("sonar_fx::sonicmoe_backward", mutates_args=())
def sonicmoe_backward(
    dout_Td: Tensor, x_Td: Tensor, scores_S: Tensor, w_up_E2nd: Tensor, w_down_Edn: Tensor, h_S2n: Tensor,
    routing: list[Tensor], activation: str, concat_layout: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dx_Td, dscores_S, dw_up_E2nd, dw_down_Edn); weight gradients in the parameters' layout."""
    sm = functional()
    offs, gather, scatter, reverse, token_offs = routing
    w1, w2 = w_up_E2nd.permute(1, 2, 0), w_down_Edn.permute(1, 2, 0)  # sonic-moe's (2I, H, E), (H, I, E)
    s, n = gather.shape[0], w_down_Edn.shape[2]
    # zeros_like keeps the permuted strides, so permuting back gives contiguous (E, ., .) gradients.
    # Zeros, not empty: a varlen-K grouped GEMM may skip an expert that got no token, and its gradient
    # must then be 0 (a memset of one layer's weights; small next to the GEMMs).
    dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    dh_S2n, a_prime_Sn, ds_S = torch.empty_like(h_S2n), x_Td.new_empty(s, n), torch.empty_like(scores_S)
    sm._down_projection_backward_act(
        dout=dout_Td, h=h_S2n, w2=w2, dh=dh_S2n, ds=ds_S, b2=None, db2=None, a_prime=a_prime_Sn,
        topk_scores=scores_S, expert_frequency_offset=offs, x_gather_idx=gather, s_scatter_idx=scatter,
        activation_type=activation,
    )  # fmt: skip
    sm._down_projection_backward_weight(
        dout=dout_Td, a_prime=a_prime_Sn, dw2=dw2, expert_frequency_offset=offs, x_gather_idx=gather
    )
    dx_Sd = x_Td.new_empty(s, x_Td.shape[1])
    sm._up_projection_backward_act(
        w1=w1, dx_expanded=dx_Sd, dh=dh_S2n, db1=None, expert_frequency_offset=offs, is_glu_activation=True,
        concat_layout=concat_layout,
    )  # fmt: skip
    sm._up_projection_backward_weight(
        x=x_Td, dw1=dw1, dh=dh_S2n, expert_frequency_offset=offs, x_gather_idx=gather, is_glu_activation=True,
        concat_layout=concat_layout,
    )  # fmt: skip
    dx_Td = torch.empty_like(x_Td)
    sm._token_broadcast_backward(
        dx_reduced=dx_Td, dx_expanded=dx_Sd, s_reverse_scatter_idx=reverse,
        num_activated_expert_per_token_offset=token_offs, varlen_K_max=w_up_E2nd.shape[0], H=x_Td.shape[1],
        is_varlen_K=True,
    )  # fmt: skip
    return dx_Td, ds_S, dw1.permute(2, 0, 1), dw2.permute(2, 0, 1)


@sonicmoe_backward.register_fake
def _backward_fake(dout_Td, x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, routing, activation, concat_layout):
    return (
        torch.empty_like(x_Td),
        torch.empty_like(scores_S),
        torch.empty_like(w_up_E2nd, memory_format=torch.contiguous_format),
        torch.empty_like(w_down_Edn, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output) -> None:
    x_Td, scores_S, w_up_E2nd, w_down_Edn, routing, activation, concat_layout, _ = inputs
    ctx.save_for_backward(x_Td, scores_S, w_up_E2nd, w_down_Edn, output[1], *routing)
    ctx.activation, ctx.concat_layout = activation, concat_layout
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout_Td: Tensor, _dh: Tensor | None):
    x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, *routing = ctx.saved_tensors
    if h_S2n.shape[0] == 0:
        raise RuntimeError("sonicmoe: backward through a forward run without gradients (keep_h=False).")
    dx_Td, ds_S, dw_up, dw_down = sonicmoe_backward(
        dout_Td.contiguous(), x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, routing, ctx.activation,
        ctx.concat_layout,
    )  # fmt: skip
    return dx_Td, ds_S, dw_up, dw_down, [None] * len(routing), None, None, None


sonicmoe_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sonicmoe_forward(
    hidden_Td: Tensor,
    index_Tk: Tensor,
    weights_Tk: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    layout: ExpertLayout,
    glu: Glu | None,
) -> Tensor:
    """The expert block on sonic-moe's kernels (gate/up concatenated or interleaved, (E, out, in))."""
    check_layout(layout, glu)
    check_dtype(w_up.dtype)
    t, k = index_Tk.shape
    token_S = torch.arange(t, device=index_Tk.device, dtype=torch.int32).repeat_interleave(k)  # sorted
    routing = sonicmoe_routing(token_S, index_Tk.reshape(-1).to(torch.int32), t, w_up.shape[0])
    scores_S = weights_Tk.reshape(-1).float()  # sonic-moe takes fp32 router scores
    keep_h = torch.is_grad_enabled() and any(
        v.requires_grad for v in (hidden_Td, weights_Tk, w_up, w_down)
    )  # fmt: skip
    out_Td, _ = sonicmoe_forward_op(
        hidden_Td.to(w_up.dtype), scores_S, w_up, w_down, list(routing), GLU_NAMES[layout.activation],
        layout.gate_up == "gate_first", keep_h,
    )  # fmt: skip
    return out_Td.to(hidden_Td.dtype)
