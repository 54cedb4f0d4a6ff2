"""Which model a plan is for: the paper's two models by name, or any MoE config a user has.

For: `sonar_fx.plan` and `sonar-fx plan --model`. A model is named by a preset (`PRESETS`: the
full-size shapes of the paper's models), a project tiny model (`sonar_fx.models.TINY_MODELS`), a
transformers config object, a transformers model (its config is used; the model itself is never
touched) or a local directory holding a `config.json`. Each resolves to a `ModelSource` whose
`build` makes the model on the `meta` device: nothing here allocates a weight or downloads.
Never: build a model with real storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx.models.families import EXPERT_COUNT_FIELDS
from sonar_fx.models.reference import ReferenceMoEConfig, ReferenceMoEModel
from sonar_fx.models.tiny import TINY_MODELS, tiny_config
from sonar_fx.planner.fake import PlanError


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A full-size model shape from the paper, built from its transformers class with random weights."""

    name: str
    config_class: str
    """transformers config class."""
    fields: dict[str, Any]
    """Config fields that differ from the class's defaults (those defaults are not the paper's models)."""
    expert_grad_gb: float
    """The paper's figure for its expert gradients in bf16, GB (1e9 bytes): a check on the shapes."""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="olmoe-1b-7b", config_class="OlmoeConfig", expert_grad_gb=12.9,
            fields=dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_experts=64,
                        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16,
                        vocab_size=50304, tie_word_embeddings=False),
        ),
        Preset(
            name="granite-3.1-3b-a800m", config_class="GraniteMoeConfig", expert_grad_gb=6.0,
            fields=dict(hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_local_experts=40,
                        num_experts_per_tok=8, num_attention_heads=24, num_key_value_heads=8,
                        vocab_size=49155, tie_word_embeddings=True),
        ),
    )
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A model a plan can build on the meta device."""

    name: str
    """For tables: the preset, tiny model or directory name, or the config's model type."""
    config: Any = None
    """The transformers config (None for the project's reference model)."""
    reference: ReferenceMoEConfig | None = None
    """The project's reference model's config, when that is the model."""

    def build(self, dtype: torch.dtype) -> nn.Module:
        """The model on the meta device, in `dtype`, in training mode."""
        with torch.device("meta"):
            if self.reference is not None:
                model: nn.Module = ReferenceMoEModel(self.reference).to(dtype)
            else:
                import transformers

                model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        return model.train()


def model_source(model: Any) -> ModelSource:
    """Resolve what `sonar_fx.plan` was given as its model (see the module docstring)."""
    if isinstance(model, nn.Module):
        if getattr(model, "config", None) is None or isinstance(model.config, ReferenceMoEConfig):
            raise PlanError(
                f"a plan builds its own fake copy of the model from a config; {type(model).__name__} has no "
                "transformers config: pass the config, or the model's name."
            )
        model = model.config
    if isinstance(model, (str, Path)):
        return _named(str(model))
    if not callable(getattr(model, "to_dict", None)):
        raise PlanError(f"cannot plan a {type(model).__name__}: {_CHOICES}")
    return _checked(
        ModelSource(name=str(getattr(model, "model_type", "") or type(model).__name__), config=model)
    )


_CHOICES = (
    f"give a preset ({', '.join(PRESETS)}), a tiny model ({', '.join(TINY_MODELS)}), a transformers config, "
    "or a local directory holding a config.json"
)


def _named(name: str) -> ModelSource:
    if name in PRESETS:
        import transformers

        preset = PRESETS[name]
        return ModelSource(name=name, config=getattr(transformers, preset.config_class)(**preset.fields))
    if name == "tiny-reference":
        return ModelSource(name=name, reference=ReferenceMoEConfig())
    if name in TINY_MODELS:
        return _checked(ModelSource(name=name, config=tiny_config(name)))
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"{path} has no config.json: {_CHOICES}.")
        return _checked(ModelSource(name=path.name, config=_directory_config(path)))
    raise PlanError(f"unknown model {name!r}: {_CHOICES}.")


def _directory_config(path: Path) -> Any:
    """A local directory's config, read without running any code of the checkpoint's: a file that is
    not JSON, or one that needs its own code (`auto_map` for a model type transformers does not ship),
    is refused in one line."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = path / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlanError(f"{file} is not valid JSON ({err}): fix the file, or plan a preset.") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if isinstance(data, dict) and "auto_map" in data and model_type not in CONFIG_MAPPING:
        raise PlanError(
            f"{file}: model_type {model_type!r} needs the checkpoint's own code (auto_map), which a plan "
            f"never runs (no trust_remote_code): plan a model type transformers {transformers.__version__} "
            "ships (e.g. olmoe, granitemoe, qwen3_moe, mixtral), or a preset."
        )
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:  # transformers' own refusal, e.g. a model type it does not know
        raise PlanError(f"{file}: transformers cannot read it: {str(err).splitlines()[0]}") from None


def _checked(source: ModelSource) -> ModelSource:
    """Refuse a config that declares no routed experts before anything is built."""
    config = source.config
    counts = {f: getattr(config, f, None) for f in EXPERT_COUNT_FIELDS}
    nested = [getattr(config, sub, None) for sub in ("ffn_config", "text_config")]
    if not any(isinstance(v, int) and v > 0 for v in counts.values()) and not any(
        isinstance(getattr(n, f, None), int) and getattr(n, f) > 0
        for n in nested
        for f in EXPERT_COUNT_FIELDS
    ):
        raise PlanError(
            f"{source.name}: the config declares no routed experts (none of {', '.join(EXPERT_COUNT_FIELDS)} "
            "is set above 0), so Sonar has nothing to update in backward. Plan a Mixture-of-Experts config, "
            f"e.g. a preset ({', '.join(PRESETS)})."
        )
    return source
