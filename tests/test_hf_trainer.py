"""Sonar through transformers' Trainer and TRL's SFTTrainer: exact, resumable, and refusing what would
train differently from what the arguments say.

Every exactness claim is `torch.equal` on every parameter after a few Trainer steps against the SAME
Trainer run with `torch.optim.AdamW(fused=True)` that clips only the dense gradients: there a callback
clips them right before `optimizer.step()`, and the Trainer's own clip is off (it would clip the expert
gradients too). Tiny models, built-in Alpaca-format data, one fixed sequence length (one compiled graph).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
pytest.importorskip("trl")

from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

import sonar_fx
from sonar_fx.data import ByteTokenizer, collate, encode_example, encode_records, pad_to, synthetic_records
from sonar_fx.integrations.hf import SonarTrainer, byte_tokenizer, sonar_config, trainer_schedule
from sonar_fx.integrations.sft import SonarSFTTrainer, prompt_completion
from sonar_fx.models import build_model

from helpers import assert_same_weights, weights_differ
from hf_cases import CLIPPED, COMPILERS_VS_EAGER, DEFAULTS, SHORT, drop_in_run

# transformers' own deprecation notices, raised from inside TRL's and PEFT's calls.
pytestmark = pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning")

MODELS = ["tiny-qwen3moe", "tiny-olmoe"]
SEQ = 256
TOKENIZER = ByteTokenizer()
RECORDS = synthetic_records(12)
EXAMPLES = encode_records(RECORDS, TOKENIZER, SEQ).examples
# lr large enough to move weights visibly in 3 steps; max_grad_norm small enough that the clip is active.
HYPER = dict(learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.01)
QUIET = dict(report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, use_cpu=True)


def collate_fixed(batch):
    return pad_to(collate(batch, TOKENIZER.pad_id), SEQ, TOKENIZER.pad_id)


def training_args(out, cls=TrainingArguments, **overrides) -> TrainingArguments:
    fields = dict(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=3, max_grad_norm=0.5, seed=0,
        save_strategy="no", **HYPER, **QUIET,
    )  # fmt: skip
    return cls(**{**fields, **overrides})


class DenseOnlyClip(TrainerCallback):
    """The twin's clip: only the dense gradients, right before `optimizer.step()`."""

    def __init__(self, dense: list[nn.Parameter], max_norm: float) -> None:
        self.dense, self.max_norm = dense, max_norm

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch.nn.utils.clip_grad_norm_(self.dense, self.max_norm)


def standard_trainer(model, args, trainer_cls=Trainer, *, dense_only_clip=True, **kwargs):
    """The twin: the Trainer's own fused AdamW (biases and norm weights in a no-decay group), clipping
    dense gradients only (or, as a negative control, every gradient with the Trainer's own clip)."""
    callbacks = []
    if dense_only_clip:
        experts = {id(t.param) for layer in sonar_fx.discover_experts(model) for t in layer.tensors}
        callbacks = [
            DenseOnlyClip([p for p in model.parameters() if id(p) not in experts], args.max_grad_norm)
        ]
        args.max_grad_norm = 0.0
    return trainer_cls(model=model, args=args, callbacks=callbacks, **kwargs)


def trainer_data():
    return dict(train_dataset=EXAMPLES, data_collator=collate_fixed)


@functools.cache
def standard_run(model_name: str, dense_only_clip: bool = True) -> nn.Module:
    model = build_model(model_name, seed=0)
    trainer = standard_trainer(
        model, training_args("unused"), dense_only_clip=dense_only_clip, **trainer_data()
    )
    trainer.train()
    return model


def sonar_run(model: nn.Module, compiler: str, out="unused", **compile_kwargs):
    torch._dynamo.reset()
    args = training_args(out)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=compiler, **compile_kwargs)
    trainer = SonarTrainer(model=model, args=args, **trainer_data())
    trainer.train()
    return model, trainer


