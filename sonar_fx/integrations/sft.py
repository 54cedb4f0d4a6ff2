"""Sonar in TRL's `SFTTrainer`: `SonarSFTTrainer`, and Alpaca records in TRL's prompt-completion form.

For: supervised fine-tuning with TRL on a model compiled by `sonar_fx.compile`, with the same optimizer,
single clip and checks as `sonar_fx.integrations.hf.SonarTrainer`:

    args = SFTConfig(output_dir=..., learning_rate=2e-5, max_grad_norm=1.0, ...)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler="inductor")
    SonarSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(prompt_completion(records)),
                    processing_class=tokenizer).train()

TRL's prompt-completion datasets take the loss on the completion only, as `sonar_fx.data` does.
Never: apply a `peft_config` after compilation (its adapters would not be in `model.sonar`: the
check refuses it; apply PEFT before `sonar_fx.compile`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sonar_fx.compiled import recompile_inner_
from sonar_fx.data.encoding import format_example
from sonar_fx.integrations.hf import SonarTrainerMixin

try:
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import maybe_install_capturing_hooks
    from trl import SFTTrainer
except ImportError as err:
    raise ImportError(
        f"sonar_fx.integrations.sft needs TRL ({err}); install the extra: pip install 'sonar-fx[hf]'"
    ) from err

__all__ = ["SonarSFTTrainer", "prompt_completion"]

_CHECKPOINTED_CAPTURE = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
"""TRL's defaults checkpoint each decoder layer and capture its router logits (for the auxiliary loss)
by appending to a list from a forward hook. Dynamo refuses to trace that side effect inside a
checkpointed region unless told not to replay it in the backward's recomputation, and would run every
layer eagerly. Not replaying it is what eager does too: during the recomputation no capture is active."""


class SonarSFTTrainer(SonarTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` training a model compiled by `sonar_fx.compile` (optimizer `model.sonar`, the
    Trainer's scheduler, one clip by the Trainer; see `sonar_fx.integrations.hf`).

    TRL's fused LM head replaces `model.forward` with a function that calls the backbone directly, so a
    model compiled whole would train uncompiled: the backbone (which holds every expert) is compiled
    in its place, with the same settings, and TRL's LM head runs as TRL wrote it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model: Any = self.model
        backbone = model.base_model
        if backbone is not model and isinstance(backbone, PreTrainedModel):
            # The backbone's forward installs transformers' output-capturing hooks (router logits, which TRL
            # asks for) on its first call, under a lock: a graph break in a loop, for which dynamo would
            # skip the backbone's frame for good. Installed now, the compiled frame finds them in place.
            maybe_install_capturing_hooks(backbone)
        recompile_inner_(model, backbone, dynamo_config=_CHECKPOINTED_CAPTURE)


def prompt_completion(records: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """Alpaca records as TRL prompt-completion rows: the standard Alpaca prompt, and the response."""
    return [dict(zip(("prompt", "completion"), format_example(r), strict=True)) for r in records]
