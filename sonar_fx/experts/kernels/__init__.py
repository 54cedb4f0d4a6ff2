"""Expert kernel backends: one interface over the torch reference, ScatterMoE and SonicMoE.

    out_Td = experts_forward("scattermoe", hidden_Td, top_k_index_Tk, top_k_weights_Tk,
                             model_layer.gate_up_proj, model_layer.down_proj, layout=ExpertLayout())
    use_kernel_backend(model, "scattermoe")   # per model: transformers' experts hook, or the reference model

Every backend computes with the model's own expert parameters (no copies, no updates), and puts its
weight gradient in a backward graph as one custom-op node, so Sonar's graph pass can update the
weight in backward under torch.compile. Backends that need an optional package import it lazily
and fail with the pip extra to install: nothing here imports sonic-moe, or needs triton, until a backend
that uses it runs.
"""

from sonar_fx.experts.kernels.base import (
    HF_LAYOUT,
    BackendUnavailableError,
    ExpertLayout,
    KernelBackend,
)
from sonar_fx.experts.kernels.registry import (
    BACKENDS,
    experts_forward,
    get_backend,
    kernel_backend_of,
    register_hf_backends,
    use_kernel_backend,
)

__all__ = [
    "BACKENDS",
    "HF_LAYOUT",
    "BackendUnavailableError",
    "ExpertLayout",
    "KernelBackend",
    "experts_forward",
    "get_backend",
    "kernel_backend_of",
    "register_hf_backends",
    "use_kernel_backend",
]
