"""Tiny configs of every Mixture-of-Experts causal LM in the installed transformers.

For: the families table (`python -m tests.families`), the family tests and `sonar-fx inspect
--model hf:<model_type>`. The MoE model types are found, not listed: every causal-LM model type in
transformers' auto mappings whose default config has an expert-count field. Each tiny config keeps
the family's real classes (so its real expert layout and backward graph) at a size that trains on two
CPU cores; a family-specific entry in `_FAMILY_FIELDS` only fixes what the generic shrink cannot
(layer-type lists, divisibility rules). Nothing here downloads, trains or touches Sonar.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

MAX_TINY_PARAMS = 20_000_000
"""A tiny config above this many parameters is refused before it is materialised."""
BYTE_VOCAB = 259  # the built-in byte tokenizer: 256 bytes + pad, bos, eos
EXPERT_COUNT_FIELDS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
)
"""Config fields holding the number of routed experts (what marks a config as MoE here)."""

# Generic shrink: each field a config has gets the small value (unless None means "off" there).
_SMALL: dict[str, Any] = {
    "vocab_size": BYTE_VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "intermediate_size_mlp": 64,
    "shared_intermediate_size": 32,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "num_hidden_layers": 2,
    "n_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 32,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 0,
    "max_position_embeddings": 512,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_dt_rank": 8,
    "n_groups": 1,
    "chunk_size": 16,
    "mamba_chunk_size": 16,
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "interleave_moe_layer_step": 1,
    "num_nextn_predict_layers": 0,
    "moe_jitter_eps": 0.0,
    "router_jitter_noise": 0.0,
}
_NONE_MEANS_OFF = frozenset({"q_lora_rank", "n_group", "topk_group", "num_expert_group"})
"""Fields whose None default switches a feature off (the shrink leaves them None)."""
_SPECIAL_IDS = {"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258}

# Per model type: fields the generic shrink cannot infer (hybrid layer patterns, nested configs).
_LINEAR_THEN_FULL = {"layer_types": ["linear_attention", "full_attention"]}
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "bailing_hybrid": _LINEAR_THEN_FULL,
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2, "moe_jitter_eps": 0.0},
    },
    "doge": {"is_moe": True},
    "flint": {"mlp_only_layers": []},
    "gemma4_text": {
        "enable_moe_block": True,
        "vocab_size_per_layer_input": BYTE_VOCAB,
        "hidden_size_per_layer_input": 16,
        "per_layer_config": {},
    },
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "use_mamba_kernels": False,
    },
    "kimi_linear": _LINEAR_THEN_FULL,
    "kolibri1_1": {
        # Its defaults give the first two layers a dense MLP (no experts in two layers) and score keys with
        # 12 query heads (more than the 2 per key head of the shrink); one sliding, one indexed layer.
        "mlp_only_layers": [],
        "index_num_heads": 2,
        "layer_types": ["sliding_attention", "indexed_attention"],
    },
    "longcat_flash": {"zero_expert_num": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "qwen3_5_moe_text": _LINEAR_THEN_FULL,
    "qwen3_next": _LINEAR_THEN_FULL,
    "qwen4_exp_text": {
        # "full_attention", as the checkpoint names it: the config maps it to its indexed attention layer
        # (called "indexed_attention" since transformers 5.18, "qwen_sparse_attention" in 5.17).
        **_LINEAR_THEN_FULL,
        **dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8),
        **dict(indexer_compress_ratio=4, hc_lowrank=16, ple_embed_dim=64, ngram_vocab_size_base=1024),
    },
    "zaya": {"num_experts_per_tok": 1},
}


@cache
def moe_model_types() -> tuple[str, ...]:
    """Causal-LM model types of the installed transformers whose config declares routed experts.

    A composite type whose causal-LM class belongs to another (text) config is dropped in favour of
    that one, so each modeling class appears once.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            with _quiet_transformers():  # default configs warn about their own token ids
                fields = _flat_fields(CONFIG_MAPPING[model_type]())
        except Exception:  # a config that cannot be built with its defaults is not a family we can run
            continue
        if not any(
            k.rsplit(".", 1)[-1] in EXPERT_COUNT_FIELDS or k.endswith("enable_moe_block") for k in fields
        ):
            continue
        text_type = fields.get("text_config.model_type")
        owner = _causal_lm_config_type(class_name)
        if text_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and text_type != model_type:
            continue  # a composite (e.g. vision + text) whose text model is its own entry
        if owner is not None and owner != model_type and owner in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        found.append(model_type)
    return tuple(found)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's config shrunk to a tiny size (fields it lacks are never added)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    with _quiet_transformers():
        defaults = config_cls().to_dict()
    fields = {
        k: v
        for k, v in _SMALL.items()
        if k in defaults and not (defaults[k] is None and k in _NONE_MEANS_OFF)
    }
    if "sparse" in (defaults.get("mlp_layer_types") or ()):
        fields["mlp_layer_types"] = ["sparse"] * 2  # every layer an MoE layer
    if "kv_lora_rank" in defaults and "num_key_value_heads" in defaults:
        fields["num_key_value_heads"] = fields.get("num_attention_heads", 4)  # MLA: one KV head per head
    fields.update({k: v for k, v in _SPECIAL_IDS.items() if k in defaults})
    fields.update(_FAMILY_FIELDS.get(model_type, {}))
    fields.update(overrides)
    return config_cls(**fields)


def build_family(
    model_type: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """A tiny causal LM of `model_type`, initialised from `seed` (on `device`, e.g. "meta")."""
    import transformers

    config = tiny_config(model_type, **overrides)
    if device != "meta":
        # Count on the meta device first: a config the shrink missed must not fill the machine.
        with torch.device("meta"):
            numel = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if numel > MAX_TINY_PARAMS:
            raise ValueError(
                f"{model_type}: the tiny config still has {numel:,} parameters (limit {MAX_TINY_PARAMS:,})."
            )
    torch.manual_seed(seed)
    with torch.device(device) if device else contextlib.nullcontext():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _flat_fields(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.to_dict().items():
        if isinstance(v, dict) and k.endswith("_config"):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def _causal_lm_config_type(class_name: str) -> str | None:
    import transformers

    cls = getattr(transformers, class_name, None)
    config_cls = getattr(cls, "config_class", None)
    return getattr(config_cls, "model_type", None)


def build_for_inspect(spec: str) -> nn.Module:
    """A model to inspect: a built-in tiny model, `hf:<model_type>` or a local checkpoint directory.

    Families and checkpoints are built on the meta device: their structure, no memory."""
    from pathlib import Path

    from sonar_fx.models.tiny import TINY_MODELS, build_model

    if spec in TINY_MODELS:
        return build_model(spec)
    if spec.startswith("hf:"):
        model_type = spec[3:]
        if model_type not in moe_model_types():
            raise ValueError(
                f"{spec}: not an MoE causal-LM model type of this transformers; one of: "
                f"{', '.join(moe_model_types())}."
            )
        return build_family(model_type, device="meta")
    if Path(spec).is_dir():
        import transformers

        config = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    raise ValueError(
        f"Unknown model {spec!r}: use one of {', '.join(TINY_MODELS)}, hf:<model_type> or a local "
        "checkpoint directory."
    )