# ---------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER)
@pytest.mark.parametrize("model_name", MODELS)
def test_trainer_equals_standard_fused_adamw_with_dense_only_clip(model_name, compiler):
    model, trainer = sonar_run(build_model(model_name, seed=0), compiler)
    assert_same_weights(model, standard_run(model_name))
    assert weights_differ(model, build_model(model_name, seed=0))
    assert trainer.optimizer.optimizer is model.sonar  # accelerate's wrapper around Sonar's optimizer
    report = model.sonar.report()
    path = "updates_in_graph" if compiler == "aot_eager" else "updates_by_hook"
    assert report[path] == 3 * 4 and report["fallbacks"] == []
    # The Trainer's own linear schedule drove every group: after 3 of 3 steps the LR is 0. Norm weights
    # are in a group of their own (weight_decay 0.0, as the Trainer's AdamW groups them).
    groups = {g["name"]: (g["lr"], g["weight_decay"]) for g in model.sonar.param_groups}
    assert groups == {"dense": (0.0, 0.01), "experts": (0.0, 0.01), "dense/weight_decay=0.0": (0.0, 0.0)}


def test_the_trainers_clip_of_every_gradient_is_not_the_twin():
    """Teeth: standard AdamW under the Trainer's own clip (expert gradients included) must differ from
    the twin (which Sonar equals, above)."""
    assert weights_differ(standard_run("tiny-qwen3moe"), standard_run("tiny-qwen3moe", dense_only_clip=False))


def test_a_second_clip_is_not_a_no_op():
    """Why Sonar refuses to clip when the Trainer does: clipping an already clipped set scales it again."""
    grads = [torch.randn(5, 7, generator=torch.Generator().manual_seed(i)) * 3 for i in range(3)]
    once = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    twice = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(once + twice, grads + grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(once, 0.5)
    torch.nn.utils.clip_grad_norm_(twice, 0.5)
    torch.nn.utils.clip_grad_norm_(twice, 0.5)
    assert any(not torch.equal(a.grad, b.grad) for a, b in zip(once, twice, strict=True))


@functools.cache
def sft_run(compiler: str | None) -> tuple[nn.Module, SFTTrainer]:
    """TRL's defaults (bf16 autocast through accelerate, gradient checkpointing, the fused LM head, the
    router's auxiliary loss) on prompt-completion Alpaca rows tokenized by the byte tokenizer: Sonar
    compiled with `compiler`, or (None) the standard twin."""
    torch._dynamo.reset()
    args = training_args("unused", SFTConfig, max_length=SEQ, pad_to_multiple_of=SEQ, max_steps=2)
    assert args.bf16 and args.gradient_checkpointing  # TRL's defaults, kept on purpose
    data, tokenizer = Dataset.from_list(prompt_completion(RECORDS)), byte_tokenizer()
    model = build_model("tiny-qwen3moe", seed=0)
    if compiler is None:
        trainer = standard_trainer(model, args, SFTTrainer, train_dataset=data, processing_class=tokenizer)
    else:
        model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=compiler)
        trainer = SonarSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER)
def test_sft_trainer_equals_standard_with_trls_defaults(compiler):
    """Compiled, TRL's fused LM head replaces model.forward with a function that calls the backbone
    directly: SonarSFTTrainer compiles the backbone in its place, so every expert update is in-graph."""
    sonar_model, trainer = sft_run(compiler)
    row, expected = trainer.train_dataset[0], encode_example(RECORDS[0], TOKENIZER, SEQ)
    assert (row["input_ids"], row["labels"]) == (expected["input_ids"], expected["labels"])
    report = sonar_model.sonar.report()
    path = "updates_by_hook" if compiler == "eager" else "updates_in_graph"
    assert report[path] == 2 * 4 and report["updates_by_hook"] + report["updates_in_graph"] == 2 * 4
    assert report["expert_grad_bytes"]["measured_peak"] <= report["expert_grad_bytes"]["one_layer"]
    standard_model, _ = sft_run(None)
    assert_same_weights(sonar_model, standard_model)
    assert weights_differ(sonar_model, build_model("tiny-qwen3moe", seed=0))


