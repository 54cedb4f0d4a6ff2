"""Sonar in transformers' `Trainer`: the optimizer, the one gradient clip, and the checks, in one place.

For: the one supported way to train an MoE model with `Trainer` under Sonar, or with any Trainer
subclass through `SonarTrainerMixin` (TRL's `SFTTrainer`: `sonar_fx.integrations.sft`). Swapping the
class is the whole migration:

    args = TrainingArguments(output_dir=..., gradient_accumulation_steps=4, ...)   # any defaults
    SonarTrainer(model=model, args=args, train_dataset=..., data_collator=...).train()

trains bitwise as `Trainer(model=model, args=args, ...)` does (`sonar_compiler="inductor"` compiles the
model with the graph pass; default "eager", as the Trainer runs it).
- Schedule (`trainer_schedule`): the Trainer clips every parameter (`max_grad_norm > 0`, its default),
  accumulates (`gradient_accumulation_steps > 1`) and scales an fp16 loss, all at the end of the step:
  an unprepared model is prepared with schedule="deferred" for any of these (expert gradients computed
  at `step()` from operands kept in backward) and with the in-backward schedule otherwise (the same
  arithmetic, fastest). A model the user prepared keeps its schedule; an in-backward one clips only
  the dense gradients (the Trainer's clip sees no expert `.grad`) and refuses accumulation and fp16.
- Optimizer: `model.sonar`, torch's fused AdamW (`optim="adamw_torch_fused"`, the Trainer's default;
  every other `optim` is refused), whose hyper-parameters come from the Trainer's own arguments
  (`sonar_config`), with biases and norm weights, dense or expert, in a no-decay group by the Trainer's
  own rule; scheduler: the Trainer's own, which drives every group alike. `model_init=` models are
  prepared as `model=` is.
- The logged `grad_norm`: the norm over every gradient before clipping, as the plain Trainer logs it
  (`hf_deferred.norm_over_every_parameter` where Sonar does not clip).
- Clipping, exactly once: deferred, by Sonar's `step()` (one global norm over every parameter with the
  Trainer's `max_grad_norm`; the Trainer's own clip is switched off, and the norm it logs is Sonar's);
  in-backward, by the Trainer (Sonar's clip off: a second clip is not a no-op).
- Under torchrun (the Trainer's own DDP, built by accelerate): the model is prepared beside DDP as
  `sonar_fx.distributed.ddp` prepares it, and Sonar takes the Trainer's DDP module once it exists
  (`sonar_fx.integrations.hf_ddp`); the Trainer's FSDP, DeepSpeed and one-process DataParallel are
  refused.
- Checkpoints: the Trainer's own, with `optimizer.pt` and `scheduler.pt` in the plain Trainer's layout
  (dense and expert moments and steps in its decay / no-decay groups), so either Trainer resumes the
  other's checkpoint bitwise (`sonar_fx.integrations.hf_checkpoint`); expert weights that
  `save_pretrained` wrote in another layout are loaded through `from_pretrained`'s conversion.

Never: clip twice, accumulate gradients silently (in-backward experts are updated inside every
backward), ignore a Trainer argument that would change the optimizer, or leave a trainable parameter
out of the optimizer.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from sonar_fx.api import compile as sonar_compile
from sonar_fx.api import sonar_of
from sonar_fx.config import AdamWConfig, WeightDecayGroup
from sonar_fx.errors import SonarUsageError
from sonar_fx.integrations.hf_checkpoint import (
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    has_trainer_layout,
    load_converted_weights_,
    load_either_layout,
    save_in_trainer_layout,
    trainer_groups,
)
from sonar_fx.integrations.hf_ddp import (
    attach_to_trainer_ddp,
    prepare_beside_trainer_ddp,
    refuse_one_process_model,
    trainer_engine,
)
from sonar_fx.integrations.hf_deferred import DeferredStep, norm_over_every_parameter
from sonar_fx.optim.optimizer import Schedule, SonarOptimizer

try:
    from transformers import (
        PreTrainedTokenizerFast,
        Trainer,
        TrainingArguments,
    )
except ImportError as err:  # Trainer needs accelerate, which only the extra brings
    raise ImportError(
        f"sonar_fx.integrations.hf needs transformers' Trainer ({err}); install the extra: "
        "pip install 'sonar-fx[hf]'"
    ) from err

__all__ = [
    "SonarTrainer",
    "SonarTrainerMixin",
    "byte_tokenizer",
    "check_trainer_setup",
    "prepare_for_trainer",
    "sonar_config",
    "trainer_schedule",
]

SONAR_OPTIMS = ("adamw_torch_fused",)
"""`TrainingArguments.optim` values Sonar computes: torch's fused AdamW (the Trainer's default)."""


def _trainer_clips(args: TrainingArguments) -> bool:
    return args.max_grad_norm is not None and args.max_grad_norm > 0


def trainer_schedule(args: TrainingArguments) -> Schedule:
    """The schedule under which Sonar trains as the Trainer does with `args`: "deferred" when the Trainer
    clips every parameter, accumulates or scales an fp16 loss (facts known only at the end of the step);
    otherwise "in_backward" (the same arithmetic, the fastest path)."""
    end_of_step = _trainer_clips(args) or args.gradient_accumulation_steps > 1 or args.fp16
    return "deferred" if end_of_step else "in_backward"


def sonar_config(
    args: TrainingArguments,
    schedule: Schedule = "in_backward",
    *,
    model: nn.Module | None = None,
    decay_names: Collection[str] | None = None,
) -> AdamWConfig:
    """The `AdamWConfig` for `sonar_fx.compile(model, ..., schedule=schedule)` from the Trainer's own
    arguments. "deferred": Sonar clips, with the Trainer's `max_grad_norm`, one norm over every parameter
    (the Trainer's clip is then switched off). "in_backward": Sonar's clip off; the Trainer clips, once,
    and that clip sees only dense gradients.
    With `weight_decay > 0` pass `model`: the Trainer exempts biases and norm weights from decay (its
    `get_decay_parameter_names`, or `decay_names` when a Trainer subclass decides otherwise), and the
    config puts those trainable tensors, dense or expert, in a group with weight_decay 0.0."""
    clip = args.max_grad_norm if schedule == "deferred" and _trainer_clips(args) else None
    groups: tuple[WeightDecayGroup, ...] = ()
    if args.weight_decay > 0 and model is not None:
        exempt = no_decay_names(model, trainer_decay_names(model) if decay_names is None else decay_names)
        groups = (WeightDecayGroup(params=exempt, weight_decay=0.0),) if exempt else ()
    return AdamWConfig(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        weight_decay_groups=groups,
        max_grad_norm=clip,
        expert_clip="global" if clip is not None else None,
    )


def trainer_decay_names(model: nn.Module) -> list[str]:
    """The names the plain Trainer's AdamW decays (`Trainer.get_decay_parameter_names`, which reads only
    the model): everything but biases and norm weights."""
    return Trainer.get_decay_parameter_names(cast(Any, None), model)


def no_decay_names(model: nn.Module, decay_names: Collection[str]) -> tuple[str, ...]:
    """The trainable parameters the Trainer's AdamW leaves undecayed (its second param group)."""
    decay = set(decay_names)
    return tuple(n for n, p in model.named_parameters() if p.requires_grad and n not in decay)


