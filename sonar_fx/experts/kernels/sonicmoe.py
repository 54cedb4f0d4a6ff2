"""The `sonicmoe` backend: sonic-moe's fused expert kernels behind opaque `torch.library` ops.

Legend: see `base.py`; TK = S routed slots, H = d, I = n (sonic-moe's names). sonic-moe's entry
points wrap its kernels in `autograd.Function`s that assert they are not being compiled, so under
torch.compile its weight gradients never reach a backward graph. Here its functional kernels
(sonic-moe 0.1.2's `sonicmoe.functional`) run inside three ops of our own:
- `sonar_fx::sonicmoe_routing` (routing metadata, no gradient),
- `sonar_fx::sonicmoe_forward(...) -> (out_Td, h_S2n)` (h: the pre-activation sonic-moe saves),
- the forward's autograd, three ops: `sonar_fx::sonicmoe_backward_act(...) -> (dx_Td, dscores_S,
  dh_S2n, a_prime_Sn)` (everything but the weight GEMMs), then one op per weight gradient,
  `sonar_fx::sonicmoe_down_weight_grad(dout_Td, a_prime_Sn, offsets, gather, E) -> dw_down` and
  `sonar_fx::sonicmoe_up_weight_grad(x_Td, dh_S2n, offsets, gather, E, concat) -> dw_up`: the nodes
  the graph pass finds. sonic-moe's weight-gradient kernels write straight into the buffers these ops
  return: one buffer per weight gradient, in the parameter's layout, no copy. One op per weight
  gradient lets the deferred schedule keep just its GEMM's operands and re-run just that GEMM at
  `step()` (a recipe of one fused backward would re-run the input gradients too, and keep h); eager,
  the backward hands them to the weight's owner instead of calling the op (`deferral.py`). The
  kernels are the same calls on the same buffers as in one fused op: the arithmetic is unchanged.

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
from sonar_fx.experts.kernels.deferral import defer_weight_grad

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


@torch.library.custom_op("sonar_fx::sonicmoe_backward_act", mutates_args=())
def sonicmoe_backward_act(
    dout_Td: Tensor, x_Td: Tensor, scores_S: Tensor, w_up_E2nd: Tensor, w_down_Edn: Tensor, h_S2n: Tensor,
    routing: list[Tensor], activation: str, concat_layout: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dx_Td, dscores_S, dh_S2n, a_prime_Sn): the backward but its weight GEMMs, which read dh_S2n and
    a_prime_Sn (`sonicmoe_up_weight_grad`, `sonicmoe_down_weight_grad`)."""
    sm = functional()
    offs, gather, scatter, reverse, token_offs = routing
    w1, w2 = w_up_E2nd.permute(1, 2, 0), w_down_Edn.permute(1, 2, 0)  # sonic-moe's (2I, H, E), (H, I, E)
    s, n = gather.shape[0], w_down_Edn.shape[2]
    dh_S2n, a_prime_Sn, ds_S = torch.empty_like(h_S2n), x_Td.new_empty(s, n), torch.empty_like(scores_S)
    sm._down_projection_backward_act(
        dout=dout_Td, h=h_S2n, w2=w2, dh=dh_S2n, ds=ds_S, b2=None, db2=None, a_prime=a_prime_Sn,
        topk_scores=scores_S, expert_frequency_offset=offs, x_gather_idx=gather, s_scatter_idx=scatter,
        activation_type=activation,
    )  # fmt: skip
    dx_Sd = x_Td.new_empty(s, x_Td.shape[1])
    sm._up_projection_backward_act(
        w1=w1, dx_expanded=dx_Sd, dh=dh_S2n, db1=None, expert_frequency_offset=offs, is_glu_activation=True,
        concat_layout=concat_layout,
    )  # fmt: skip
    dx_Td = torch.empty_like(x_Td)
    sm._token_broadcast_backward(
        dx_reduced=dx_Td, dx_expanded=dx_Sd, s_reverse_scatter_idx=reverse,
        num_activated_expert_per_token_offset=token_offs, varlen_K_max=w_up_E2nd.shape[0], H=x_Td.shape[1],
        is_varlen_K=True,
    )  # fmt: skip
    return dx_Td, ds_S, dh_S2n, a_prime_Sn


@sonicmoe_backward_act.register_fake
def _backward_act_fake(
    dout_Td, x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, routing, activation, concat_layout
):
    s, n = routing[1].shape[0], w_down_Edn.shape[2]
    return torch.empty_like(x_Td), torch.empty_like(scores_S), torch.empty_like(h_S2n), x_Td.new_empty(s, n)