# ------------------------------------------------------------------ the drop-in: the Trainer's defaults


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER)
@pytest.mark.usefixtures("deferred_saving_lost")
def test_drop_in_with_the_trainers_defaults_equals_the_plain_trainer(tmp_path, compiler):
    """Swapping the class is the whole migration: the plain Trainer's all-parameter clip, accumulation of
    4, weight decay (biases and norm weights exempt, by the Trainer's own rule) and scheduler, bitwise,
    with Sonar's memory (expert gradients from operands kept in backward)."""
    overrides = {**CLIPPED, "weight_decay": 0.01}
    plain, _, plain_norms = drop_in_run(Trainer, tmp_path / "plain", overrides=overrides)
    model, _, norms = drop_in_run(
        SonarTrainer, tmp_path / "sonar", overrides=overrides, sonar_compiler=compiler
    )
    assert model.sonar.schedule == "deferred" and model.sonar.cfg.expert_clip == "global"
    (exempt,) = model.sonar.cfg.weight_decay_groups
    assert exempt.weight_decay == 0.0 and exempt.params and all("norm" in n for n in exempt.params)
    assert norms == plain_norms and all(n > 0.5 for n in norms)  # the same norm, clipped on every step
    assert_same_weights(model, plain)
    assert weights_differ(model, build_model("tiny-olmoe", seed=0))
    report = model.sonar.report()
    assert report["updates_deferred"] == 3 * 4 and report["deferred"]["kept_operand_peak"] > 0
    assert report["deferred"]["kept_whole"] == [] and report["fallbacks"] == []
    assert (report["graphs_compiled"] + report["graphs_from_cache"] > 0) == (compiler == "aot_eager")
    assert [g["lr"] for g in model.sonar.param_groups] == [0.0, 0.0, 0.0]


def test_the_schedule_follows_the_arguments(tmp_path):
    def schedule(**overrides):
        return trainer_schedule(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **overrides))

    assert schedule() == "deferred"  # max_grad_norm=1.0 clips every parameter
    assert schedule(max_grad_norm=0.0, gradient_accumulation_steps=2) == "deferred"
    assert schedule(max_grad_norm=0.0) == "in_backward"  # the same arithmetic, the fastest path


def test_drop_in_negative_control_dense_only_clip_differs(tmp_path):
    """Teeth: the in-backward schedule (the Trainer's clip sees only the dense gradients) at GA=1 is
    not the plain Trainer."""
    one = {**DEFAULTS, "gradient_accumulation_steps": 1}
    args = TrainingArguments(output_dir=str(tmp_path), **one)
    model = build_model("tiny-olmoe", seed=0)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler="eager")
    SonarTrainer(model=model, args=args, train_dataset=SHORT).train()
    plain = build_model("tiny-olmoe", seed=0)
    args = TrainingArguments(output_dir=str(tmp_path), **one)
    Trainer(model=plain, args=args, train_dataset=SHORT).train()
    assert model.sonar.schedule == "in_backward" and weights_differ(model, plain)


@pytest.mark.usefixtures("deferred_saving_lost")
def test_drop_in_fp16_with_a_scaler_that_overflows_equals_the_plain_trainer(tmp_path):
    """fp16=True: on CPU accelerate builds neither autocast nor a GradScaler, so both are given to both
    Trainers (before accelerate wraps model and optimizer), with a scale that overflows: skipped steps,
    backed-off scales, and the LR schedule the plain Trainer's fused AdamW implies (it is stepped on
    every step and skips inside, so its schedule advances)."""
    runs = []
    for cls in (Trainer, SonarTrainer):
        model = build_model("tiny-olmoe", seed=0)
        overrides = {**DEFAULTS, "fp16": True}
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), **overrides)
        trainer = cls(model=model, args=args, train_dataset=SHORT)
        trainer.accelerator.native_amp = True  # fp16 autocast, as accelerate sets it up on a GPU
        trainer.accelerator.scaler = torch.amp.GradScaler(
            "cpu", init_scale=2.0**24, growth_factor=2.0**8, backoff_factor=2.0**-8, growth_interval=1
        )
        trainer.train()
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
        runs.append((trainer.model, trainer.accelerator.scaler.get_scale(), norms, lrs))
    (plain, *plain_facts), (model, *facts) = runs
    assert model.sonar.schedule == "deferred"
    assert facts[0] == plain_facts[0] == 2.0**16  # 2 of 3 steps overflowed: 2^24 * 2^8 * 2^-8 * 2^-8
    assert facts[2] == plain_facts[2] and facts[2][1] != facts[2][0]  # the LR schedule advanced
    assert [math.isnan(n) for n in facts[1]] == [math.isnan(n) for n in plain_facts[1]] == [True, False, True]
    assert_same_weights(model, plain)