def prepare_for_trainer(
    model: nn.Module,
    args: TrainingArguments,
    *,
    compiler: str = "eager",
    decay_names: Collection[str] | None = None,
) -> nn.Module:
    """`sonar_fx.compile` `model` so that it trains as the Trainer would with `args` (the schedule of
    `trainer_schedule`, the config of `sonar_config`). `compiler="eager"`: hooks, no torch.compile, as
    the Trainer runs a model by default; "aot_eager" or "inductor": the graph pass. Under torchrun,
    beside the DDP module the Trainer will build (`sonar_fx.integrations.hf_ddp`)."""
    schedule = trainer_schedule(args)
    cfg = sonar_config(args, schedule, model=model, decay_names=decay_names)
    if trainer_engine(args) == "ddp":
        return prepare_beside_trainer_ddp(model, cfg, args.device, compiler=compiler, schedule=schedule)
    return sonar_compile(model, cfg, compiler=compiler, schedule=schedule)  # type: ignore[arg-type]


def check_trainer_setup(
    args: TrainingArguments,
    model: nn.Module,
    optimizer: SonarOptimizer,
    decay_names: Collection[str] | None = None,
) -> None:
    """Refuse, naming the fix, every Trainer setting under which Sonar would train differently from what
    the arguments say (the mixin runs this when the Trainer is built and when it creates the optimizer).
    `decay_names`: what the Trainer decays (default: `trainer_decay_names(model)`)."""
    refuse_other_optim(args)
    refuse_torch_compile(args)
    if trainer_engine(args) == "ddp":
        refuse_one_process_model(optimizer)
    if optimizer.schedule == "deferred":
        _check_deferred_clip(args, optimizer)
    else:
        _check_in_backward(args, optimizer)
    _check_hyperparameters(args, optimizer)
    _check_trainable(model, optimizer)
    _check_weight_decay(
        args, model, optimizer, trainer_decay_names(model) if decay_names is None else decay_names
    )


