"""SonarTrainer as a drop-in for the plain Trainer, beyond the defaults: the norm it logs without a clip,
`model_init=`, and checkpoints the plain Trainer and SonarTrainer resume from each other.

Each claim is checked against the plain `Trainer` with the same arguments: weights `torch.equal` on
every parameter, logged norms equal as floats (the Trainer logs `norm.item()`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments

import sonar_fx
from sonar_fx.errors import SonarUsageError
from sonar_fx.integrations.hf import SonarTrainer, sonar_config
from sonar_fx.integrations.hf_checkpoint import load_converted_weights_
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

# The Trainer's accumulation on a tiny model crosses over (many tokens per step for its expert sizes):
# the saving is lost by design here, so the guard warns (its refusal: tests/test_saving_guard.py).
pytestmark = pytest.mark.usefixtures("deferred_saving_lost")

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


# ---------------------------------------------------------------------------------- checkpoints

RESUMED = {**CLIPPED, "weight_decay": 0.01, "gradient_accumulation_steps": 2, "max_steps": 4}


class PlainWithExpertWeights(Trainer):
    """The plain Trainer, whose resume also loads the expert tensors `save_pretrained` wrote per expert
    (transformers 5's resume leaves them fresh, with Sonar or without): the twin that shows what an
    optimizer state alone does on resume."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_converted_weights_(self.model, Path(resume_from_checkpoint))


def checkpointed_run(trainer_cls, out, resume_from=None, overrides=RESUMED, **kwargs):
    """4 steps, a checkpoint after 2 (or resumed from `resume_from`); returns the trainer."""
    torch._dynamo.reset()
    saving = dict(save_strategy="steps", save_steps=2)
    args = TrainingArguments(output_dir=str(out), **{**DEFAULTS, **overrides, **saving})
    trainer = trainer_cls(model=build_model("tiny-olmoe", seed=0), args=args, train_dataset=SHORT, **kwargs)
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer


@pytest.fixture(scope="module")
def plain_whole(tmp_path_factory) -> Trainer:
    """The plain Trainer's uninterrupted run, with its checkpoint after 2 steps."""
    return checkpointed_run(Trainer, tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER_SLOW)
def test_a_plain_trainer_checkpoint_resumes_under_sonar_trainer(plain_whole, tmp_path_factory, compiler):
    """The moment to migrate a run: SonarTrainer resumes the plain Trainer's checkpoint (its AdamW state
    in decay / no-decay groups, mapped tensor by tensor into Sonar's groups; the scheduler's per-group
    LRs likewise) and continues bitwise as the plain Trainer does."""
    whole = plain_whole
    checkpoint = Path(whole.args.output_dir) / "checkpoint-2"
    resumed = checkpointed_run(
        SonarTrainer, tmp_path_factory.mktemp("sonar"), checkpoint, sonar_compiler=compiler
    )
    assert resumed.model.sonar.schedule == "deferred" and resumed.state.global_step == 4
    assert_same_weights(resumed.model, whole.model)
    assert logged_norms(resumed)[-2:] == logged_norms(whole)[-2:]
    assert [g["lr"] for g in resumed.model.sonar.param_groups] == [0.0] * 3  # the schedule ran on
    for p in whole.model.parameters():  # every tensor's optimizer state, bitwise
        mine = resumed.model.sonar.state[dict(resumed.model.named_parameters())[_name(whole.model, p)]]
        theirs = whole.optimizer.state[p]
        assert all(torch.equal(mine[k], theirs[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _name(model, param) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


def test_a_sonar_checkpoint_resumes_under_the_plain_trainer(plain_whole, tmp_path_factory):
    """SonarTrainer writes optimizer.pt and scheduler.pt in the plain Trainer's layout: the plain
    Trainer resumes them and continues bitwise as if it had trained the first steps itself."""
    whole = plain_whole
    sonar = checkpointed_run(SonarTrainer, tmp_path_factory.mktemp("sonar"))
    checkpoint = Path(sonar.args.output_dir) / "checkpoint-2"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    plain_state = torch.load(Path(whole.args.output_dir) / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert [sorted(g) for g in state["param_groups"]] == [sorted(g) for g in plain_state["param_groups"]]
    sizes = [len(g["params"]) for g in state["param_groups"]]
    assert sizes == [len(g["params"]) for g in plain_state["param_groups"]] == [16, 9]  # decay, no decay
    resumed = checkpointed_run(PlainWithExpertWeights, tmp_path_factory.mktemp("resumed"), checkpoint)
    assert_same_weights(resumed.model, whole.model)
    assert_same_weights(sonar.model, whole.model)
    # Teeth: without the optimizer state the same resume differs.
    (checkpoint / "optimizer.pt").unlink()
    fresh = checkpointed_run(PlainWithExpertWeights, tmp_path_factory.mktemp("fresh"), checkpoint)
    assert weights_differ(fresh.model, whole.model)


def test_a_checkpoint_of_other_trainable_tensors_is_refused_before_anything_loads(
    plain_whole, tmp_path_factory
):
    """The checkpoint's groups do not match this model's (the embeddings frozen here): refused naming
    the sizes, before anything is loaded into model.sonar."""
    whole = plain_whole
    model = build_model("tiny-olmoe", seed=0)
    model.model.embed_tokens.weight.requires_grad_(False)
    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("frozen")), **{**DEFAULTS, **RESUMED})
    trainer = SonarTrainer(model=model, args=args, train_dataset=SHORT)
    with pytest.raises(
        SonarUsageError, match=r"groups of \[16, 9\] tensors.*groups of \[15, 9\].*another model"
    ):
        trainer.train(resume_from_checkpoint=str(Path(whole.args.output_dir) / "checkpoint-2"))
    assert not model.sonar.state


def test_a_checkpoint_saved_with_another_weight_decay_is_refused(plain_whole, tmp_path):
    """weight_decay=0.0 now, 0.01 in the checkpoint: Sonar holds decay and no-decay tensors in one group,
    whose two source groups disagree on weight_decay: refused naming it."""
    args = TrainingArguments(output_dir=str(tmp_path), **{**DEFAULTS, **RESUMED, "weight_decay": 0.0})
    trainer = SonarTrainer(model=build_model("tiny-olmoe", seed=0), args=args, train_dataset=SHORT)
    with pytest.raises(
        SonarUsageError, match=r"\{'weight_decay': 0\.01\}, \{'weight_decay': 0\.0\}.*saved with"
    ):
        trainer.train(resume_from_checkpoint=str(Path(plain_whole.args.output_dir) / "checkpoint-2"))
    assert not trainer.model.sonar.state