@pytest.mark.parametrize("compiler", COMPILERS_VS_EAGER)
@pytest.mark.usefixtures("deferred_saving_lost")
def test_drop_in_sft_trainer_with_accumulation_equals_trls(compiler):
    """TRL's SFTTrainer with its defaults (bf16 autocast, gradient checkpointing, the fused LM head, the
    router's auxiliary loss), the Trainer's all-parameter clip and weight decay 0.01 (norm weights
    exempt), accumulating 2 micro-batches."""
    runs = []
    for cls in (SFTTrainer, SonarSFTTrainer):
        torch._dynamo.reset()
        args = training_args(
            "unused", SFTConfig, max_length=SEQ, pad_to_multiple_of=SEQ, max_steps=2,
            gradient_accumulation_steps=2,
        )  # fmt: skip
        data, tokenizer = Dataset.from_list(prompt_completion(RECORDS)), byte_tokenizer()
        kwargs = {} if cls is SFTTrainer else {"sonar_compiler": compiler}
        model = build_model("tiny-qwen3moe", seed=0)
        trainer = cls(model=model, args=args, train_dataset=data, processing_class=tokenizer, **kwargs)
        trainer.train()
        runs.append(trainer.model)
    plain, model = runs
    assert model.sonar.schedule == "deferred"
    assert_same_weights(model, plain)
    assert weights_differ(model, build_model("tiny-qwen3moe", seed=0))
    report = model.sonar.report()  # every expert gradient came from kept operands (or crossed over)
    assert report["updates_deferred"] == 2 * 4 and report["deferred"]["kept_whole"] == []
    assert (report["graphs_compiled"] + report["graphs_from_cache"] > 0) == (compiler == "aot_eager")


# ------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_resume_from_a_trainer_checkpoint_equals_the_uninterrupted_run(tmp_path, compiler, monkeypatch):
    """Three models in one process share one compiled graph (bound at run time to each model). The
    checkpoint is in the plain Trainer's layout; one in Sonar's own (as written before) resumes too."""
    torch._dynamo.reset()

    def trainer(out, max_steps):
        args = training_args(out, max_steps=max_steps, save_strategy="steps", save_steps=2)
        model = build_model("tiny-olmoe", seed=0)
        model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=compiler)
        return model, SonarTrainer(model=model, args=args, **trainer_data())

    whole, t = trainer(tmp_path / "whole", 4)
    t.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert [len(g["params"]) for g in state["param_groups"]] == [16, 9]  # the Trainer's decay, no decay
    assert all("name" not in g for g in state["param_groups"])
    assert len(state["state"]) == sum(1 for _ in whole.parameters())  # expert moments included

    resumed, t = trainer(tmp_path / "resumed", 4)
    t.train(resume_from_checkpoint=str(checkpoint))
    assert_same_weights(resumed, whole)
    assert resumed.sonar.state_dict()["state"].keys() == whole.sonar.state_dict()["state"].keys()
    for key, s in resumed.sonar.state_dict()["state"].items():
        other = whole.sonar.state_dict()["state"][key]
        assert all(torch.equal(s[k], other[k]) for k in ("step", "exp_avg", "exp_avg_sq"))

    if compiler != "eager":
        return
    with monkeypatch.context() as patched:  # a checkpoint in Sonar's own layout: loaded as it is
        patched.setattr("sonar_fx.integrations.hf.has_trainer_layout", lambda opt: False)
        _, t = trainer(tmp_path / "sonar_layout", 4)
        t.train()
    sonar_layout = tmp_path / "sonar_layout" / "checkpoint-2"
    assert "name" in torch.load(sonar_layout / "optimizer.pt", weights_only=True)["param_groups"][0]
    again, t = trainer(tmp_path / "again", 4)
    t.train(resume_from_checkpoint=str(sonar_layout))
    assert_same_weights(again, whole)
    # Teeth: the same resume without the optimizer state file must not match.
    (checkpoint / "optimizer.pt").unlink()
    fresh, t = trainer(tmp_path / "fresh", 4)
    t.train(resume_from_checkpoint=str(checkpoint))
    assert weights_differ(fresh, whole)


