"""SonarTrainer as a drop-in for the plain Trainer, beyond the defaults: the norm it logs without a clip,
`model_init=`, and checkpoints the plain Trainer and SonarTrainer resume from each other.

Each claim is checked against the plain `Trainer` with the same arguments: weights `torch.equal` on
every parameter, logged norms equal as floats (the Trainer logs `norm.item()`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments

import sonar_fx
from sonar_fx.integrations.hf import SonarTrainer, sonar_config
from sonar_fx.models import build_model

from helpers import assert_same_weights, weights_differ
from hf_cases import (
    CLIPPED,
    COMPILERS_VS_EAGER_SLOW,
    DEFAULTS,
    SHORT,
    drop_in_run,
    logged_norms,
)

# ------------------------------------------------------------------------------- the logged norm


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER_SLOW)
@pytest.mark.parametrize("accumulation", [4, 1])
def test_without_a_clip_the_logged_norm_covers_every_gradient(tmp_path, compiler, accumulation):
    """max_grad_norm=0: the plain Trainer logs the norm over every gradient. Sonar combines each dense
    gradient's norm with each expert gradient's, taken before it was freed: at the step (accumulation
    4, deferred schedule) or inside backward (accumulation 1, in-backward schedule)."""
    overrides = dict(max_grad_norm=0.0, gradient_accumulation_steps=accumulation)
    plain, _, plain_norms = drop_in_run(Trainer, tmp_path / "plain", overrides=overrides)
    model, _, norms = drop_in_run(
        SonarTrainer, tmp_path / "sonar", overrides=overrides, sonar_compiler=compiler
    )
    assert model.sonar.schedule == ("deferred" if accumulation > 1 else "in_backward")
    assert norms == plain_norms and len(norms) == 3
    assert_same_weights(model, plain)
    assert model.sonar.grad_norms()["dense"] < norms[-1]  # teeth: the last step's dense-only norm


def test_in_backward_with_the_trainers_clip_logs_the_norm_over_every_gradient(tmp_path):
    """A model prepared in-backward by the user: the Trainer clips the dense gradients (by their norm)
    and logs the norm over every gradient, the plain Trainer's on the first step (the weights part from
    there: the clips differ)."""
    overrides = dict(gradient_accumulation_steps=1, max_steps=1)
    _, _, plain_norms = drop_in_run(Trainer, tmp_path / "plain", overrides=overrides)
    args = TrainingArguments(output_dir=str(tmp_path / "sonar"), **{**DEFAULTS, **overrides})
    model = build_model("tiny-olmoe", seed=0)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler="eager")
    trainer = SonarTrainer(model=model, args=args, train_dataset=SHORT)
    trainer.train()
    assert model.sonar.schedule == "in_backward"
    assert logged_norms(trainer) == plain_norms
    assert model.sonar.grad_norms()["dense"] < plain_norms[0]


# --------------------------------------------------------------------------------- model_init=


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER_SLOW)
def test_model_init_prepares_each_model_as_model_does(tmp_path, compiler):
    """model_init= (hyper-parameter search): the model built for train() is prepared like model= and its
    model.sonar is the optimizer; the run equals the plain Trainer's with the same model_init."""

    def model_init():
        return build_model("tiny-olmoe", seed=0)

    runs = []
    for cls, kwargs in ((Trainer, {}), (SonarTrainer, {"sonar_compiler": compiler})):
        torch._dynamo.reset()
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), **{**DEFAULTS, **CLIPPED})
        trainer = cls(model_init=model_init, args=args, train_dataset=SHORT, **kwargs)
        built_at_init = trainer.model
        trainer.train()
        assert trainer.model is not built_at_init  # train() built a fresh one
        runs.append(trainer)
    plain, sonar = runs
    assert sonar.optimizer.optimizer is sonar.model.sonar and sonar.model.sonar.schedule == "deferred"
    assert sonar.model.sonar.report()["updates_deferred"] == 3 * 4
    assert logged_norms(sonar) == logged_norms(plain)
    assert_same_weights(sonar.model, plain.model)
    assert weights_differ(sonar.model, build_model("tiny-olmoe", seed=0))
