"""Sonar in TRL's `SFTTrainer`: `SonarSFTTrainer`, and Alpaca records in TRL's prompt-completion form.

For: supervised fine-tuning with TRL on a model compiled by `sonar_fx.compile`, with the same optimizer,
single clip and checks as `sonar_fx.integrations.hf.SonarTrainer`:

    args = SFTConfig(output_dir=..., learning_rate=2e-5, max_grad_norm=1.0, ...)
    model = sonar_fx.compile(model, sonar_config(args), compiler="inductor")
    SonarSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(prompt_completion(records)),
                    processing_class=tokenizer).train()

TRL's prompt-completion datasets take the loss on the completion only, as `sonar_fx.data` does.
Never: apply a `peft_config` after compilation (its adapters would not be in `model.sonar`: the
check refuses it; apply PEFT before `sonar_fx.compile`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sonar_fx.data.encoding import format_example
from sonar_fx.integrations.hf import SonarTrainerMixin

try:
    from trl import SFTTrainer
except ImportError as err:
    raise ImportError(
        f"sonar_fx.integrations.sft needs TRL ({err}); install the extra: pip install 'sonar-fx[hf]'"
    ) from err

__all__ = ["SonarSFTTrainer", "prompt_completion"]


class SonarSFTTrainer(SonarTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` training a model compiled by `sonar_fx.compile` (optimizer `model.sonar`, the
    Trainer's scheduler, one clip by the Trainer; see `sonar_fx.integrations.hf`)."""


def prompt_completion(records: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """Alpaca records as TRL prompt-completion rows: the standard Alpaca prompt, and the response."""
    return [dict(zip(("prompt", "completion"), format_example(r), strict=True)) for r in records]