@pytest.mark.usefixtures("deferred_saving_lost")
def test_drop_in_resume_with_accumulation_equals_the_uninterrupted_run(tmp_path):
    """The deferred schedule keeps nothing across a step: a Trainer checkpoint (optimizer.pt holds
    model.sonar's state) resumes bitwise with accumulation and the all-parameter clip."""

    def trainer(out):
        steps = dict(max_steps=4, gradient_accumulation_steps=2, save_strategy="steps", save_steps=2)
        args = TrainingArguments(output_dir=str(out), **{**DEFAULTS, **CLIPPED, **steps})
        return SonarTrainer(model=build_model("tiny-olmoe", seed=0), args=args, train_dataset=SHORT)

    whole = trainer(tmp_path / "whole")
    whole.train()
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.model.sonar.schedule == "deferred"
    assert_same_weights(resumed.model, whole.model)
    assert weights_differ(resumed.model, build_model("tiny-olmoe", seed=0))


def test_load_best_model_at_end_restores_the_expert_tensors_too(tmp_path):
    """The best checkpoint is made the earlier one (highest loss "best"), so loading it must move every
    tensor back, experts included, to what from_pretrained reads from that checkpoint."""
    args = training_args(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
    )  # fmt: skip
    model = build_model("tiny-olmoe", seed=0)
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler="eager")
    trainer = SonarTrainer(model=model, args=args, eval_dataset=EXAMPLES[:2], **trainer_data())
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    assert_same_weights(model, type(model).from_pretrained(trainer.state.best_model_checkpoint))


# ----------------------------------------------------------------- what Trainer and accelerate read


def _columns(model, args) -> tuple[list[str], bool]:
    trainer = Trainer(model=model, args=args, **trainer_data())
    trainer._set_signature_columns_if_needed()
    return trainer._signature_columns, trainer.model_accepts_loss_kwargs


