"""Which dense tensors are hidden matrices: the split an optimizer that treats matrices apart makes.

The usual Muon recipe updates the 2-D weights of hidden layers with Muon and every other tensor with
AdamW. A trainable dense (non-expert) parameter is a hidden matrix when it is 2-D and none of:
- an embedding: a weight of an `nn.Embedding`, or of the model's `get_input_embeddings()`;
- the output head: the model's `get_output_embeddings()`, or, for a model without that method, an
  `nn.Linear` whose output width is an embedding's vocabulary (the logits layer), tied or not;
- a router: a 2-D weight with E rows inside an MoE block (the module that owns an experts module of E
  experts; E also any expert count the experts module declares, e.g. the global count of an
  expert-parallel module that holds E/world of them), outside the experts module itself:
  `mlp.gate.weight` (OLMoE, Qwen3-MoE, Mixtral), `block_sparse_moe.router.layer.weight` (GraniteMoE),
  `mlp.router.weight` (the reference model).
  Routers take AdamW unless `MuonConfig.routers="muon"`: they score experts against each other through
  a softmax, which is not a hidden linear map (recipes differ: Megatron-LM applies Muon unless told
  to skip routers; this default follows the AdamW-for-routers recipe).
Norms, biases, convolution kernels and every tensor that is not 2-D are not matrices. Expert tensors
are decided by discovery, never here. Never: change a module or a parameter; this module only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import nn

from sonar_fx.config import MuonConfig, OptimizerConfig
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.experts.structure import declared_counts

Role = Literal["matrix", "router", "embedding", "head", "other"]


def dense_roles(model: nn.Module, layers: Sequence[ExpertLayer]) -> dict[str, Role]:
    """Each dense parameter's role (see the module docstring), by name; expert tensors are left out."""
    experts = {id(t.param) for layer in layers for t in layer.tensors}
    special: dict[int, Role] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            special[id(module.weight)] = "embedding"
    getters: tuple[tuple[str, Role], ...] = (
        ("get_input_embeddings", "embedding"),
        ("get_output_embeddings", "head"),
    )
    for getter, role in getters:
        found = _module_from(model, getter)
        for p in found.parameters() if found is not None else ():
            special.setdefault(id(p), role)
    if _module_from(model, "get_output_embeddings") is None:
        vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features in vocab:
                special.setdefault(id(module.weight), "head")
    for p in _routers(model, layers):
        special.setdefault(id(p), "router")
    roles: dict[str, Role] = {}
    for name, p in model.named_parameters():
        if id(p) not in experts:
            roles[name] = special.get(id(p), "matrix" if p.dim() == 2 else "other")
    return roles


def matrix_params(
    cfg: OptimizerConfig, model: nn.Module, layers: Sequence[ExpertLayer]
) -> list[nn.Parameter]:
    """The trainable dense parameters `cfg` updates as matrices, in model order: the hidden matrices
    (and the routers with `routers="muon"`) for MuonConfig; none for an element-wise optimizer."""
    if not isinstance(cfg, MuonConfig):
        return []
    chosen = {"matrix", "router"} if cfg.routers == "muon" else {"matrix"}
    roles = dense_roles(model, layers)
    return [p for name, p in model.named_parameters() if p.requires_grad and roles.get(name) in chosen]


def _module_from(model: nn.Module, getter: str) -> nn.Module | None:
    method = getattr(model, getter, None)
    if not callable(method):
        return None
    try:
        module = method()
    except (AttributeError, NotImplementedError):  # transformers' base class for a model without one
        return None
    return module if isinstance(module, nn.Module) else None


def _routers(model: nn.Module, layers: Sequence[ExpertLayer]) -> list[nn.Parameter]:
    found = []
    for layer in layers:
        block_name, _, experts_name = layer.name.rpartition(".")
        if not experts_name:
            continue  # experts at the root: no block around them
        block = model.get_submodule(block_name)
        counts = declared_counts(block.get_submodule(experts_name)) | {layer.num_experts}
        for name, p in block.named_parameters():
            inside_experts = name.startswith(f"{experts_name}.")
            if not inside_experts and p.dim() == 2 and p.shape[0] in counts:
                found.append(p)
    return found