# The weight gradients, one op each, so that a deferred step re-runs one weight GEMM and nothing else.
# Zeros, not empty: a varlen-K grouped GEMM may skip an expert that got no token, and its gradient must
# then be 0 (a memset of one weight; small next to the GEMM). Allocated in the parameter's layout
# (E, out, in) and handed to sonic-moe permuted to its (out, in, E): the gradient needs no copy.
@torch.library.custom_op("sonar_fx::sonicmoe_up_weight_grad", mutates_args=())
def sonicmoe_up_weight_grad(
    x_Td: Tensor, dh_S2n: Tensor, expert_offsets: Tensor, x_gather: Tensor, num_experts: int,
    concat_layout: bool,
) -> Tensor:  # fmt: skip
    """dw_up_E2nd from the expert input and the pre-activation's gradient (sonic-moe's dw1)."""
    dw_E2nd = _new_dw_up(x_Td, dh_S2n, num_experts).zero_()
    functional()._up_projection_backward_weight(
        x=x_Td, dw1=dw_E2nd.permute(1, 2, 0), dh=dh_S2n, expert_frequency_offset=expert_offsets,
        x_gather_idx=x_gather, is_glu_activation=True, concat_layout=concat_layout,
    )  # fmt: skip
    return dw_E2nd


@sonicmoe_up_weight_grad.register_fake
def _up_weight_grad_fake(x_Td, dh_S2n, expert_offsets, x_gather, num_experts, concat_layout):
    return _new_dw_up(x_Td, dh_S2n, num_experts)


def _new_dw_up(x_Td: Tensor, dh_S2n: Tensor, num_experts: int) -> Tensor:
    return x_Td.new_empty(num_experts, dh_S2n.shape[1], x_Td.shape[1])


@torch.library.custom_op("sonar_fx::sonicmoe_down_weight_grad", mutates_args=())
def sonicmoe_down_weight_grad(
    dout_Td: Tensor, a_prime_Sn: Tensor, expert_offsets: Tensor, x_gather: Tensor, num_experts: int
) -> Tensor:
    """dw_down_Edn from the output's gradient and the score-weighted activation (sonic-moe's dw2)."""
    dw_Edn = _new_dw_down(dout_Td, a_prime_Sn, num_experts).zero_()
    functional()._down_projection_backward_weight(
        dout=dout_Td, a_prime=a_prime_Sn, dw2=dw_Edn.permute(1, 2, 0), expert_frequency_offset=expert_offsets,
        x_gather_idx=x_gather,
    )  # fmt: skip
    return dw_Edn


@sonicmoe_down_weight_grad.register_fake
def _down_weight_grad_fake(dout_Td, a_prime_Sn, expert_offsets, x_gather, num_experts):
    return _new_dw_down(dout_Td, a_prime_Sn, num_experts)


def _new_dw_down(dout_Td: Tensor, a_prime_Sn: Tensor, num_experts: int) -> Tensor:
    return dout_Td.new_empty(num_experts, dout_Td.shape[1], a_prime_Sn.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x_Td, scores_S, w_up_E2nd, w_down_Edn, routing, activation, concat_layout, _ = inputs
    ctx.save_for_backward(x_Td, scores_S, w_up_E2nd, w_down_Edn, output[1], *routing)
    ctx.activation, ctx.concat_layout = activation, concat_layout
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout_Td: Tensor, _dh: Tensor | None):
    x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, *routing = ctx.saved_tensors
    if h_S2n.shape[0] == 0:
        raise RuntimeError("sonicmoe: backward through a forward run without gradients (keep_h=False).")
    dout_Td = dout_Td.contiguous()
    dx_Td, ds_S, dh_S2n, a_prime_Sn = sonicmoe_backward_act(
        dout_Td, x_Td, scores_S, w_up_E2nd, w_down_Edn, h_S2n, routing, ctx.activation, ctx.concat_layout
    )
    offs, gather, num_experts = routing[0], routing[1], w_up_E2nd.shape[0]
    dw_up = dw_down = None
    # schedule="deferred": the owner keeps each weight GEMM's operands and runs its op at step() instead.
    if ctx.needs_input_grad[3]:
        down_args = (dout_Td, a_prime_Sn, offs, gather, num_experts)
        if not defer_weight_grad(w_down_Edn, torch.ops.sonar_fx.sonicmoe_down_weight_grad.default, down_args):
            dw_down = sonicmoe_down_weight_grad(*down_args)
    if ctx.needs_input_grad[2]:
        up_args = (x_Td, dh_S2n, offs, gather, num_experts, ctx.concat_layout)
        if not defer_weight_grad(w_up_E2nd, torch.ops.sonar_fx.sonicmoe_up_weight_grad.default, up_args):
            dw_up = sonicmoe_up_weight_grad(*up_args)
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