@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("compiler", ["eager", "aot_eager", "inductor"])
def test_the_trainers_column_filter_sees_the_models_forward(tmp_path, compiler, regional):
    args = training_args(tmp_path)
    expected = _columns(build_model("tiny-qwen3moe", seed=0), args)
    assert {"input_ids", "attention_mask", "labels"} <= set(expected[0])
    model = build_model("tiny-qwen3moe", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # regional=True turns the KV cache off, with a warning
        model = sonar_fx.compile(model, sonar_config(args, model=model), compiler=compiler, regional=regional)
    assert _columns(model, args) == expected


@pytest.mark.slow  # over 10 s
def test_accelerate_mixed_precision_wraps_and_unwraps_the_compiled_forward():
    """accelerate's bf16 autocast rewraps `forward.__func__` and its unwrap binds what it finds with
    MethodType: both must keep the compiled forward and the model's signature."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # earlier Trainers set fp32; as Trainer does
    model = build_model("tiny-qwen3moe", seed=0)
    signature = inspect.signature(model.forward)
    model = sonar_fx.compile(model, sonar_fx.AdamWConfig(max_grad_norm=None), compiler="aot_eager")
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    assert accelerator.native_amp
    accelerator.prepare(model)
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert inspect.signature(model.forward) == signature
        model(ids, labels=ids).loss.backward()  # positional input_ids: the module must not be passed twice
        model.sonar.step()
        model.sonar.zero_grad()
        model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    report = model.sonar.report()
    assert report["updates_in_graph"] == 2 * 4 and report["updates_by_hook"] == 0
    assert report["fallbacks"] == []


def test_after_a_fallback_the_trainer_still_trains_exactly(tmp_path):
    """A dynamo failure (graph break under fullgraph=True) falls back to the hooks: same columns, same
    weights as the twin."""
    model = build_model("tiny-qwen3moe", seed=0)
    model.model.layers[1].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    with pytest.warns(UserWarning, match="sonar: compilation failed") as caught:
        model, trainer = sonar_run(model, "aot_eager", tmp_path, fullgraph=True)
    uncompiled = [str(w.message) for w in caught if "no compiled graph computed" in str(w.message)]
    assert len(uncompiled) == 1 and "Likely cause: compilation fell back to eager hooks (" in uncompiled[0]
    assert trainer._signature_columns == _columns(build_model("tiny-qwen3moe", seed=0), trainer.args)[0]
    assert model.sonar.report()["updates_by_hook"] == 3 * 4 and len(model.sonar.report()["fallbacks"]) == 1
    assert_same_weights(model, standard_run("tiny-qwen3moe"))


# ------------------------------------------------------------------------------------- refusals


def _sonar_trainer(tmp_path, cfg_changes=None, compile_kwargs=None, **arg_overrides):
    args = training_args(tmp_path, **arg_overrides)
    model = build_model("tiny-olmoe", seed=0)
    cfg = dataclasses.replace(sonar_config(args, model=model), **(cfg_changes or {}))
    model = sonar_fx.compile(model, cfg, compiler="eager", **(compile_kwargs or {}))
    return model, lambda **kw: SonarTrainer(model=model, args=args, **trainer_data(), **kw)


@pytest.mark.parametrize(
    ("cfg_changes", "arg_overrides", "match"),
    [
        ({"max_grad_norm": 0.5}, {}, "second clip is not a no-op"),
        ({"max_grad_norm": 0.5}, {"max_grad_norm": 0.0}, "Clip once, in the Trainer"),
        ({"lr": 1e-3}, {}, r"lr: Trainer 0\.01, model\.sonar 0\.001"),
        ({"betas": (0.9, 0.999)}, {}, r"betas: Trainer \(0\.9, 0\.95\)"),
        ({}, {"gradient_accumulation_steps": 2}, "multiply per_device_train_batch_size by 2"),
        ({}, {"optim": "sgd"}, r"optim='sgd'.*Set optim='adamw_torch_fused'"),
        ({}, {"optim": "adamw_torch"}, r"rounds otherwise.*Set optim='adamw_torch_fused'"),
        ({}, {"optim": "adamw_torch_fused", "optim_args": "foo=1"}, r"without optim_args"),
        ({}, {"torch_compile": True}, "torch_compile=False"),
        ({}, {"torch_compile": True, "torch_compile_backend": "sonar"}, r"not 'sonar'.*sonar_fx\.compile"),
        ({}, {"fp16": True}, r"schedule='deferred'.*bf16=True or fp32"),
    ],
)
def test_settings_that_would_train_differently_are_refused(tmp_path, cfg_changes, arg_overrides, match):
    _, build = _sonar_trainer(tmp_path, cfg_changes, **arg_overrides)
    with pytest.raises(sonar_fx.SonarUsageError, match=match):
        build()


def test_a_deferred_model_that_clips_otherwise_than_the_arguments_is_refused(tmp_path):
    """Under the deferred schedule Sonar's step() is the one clip: it must clip as the arguments say."""
    _, build = _sonar_trainer(tmp_path, compile_kwargs={"schedule": "deferred"})  # Sonar's clip off
    with pytest.raises(
        sonar_fx.SonarUsageError, match=r"clips to max_grad_norm=None, the TrainingArguments to 0\.5"
    ):
        build()
    _, build = _sonar_trainer(
        tmp_path, {"max_grad_norm": 0.5, "expert_clip": "global"}, {"schedule": "deferred"},
        gradient_accumulation_steps=2,
    )  # fmt: skip
    assert build().sonar.schedule == "deferred"  # prepared by the user as SonarTrainer would: accepted


def test_a_model_compiled_without_the_trainers_decay_groups_is_refused(tmp_path):
    """weight_decay > 0 and a config built without the model (every tensor decayed): refused when the
    Trainer is built, before any weight moves, naming the tensors and the fix."""
    args = training_args(tmp_path)
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), sonar_config(args), compiler="eager")
    with pytest.raises(sonar_fx.SonarUsageError, match=r"norm\.weight \(0\.01 where the Trainer uses 0\.0\).*"
                       r"sonar_config\(args, model=model\)"):  # fmt: skip
        SonarTrainer(model=model, args=args, **trainer_data())


