"""The kernel-backend registry, `experts_forward`, and per-model selection (`use_kernel_backend`).

A backend is chosen per model, never through the optimizer config: for transformers models through
their experts-implementation hook (each backend is registered in `ALL_EXPERTS_FUNCTIONS` as
"sonar_<name>" and `set_experts_implementation` selects it), for the project's reference model
through its experts modules. The expert weights stay the model's own parameters. Selection checks
that the backend can run on the model's device and dtype and compute every experts module's layout
and activation, so a missing package, an unsupported dtype or an activation the kernels would change
fails at once with the fix in the message, before the model is changed, rather than in the first
forward. Selection never changes any other model, class or module.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor, nn

from sonar_fx.experts.kernels.base import (
    HF_LAYOUT,
    Activation,
    ExpertLayout,
    Glu,
    KernelBackend,
    check_shapes,
)
from sonar_fx.experts.kernels.scattermoe import check_scattermoe, scattermoe_forward
from sonar_fx.experts.kernels.sonicmoe import check_layout as check_sonicmoe_layout
from sonar_fx.experts.kernels.sonicmoe import check_sonicmoe, sonicmoe_forward
from sonar_fx.experts.kernels.torch_backend import check_torch, torch_forward
from sonar_fx.experts.structure import is_transformers_experts

BACKENDS: dict[str, KernelBackend] = {
    "torch": KernelBackend(
        "torch",
        "reference: sort + grouped GEMM (sonar_fx::grouped_mm); CPU and GPU, fp32 and bf16",
        torch_forward,
        check_torch,
        ("sonar_fx::grouped_mm_backward",),
    ),
    "scattermoe": KernelBackend(
        "scattermoe",
        "ScatterMoE scatter-to-scatter Triton GEMMs (own kernels, or the scattermoe package if installed)",
        scattermoe_forward,
        check_scattermoe,
        ("sonar_fx::scatter_group_xty",),
    ),
    "sonicmoe": KernelBackend(
        "sonicmoe",
        "sonic-moe fused kernels (package sonic-moe; Hopper/Blackwell GPUs; fp16/bf16; SwiGLU, tanh-GeGLU)",
        sonicmoe_forward,
        check_sonicmoe,
        ("sonar_fx::sonicmoe_up_weight_grad", "sonar_fx::sonicmoe_down_weight_grad"),
        check_sonicmoe_layout,
    ),
}
HF_PREFIX = "sonar_"
HF_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
"""transformers `hidden_act` names whose function IS the layout activation's torch op (`ACT2FN`); any
other name (gelu_new, gelu_fast, quick_gelu, ...) runs the model's own gate function as given."""


