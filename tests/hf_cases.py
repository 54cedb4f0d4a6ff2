"""Shared by the Trainer tests: the drop-in run (the Trainer's defaults, tiny OLMoE, short rows) and
the twin that compiles a compiled Sonar run is compared with."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments

from sonar_fx.models import build_model

from helpers import known_library_failure

_IDS = torch.randint(0, 259, (48, 32), generator=torch.Generator().manual_seed(0)).tolist()
SHORT = [
    dict(input_ids=ids, labels=ids) for ids in _IDS
]  # few tokens per step: operands stay below gradients
# The Trainer's defaults (max_grad_norm=1.0 over every parameter, its fused AdamW, weight_decay 0, the
# linear schedule), accumulating 4 micro-batches; only the LR is raised so that 3 steps move the weights.
# The default clip (1.0) is active on some steps of this data; 0.5 (CLIPPED) on every one.
CLIPPED = dict(max_grad_norm=0.5)
DEFAULTS = dict(
    learning_rate=1e-2, gradient_accumulation_steps=4, per_device_train_batch_size=2, max_steps=3, seed=0,
    save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, use_cpu=True,
)  # fmt: skip
# Sonar compiled (fp32 models) against the plain, eager Trainer.
_VS_EAGER = known_library_failure(grouped_mm_compiled=torch.float32, compiled_vs_eager=True)
COMPILERS_VS_EAGER = ["eager", pytest.param("aot_eager", marks=_VS_EAGER)]
COMPILERS_VS_EAGER_SLOW = ["eager", pytest.param("aot_eager", marks=[_VS_EAGER, pytest.mark.slow])]
"""For tests whose aot_eager run takes over 10 s (two compiled models, or accumulation)."""


def drop_in_run(trainer_cls, out, model_name="tiny-olmoe", overrides=CLIPPED, **kwargs):
    """`trainer_cls` with the drop-in arguments (and `overrides`) on SHORT: (model, trainer, logged norms)."""
    torch._dynamo.reset()
    model = build_model(model_name, seed=0)
    args = TrainingArguments(output_dir=str(out), **{**DEFAULTS, **overrides})
    trainer = trainer_cls(model=model, args=args, train_dataset=SHORT, **kwargs)
    trainer.train()
    return trainer.model, trainer, logged_norms(trainer)


def logged_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