def test_another_optimizer_and_late_trainable_parameters_are_refused(tmp_path):
    model, build = _sonar_trainer(tmp_path)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(sonar_fx.SonarUsageError, match=r"optimizers=\(AdamW"):
        build(optimizers=(adamw, None))
    model.model.extra_scale = nn.Parameter(torch.ones(1))  # e.g. an adapter added after compile
    with pytest.raises(sonar_fx.SonarUsageError, match=r"model\.extra_scale"):
        build()


def test_per_microbatch_accumulation_when_asked(tmp_path):
    """gradient_accumulation_steps=2 with accumulation='per_microbatch': one expert update per
    micro-batch (announced), one dense step per optimizer step."""
    model, build = _sonar_trainer(
        tmp_path,
        compile_kwargs={"accumulation": "per_microbatch"},
        gradient_accumulation_steps=2,
        max_steps=2,
    )
    trainer = build()
    with pytest.warns(UserWarning, match="once per micro-batch"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert model.sonar.report()["updates_by_hook"] == 2 * 2 * 4
    dense = model.sonar.state[model.model.embed_tokens.weight]
    assert dense["step"].item() == 2


def _lora_with_trainable_experts(model):
    """LoRA on attention, experts fully trained: a PeftModel wrapping the MoE model."""
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in wrapped.named_parameters():
        if ".mlp.experts." in name:  # PEFT froze every base parameter
            param.requires_grad_(True)
    return wrapped


def test_peft_applied_before_compile_trains_exactly_and_after_compile_is_refused(tmp_path):
    args = training_args(tmp_path, max_steps=2)
    standard = _lora_with_trainable_experts(build_model("tiny-qwen3moe", seed=0))
    standard_trainer(standard, training_args(tmp_path, max_steps=2), **trainer_data()).train()

    model = _lora_with_trainable_experts(build_model("tiny-qwen3moe", seed=0))
    model = sonar_fx.compile(model, sonar_config(args, model=model), compiler="eager")
    trainer = SonarTrainer(model=model, args=args, **trainer_data())
    trainer._set_signature_columns_if_needed()  # the Trainer reads the base model's forward under PEFT
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    trainer.train()
    assert model.sonar.report()["updates_by_hook"] == 2 * 4
    assert_same_weights(model, standard)
    moved = weights_differ(model, _lora_with_trainable_experts(build_model("tiny-qwen3moe", seed=0)))
    assert any("lora_B" in n for n in moved) and any("experts" in n for n in moved)

    qwen = build_model("tiny-qwen3moe", seed=0)
    late = _lora_with_trainable_experts(sonar_fx.compile(qwen, sonar_config(args, model=qwen)))
    with pytest.raises(sonar_fx.SonarUsageError, match="lora_A"):
        SonarTrainer(model=late, args=args, **trainer_data())


def test_the_example_fine_tunes_and_the_held_out_loss_falls(tmp_path):
    from examples.hf_trainer_alpaca import main

    result = main(
        ["--compiler", "eager", "--steps", "2", "--records", "24", "--held-out", "8", "--out", str(tmp_path)]
    )
    assert result["eval_loss_after"] < result["eval_loss_before"]


def test_a_sonar_optimizer_other_than_adamw_is_refused(tmp_path):
    args = training_args(tmp_path)
    cfg = sonar_fx.LionConfig(lr=args.learning_rate, max_grad_norm=None)
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), cfg, compiler="eager")
    with pytest.raises(sonar_fx.SonarUsageError, match="built with LionConfig"):
        SonarTrainer(model=model, args=args, **trainer_data())
