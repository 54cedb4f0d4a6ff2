"""Tiny MoE models by name, built with `from_config`, and real checkpoints from a local path.

The tiny configs keep each architecture's real classes (so its real expert layout and backward graph)
at a size that trains on two CPU cores; their vocabulary fits the built-in byte tokenizer (259 ids).
Nothing here downloads: a real checkpoint must be a local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx.models.reference import ReferenceMoEConfig, ReferenceMoEModel

BYTE_VOCAB = 259  # 256 bytes + pad, bos, eos
_SPECIAL_IDS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258)
_SHARED: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    **_SPECIAL_IDS,
)

# name -> (transformers config class name, extra config fields)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "tiny-granitemoe": ("GraniteMoeConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "tiny-mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "tiny-qwen3moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    ),
    "tiny-reference": ("ReferenceMoEConfig", {}),
}


def build_model(
    name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> nn.Module:
    """A tiny model by name (`TINY_MODELS`), or a real checkpoint from a local directory."""
    torch.manual_seed(seed)
    if name == "tiny-reference":
        fields = {k: v for k, v in overrides.items() if k in ReferenceMoEConfig.__dataclass_fields__}
        return ReferenceMoEModel(ReferenceMoEConfig(**fields)).to(dtype)
    if name in TINY_MODELS:
        import transformers

        return transformers.AutoModelForCausalLM.from_config(tiny_config(name, **overrides), dtype=dtype)
    path = Path(name)
    if path.is_dir():
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    raise ValueError(
        f"Unknown model {name!r}: use one of {', '.join(TINY_MODELS)} or a local checkpoint directory."
    )


def tiny_config(name: str, **overrides: Any) -> Any:
    """The transformers config of the tiny model `name` (a `TINY_MODELS` entry other than
    tiny-reference), with `overrides` applied."""
    import transformers

    cls_name, extra = TINY_MODELS[name]
    return getattr(transformers, cls_name)(**{**_SHARED, **extra, **overrides})


def enable_activation_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None = None) -> bool:
    """Turn on transformers' activation (gradient) checkpointing, passing `kwargs` (e.g.
    `{"use_reentrant": True}`; None keeps transformers' defaults); False if `model` has none.

    transformers 5.24 calls it `activation_checkpointing_enable` and deprecates the old name; 5.17 (the
    GPU image's) and 5.18 have only `gradient_checkpointing_enable`."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        return False
    if kwargs is None:
        enable()
    else:
        enable(kwargs)
    return True