def get_backend(name: str) -> KernelBackend:
    """The backend called `name`; a ValueError lists the choices."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown expert kernel backend {name!r}: choose one of {', '.join(BACKENDS)}.")
    return BACKENDS[name]


def experts_forward(
    backend: str,
    hidden_Td: Tensor,
    top_k_index_Tk: Tensor,
    top_k_weights_Tk: Tensor,
    w_up_E2nd: Tensor,
    w_down_Edn: Tensor,
    *,
    layout: ExpertLayout = HF_LAYOUT,
    glu: Glu | None = None,
) -> Tensor:
    """out_Td of E gated experts with kernel `backend` (legend in `base.py`).

    w_up_E2nd (E, 2n, d) and w_down_Edn (E, d, n) are the model's parameters, or (E, d, 2n) and
    (E, n, d) with `layout.transposed`. `glu` overrides the layout's activation (a model's own gate
    function, e.g. a clamped SwiGLU); it receives the (S, 2n) up-projection in the weight's row order.
    """
    spec = get_backend(backend)
    check_shapes(hidden_Td, top_k_index_Tk, top_k_weights_Tk, w_up_E2nd, w_down_Edn)
    return spec.forward(hidden_Td, top_k_index_Tk, top_k_weights_Tk, w_up_E2nd, w_down_Edn, layout, glu)


def use_kernel_backend(model: nn.Module, name: str, *, check_device: bool = True) -> nn.Module:
    """Make `model` compute its experts with backend `name`; returns the model (changed in place).
    `check_device=False` skips the check that the backend runs where the model lives (package, device,
    dtype): for `sonar_fx.plan`, whose fake CPU model stands for a GPU one; the layouts are checked."""
    spec = get_backend(name)
    if check_device:
        param = next(model.parameters())
        spec.check(param.device, param.dtype)
    for layout, glu in expert_layouts(model):
        spec.check_layout(layout, glu)
    if hasattr(model, "set_experts_implementation"):
        hf_model: Any = model
        register_hf_backends()
        hf_model.set_experts_implementation(HF_PREFIX + name)
        if hf_model.config._experts_implementation != HF_PREFIX + name:
            raise ValueError(
                f"{type(model).__name__} does not let transformers switch its experts implementation "
                "(its experts class lacks @use_experts_implementation); call experts_forward in its forward."
            )
        return model
    experts = _kernel_modules(model)
    if not experts:
        raise ValueError(
            f"{type(model).__name__} has no experts module that selects a kernel backend (transformers MoE "
            "models and sonar_fx's reference model have one); call kernels.experts_forward in its forward."
        )
    for module in experts:
        module.kernel = name
    return model


def expert_layouts(model: nn.Module) -> list[tuple[ExpertLayout, Glu | None]]:
    """(layout, own gate function) of every experts module the backend would compute."""
    if hasattr(model, "set_experts_implementation"):
        return [hf_layout(m) for m in model.modules() if is_transformers_experts(m)]
    return [(HF_LAYOUT, None) for _ in _kernel_modules(model)]


def _kernel_modules(model: nn.Module) -> list[Any]:
    """Experts modules that pick their backend themselves (the reference model's `ReferenceExperts`)."""
    return [m for m in model.modules() if hasattr(m, "kernel") and hasattr(m, "gate_up_proj")]


def register_hf_backends() -> None:
    """Register every backend in transformers' `ALL_EXPERTS_FUNCTIONS` as "sonar_<name>" (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name in BACKENDS:
        if HF_PREFIX + name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(HF_PREFIX + name, _hf_experts_function(name))


def _hf_experts_function(name: str):
    def sonar_experts_forward(
        self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
    ) -> Tensor:
        layout, glu = hf_layout(self)
        return experts_forward(
            name, hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
            layout=layout, glu=glu,
        )  # fmt: skip

    sonar_experts_forward.__name__ = f"sonar_{name}_experts_forward"
    return sonar_experts_forward


def hf_layout(module: Any) -> tuple[ExpertLayout, Glu | None]:
    """The layout of a transformers experts module, and its own gate function when it has one.

    transformers' default gate, act_fn(gate) * up on [gate; up], is the layout's own GLU (the same ops);
    any other gate (an override, an activation outside silu/gelu/relu) is returned to run as is. Biases,
    ungated experts and post-expert norms are not supported by these kernels and fail loudly here.
    """
    unsupported = [f for f in ("has_bias", "has_post_expert_norm") if getattr(module, f, False)]
    if unsupported or not getattr(module, "has_gate", True):
        raise ValueError(
            f"{type(module).__name__}: sonar_fx expert kernels support gated experts without biases or "
            f"post-expert norms (found {unsupported or ['has_gate=False']}); use its experts implementation "
            "'grouped_mm' instead."
        )
    interleaved = not getattr(module, "is_concatenated", True)
    layout = ExpertLayout(
        gate_up="interleaved" if interleaved else "gate_first",
        transposed=bool(getattr(module, "is_transposed", False)),
    )
    from transformers.integrations.moe import _default_apply_gate

    act = _layout_activation(module)
    default_gate = getattr(type(module), "_apply_gate", None) is _default_apply_gate
    if default_gate and act is not None and not interleaved:
        return replace(layout, activation=act), None
    return layout, module._apply_gate


def _layout_activation(module: Any) -> Activation | None:
    """The layout activation computing the module's own `act_fn`, or None when it is another function.

    Read from `config.hidden_act` and confirmed on the module: its `act_fn` must be the very class
    transformers builds for that name (a module that swapped its activation keeps its own gate).
    """
    from transformers.activations import ACT2CLS

    name = str(getattr(getattr(module, "config", None), "hidden_act", "")).lower()
    built = ACT2CLS.get(name)
    cls = built[0] if isinstance(built, tuple) else built
    if name not in HF_ACTIVATIONS or cls is None or type(getattr(module, "act_fn", None)) is not cls:
        return None
    return HF_ACTIVATIONS[name]


def kernel_backend_of(model: nn.Module) -> str:
    """The backend a model computes its experts with ("default" for a transformers implementation)."""
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if isinstance(impl, str):
        return impl[len(HF_PREFIX) :] if impl.startswith(HF_PREFIX) else "default"
    kernels = {str(m.kernel) for m in _kernel_modules(model)}
    return kernels.pop() if len(kernels) == 1 else "torch"