def refuse_other_optim(args: TrainingArguments) -> None:
    """Sonar computes torch's fused AdamW: every other `optim` would train with other arithmetic."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim == "adamw_torch" and not args.optim_args:
        raise SonarUsageError(
            "TrainingArguments(optim='adamw_torch') runs torch's AdamW without fused=True (foreach "
            "kernels on a GPU, one tensor at a time on CPU), which rounds otherwise than the fused kernel "
            "Sonar computes (every expert update is one fused call). Set optim='adamw_torch_fused', the "
            "Trainer's default: the same AdamW, in torch's fused kernel."
        )
    if optim not in SONAR_OPTIMS or args.optim_args:
        raise SonarUsageError(
            f"TrainingArguments(optim={optim!r}, optim_args={args.optim_args!r}): Sonar computes torch's "
            "fused AdamW only (its expert update is one element-wise fused call per tensor, inside backward "
            "or at the step). Set optim='adamw_torch_fused' (the Trainer's default) without optim_args, or "
            "train with the plain Trainer."
        )


def _check_in_backward(args: TrainingArguments, optimizer: SonarOptimizer) -> None:
    if args.fp16:
        raise SonarUsageError(
            "TrainingArguments(fp16=True) scales the loss with a GradScaler, whose unscale and inf check "
            "run after the in-backward schedule has updated the experts from the scaled gradients. Let "
            "SonarTrainer prepare the model (schedule='deferred', which joins the scaler's verdict), "
            "or use bf16=True or fp32."
        )
    _check_accumulation(args, optimizer)
    _check_clip(args, optimizer)


def _check_deferred_clip(args: TrainingArguments, optimizer: SonarOptimizer) -> None:
    """Deferred: Sonar's step() is the one clip; it must clip as the Trainer's arguments say."""
    cfg, wanted = optimizer.cfg, sonar_config(args, "deferred")
    if cfg.max_grad_norm != wanted.max_grad_norm:
        raise SonarUsageError(
            f"model.sonar (schedule='deferred') clips to max_grad_norm={cfg.max_grad_norm}, the "
            f"TrainingArguments to {args.max_grad_norm}: under the deferred schedule Sonar's step() is the "
            "one clip (the Trainer's is switched off). Compile with "
            "sonar_fx.integrations.hf.sonar_config(args, 'deferred'), or pass the model unprepared."
        )


def refuse_torch_compile(args: TrainingArguments) -> None:
    """The Trainer's own compile (`torch_compile=True`) hands the backend to accelerate, which knows only
    its own backends (a "sonar" backend fails there) and would compile the model a second time."""
    if args.torch_compile:
        backend = args.torch_compile_backend
        raise SonarUsageError(
            f"TrainingArguments(torch_compile=True, torch_compile_backend={backend!r}): the Trainer compiles "
            "through accelerate, which accepts only its own backends (not 'sonar') and would compile the "
            "model a second time. Compile it yourself with the Sonar pass, sonar_fx.compile(model, "
            "sonar_config(args), compiler='inductor'), and set torch_compile=False."
        )


def _check_accumulation(args: TrainingArguments, optimizer: SonarOptimizer) -> None:
    steps = args.gradient_accumulation_steps
    if steps > 1 and optimizer.accumulation != "per_microbatch":
        raise SonarUsageError(
            f"TrainingArguments(gradient_accumulation_steps={steps}): Sonar updates the expert tensors "
            "inside every backward, so accumulating would update them once per micro-batch (a different "
            "optimizer). "
            "For exact accumulation, let SonarTrainer prepare the model (schedule='deferred'); for the "
            f"same effective batch in-backward, set gradient_accumulation_steps=1 and multiply "
            f"per_device_train_batch_size by {steps}; to train with one expert update per micro-batch on "
            "purpose, compile with sonar_fx.compile(..., accumulation='per_microbatch')."
        )


def _check_clip(args: TrainingArguments, optimizer: SonarOptimizer) -> None:
    if optimizer.cfg.clips:
        raise SonarUsageError(
            f"model.sonar clips the dense gradients itself (AdamWConfig.max_grad_norm="
            f"{optimizer.cfg.max_grad_norm}), and the Trainer clips them too when TrainingArguments."
            f"max_grad_norm > 0 (now {args.max_grad_norm}): a second clip is not a no-op. Clip once, in "
            "the Trainer: compile with sonar_fx.integrations.hf.sonar_config(args) (Sonar's clip off) and "
            "set the norm with TrainingArguments(max_grad_norm=...)."
        )


def _check_hyperparameters(args: TrainingArguments, optimizer: SonarOptimizer) -> None:
    wanted, built = sonar_config(args), optimizer.cfg
    if type(built) is not AdamWConfig:
        raise SonarUsageError(
            f"model.sonar was built with {type(built).__name__}, but the Trainer describes an AdamW run "
            "(TrainingArguments.optim, adam_beta1/2, adam_epsilon): compile with "
            "sonar_fx.integrations.hf.sonar_config(args), which builds the matching AdamWConfig."
        )
    fields = ("lr", "betas", "eps", "weight_decay")
    differ = [f"{f}: Trainer {getattr(wanted, f)!r}, model.sonar {getattr(built, f)!r}" for f in fields]
    differ = [d for f, d in zip(fields, differ, strict=True) if getattr(wanted, f) != getattr(built, f)]
    if differ:
        raise SonarUsageError(
            "model.sonar was built with other AdamW hyper-parameters than the TrainingArguments ("
            + "; ".join(differ)
            + "), so the Trainer's would be ignored. Compile with "
            "sonar_fx.integrations.hf.sonar_config(args)."
        )


def _check_weight_decay(
    args: TrainingArguments, model: nn.Module, optimizer: SonarOptimizer, decay_names: Collection[str]
) -> None:
    """Each tensor's weight decay in model.sonar must be the one the Trainer's AdamW gives it: `weight_decay`
    for the names the Trainer decays, 0.0 for the rest (biases, norm weights)."""
    decay = set(decay_names)
    label = {id(p): n for n, p in model.named_parameters()}
    differ = [
        f"{label[id(p)]} ({group['weight_decay']} where the Trainer uses {wanted})"
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in label
        and group["weight_decay"] != (wanted := args.weight_decay if label[id(p)] in decay else 0.0)
    ]
    if differ:
        raise SonarUsageError(
            f"model.sonar decays {len(differ)} tensor(s) otherwise than the Trainer's AdamW, which exempts "
            f"biases and norm weights (e.g. {'; '.join(differ[:3])}). Compile with "
            "sonar_fx.integrations.hf.sonar_config(args, model=model), which groups them as the Trainer "
            "does, or pass the model unprepared."
        )


def _check_trainable(model: nn.Module, optimizer: SonarOptimizer) -> None:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise SonarUsageError(
            f"{len(missing)} trainable parameter(s) are not in model.sonar (e.g. {', '.join(missing[:3])}): "
            "they were added or unfrozen after sonar_fx.compile (PEFT adapters, for one) and would never be "
            "updated. Add adapters and set requires_grad before sonar_fx.compile; with TRL, apply the PEFT "
            "config yourself first instead of passing peft_config."
        )


class SonarTrainerMixin:
    """Put before a `Trainer` class (`class T(SonarTrainerMixin, Trainer)`): its optimizer is
    `model.sonar` (an unprepared model is prepared by `prepare_for_trainer` with `sonar_compiler`), its
    scheduler the Trainer's own, and its arguments are checked when it is built."""

    sonar: SonarOptimizer

    def __init__(self, *args: Any, sonar_compiler: str = "eager", **kwargs: Any) -> None:
        self._sonar_compiler = sonar_compiler
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # before anything is prepared or handed to accelerate
            refuse_other_optim(training_args)
            refuse_torch_compile(training_args)  # accelerate would fail on it
            trainer_engine(training_args)  # FSDP, DeepSpeed, DataParallel: refused
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module) and not isinstance(getattr(model, "sonar", None), SonarOptimizer):
            if training_args is None:
                raise SonarUsageError(
                    f"{type(self).__name__}(model=<unprepared model>) without args: the TrainingArguments "
                    "decide how Sonar prepares the model (clip, accumulation); pass args=."
                )
            model = self._prepared(model, training_args)
            if "model" in kwargs:
                kwargs["model"] = model
            else:
                args = (model, *args[1:])
        super().__init__(*args, **kwargs)  # with model_init=, calls `call_model_init` (below)
        trainer: Any = self
        self.sonar = sonar_of(trainer.model)
        if trainer.optimizer is not None and trainer.optimizer is not self.sonar:
            raise SonarUsageError(
                f"optimizers=({type(trainer.optimizer).__name__}, ...): the optimizer of a Sonar model is "
                "model.sonar, whose expert group is updated inside backward. Pass "
                "optimizers=(None, scheduler) or leave it out; the scheduler may be your own."
            )
        if trainer.optimizer_cls_and_kwargs is not None:
            raise SonarUsageError(
                "optimizer_cls_and_kwargs cannot choose the optimizer of a Sonar model (it is model.sonar); "
                "leave it out."
            )
        self._check_setup()
        self._sonar_norm: Tensor | None = None
        trainer.add_callback(DeferredStep(self))  # idle under the in-backward schedule

    def _prepared(self, model: nn.Module, args: TrainingArguments) -> nn.Module:
        """`model` as `prepare_for_trainer` prepares it for `args`, unless it is prepared already."""
        if isinstance(getattr(model, "sonar", None), SonarOptimizer):
            return model
        decay_names = self.get_decay_parameter_names(model)  # type: ignore[attr-defined]
        return prepare_for_trainer(model, args, compiler=self._sonar_compiler, decay_names=decay_names)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """`model_init=`: each model it builds (one per `train()`, per hyper-parameter trial) is prepared
        as `model=` is, with the arguments of that trial; its `model.sonar` becomes the optimizer."""
        trainer: Any = self
        return self._prepared(super().call_model_init(trial), trainer.args)  # type: ignore[misc]

    def _check_setup(self) -> None:
        trainer: Any = self
        decay_names = trainer.get_decay_parameter_names(trainer.model)
        check_trainer_setup(trainer.args, trainer.model, self.sonar, decay_names)

    def create_optimizer(self, model: nn.Module | None = None) -> SonarOptimizer:
        trainer: Any = self
        self.sonar = sonar_of(trainer.model)  # model_init= may have built a new model since __init__
        self._check_setup()
        trainer.optimizer = self.sonar
        return self.sonar

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's preparation (accelerate wraps the model); under torchrun, Sonar then takes the
        DDP module it built, before the first step."""
        prepared = super()._prepare_for_training(*args, **kwargs)  # type: ignore[misc]
        trainer: Any = self
        if trainer_engine(trainer.args) == "ddp":
            attach_to_trainer_ddp(trainer.model_wrapped, trainer.model, self.sonar)
        return prepared

    def _clip_grad_norm(self, model: nn.Module) -> Tensor | None:
        if self.sonar.schedule == "deferred":
            return None  # Sonar's step() clips, once, with the norm of every gradient
        # In-backward: the Trainer's clip sees the dense gradients alone (the expert ones were applied
        # and freed in backward) and clips by their norm; the norm it logs is still over every one.
        logged = norm_over_every_parameter(self.sonar, self.sonar.clipper.current.experts)
        super()._clip_grad_norm(model)  # type: ignore[misc]
        return logged

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.sonar.schedule == "deferred":
            # The norm exists only inside step(): `DeferredStep` fills this before the Trainer logs it.
            self._sonar_norm = torch.full((), float("nan"))
            return self._sonar_norm
        if grad_norm is None:  # no clip: the norm the plain Trainer takes with max_norm=inf
            grad_norm = norm_over_every_parameter(self.sonar, self.sonar.clipper.current.experts)
        return super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]

    def _trainer_groups(self) -> list[list[Tensor]]:
        """The param groups the plain Trainer's AdamW would have over this model (decay, no decay)."""
        trainer: Any = self
        return trainer_groups(trainer.model, trainer.get_decay_parameter_names(trainer.model))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's save, then its two files rewritten in the plain Trainer's layout, so that either
        Trainer resumes the checkpoint (`sonar_fx.integrations.hf_checkpoint`)."""
        trainer: Any = self
        super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        folder = Path(output_dir)
        saved = trainer.args.should_save and (folder / OPTIMIZER_FILE).is_file()
        if saved and has_trainer_layout(self.sonar):
            save_in_trainer_layout(folder, self.sonar, self._trainer_groups(), trainer.args.weight_decay)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A checkpoint of either Trainer: the plain Trainer's state mapped tensor by tensor onto Sonar's
        groups, Sonar's loaded as is (the engines' own loaders, DeepSpeed's and FSDP's, are the Trainer's)."""
        trainer: Any = self
        folder = Path(checkpoint) if checkpoint is not None else None
        if (
            folder is None
            or not (folder / OPTIMIZER_FILE).is_file()
            or not (folder / SCHEDULER_FILE).is_file()
            or trainer.is_deepspeed_enabled
            or trainer.is_fsdp_enabled
        ):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        args = trainer.args
        where = args.device if args.world_size > 1 and args.device.type != "cpu" else "cpu"  # as the Trainer
        load_either_layout(folder, self.sonar, trainer.lr_scheduler, self._trainer_groups(), where)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        trainer: Any = self
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        load_converted_weights_(model if model is not None else trainer.model, Path(resume_from_checkpoint))

    def _load_best_model(self) -> None:
        trainer: Any = self
        super()._load_best_model()  # type: ignore[misc]
        load_converted_weights_(trainer.model, Path(trainer.state.best_model_checkpoint))


class SonarTrainer(SonarTrainerMixin, Trainer):
    """`transformers.Trainer` training a model compiled by `sonar_fx.compile` (see the module docstring)."""


def byte_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """The built-in byte tokenizer (`sonar_fx.data.ByteTokenizer`: bytes 0..255, PAD 256, BOS 257,
    EOS 258) as a transformers tokenizer, built in memory, for trainers that need one (TRL's
    `SFTTrainer`). It prepends BOS like `sonar_fx.data.encode_example`; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level pre-tokenization maps each byte to one printable character; BPE without merges then
    # keeps one token per byte, and the vocabulary gives byte b the id b.
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])  # ids 256, 257, 258
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 257)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )
