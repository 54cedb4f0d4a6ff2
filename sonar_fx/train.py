"""Fine-tuning loop: one run of a training method on Alpaca-format data, from a frozen `TrainConfig`.

For: validating every input before the first step (data, model, tokenizer, flags, output folder,
resume checkpoint), building the model and the method (`sonar_fx.methods.build_method`), linear
warm-up then cosine LR on every optimizer the method has, held-out evaluation, a progress bar,
`metrics.jsonl` (one line per step), `summary.json`, checkpoints and bitwise resume.
Never: change a method's arithmetic (each step is `TrainingMethod.train_step`), contact a hub, or start
training on input it has not validated: bad input raises `ConfigError`, `DataError` or
`CheckpointError` naming the flag, file or line and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from tqdm import tqdm

from sonar_fx import checkpoint as ckpt_io
from sonar_fx import data as D
from sonar_fx.api import COMPILERS
from sonar_fx.config import AdamWConfig
from sonar_fx.methods import METHODS, TrainingMethod, build_method
from sonar_fx.models import TINY_MODELS, build_model
from sonar_fx.train_loop import StepLoop

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BUILTIN_TRAIN, BUILTIN_HELD_OUT = 8000, 500  # the paper's Alpaca split sizes
IDENTITY_FIELDS = (
    "model", "model_overrides", "dtype", "method", "compiler", "sonar_pass", "steps", "batch_size",
    "max_len", "lr", "warmup", "min_lr", "betas", "eps", "weight_decay", "max_grad_norm", "seed",
    "train_size", "held_out", "pad_to_max_len", "deterministic",
)  # fmt: skip


class ConfigError(ValueError):
    """A flag or config value is invalid; the message names the flag and the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One fine-tuning run; None fields are resolved by `prepare` (see each field)."""

    model: str = "tiny-olmoe"
    """A built-in tiny model (`sonar_fx.models.TINY_MODELS`) or a local checkpoint directory."""
    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Config fields of a built-in tiny model to override (e.g. num_experts)."""
    data: str | None = None
    """Alpaca .json / .jsonl file; None: the built-in synthetic instruction set."""
    tokenizer: str | None = None
    """"byte" or a local tokenizer directory; None: "byte" for tiny models, the model directory otherwise."""
    method: str = "sonar"
    """One of `sonar_fx.methods.METHODS`."""
    compiler: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """"eager" runs the model uncompiled; the others torch.compile it (sonar: with the graph pass)."""
    sonar_pass: bool = True
    """Sonar under a compiler: False keeps the eager hooks on a compiled model (what the pass improves on)."""
    steps: int | None = None
    """Optimizer steps; None: one pass over the training split."""
    batch_size: int = 2
    max_len: int = 256
    """Tokens per example (longer examples are truncated)."""
    lr: float | None = None
    """Peak LR; None: 2e-5 (the paper's) for a checkpoint, 3e-3 for a tiny model trained from scratch."""
    warmup: int | None = None
    """Linear warm-up steps; None: 3% of the steps."""
    min_lr: float = 0.0
    """The cosine decay ends at this LR on the last step."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Global-norm clip (which gradients it covers is the method's); None: no clipping."""
    seed: int = 42
    """Model init, split shuffle and batch order."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0: only before the first and after the last step)."""
    held_out: int | None = None
    """Held-out examples; None: 500 (the paper's), 0: no evaluation."""
    train_size: int | None = None
    """Training examples; None: 8000 for the built-in set, every record not held out for a file."""
    dtype: Literal["bf16", "fp32"] | None = None
    """Weights, gradients and optimizer states; None: bf16 on CUDA, fp32 on CPU (CPU bf16 GEMMs are slow)."""
    device: str | None = None
    """None: "cuda" when available, else "cpu"."""
    out: str = "runs/finetune"
    """Folder for metrics.jsonl, summary.json and checkpoint.pt."""
    resume: str | None = None
    """A checkpoint file or run folder to continue from (bitwise, when every setting matches)."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps, as a preempted job would; the LR schedule still
    spans `steps`."""
    checkpoint: bool = True
    """Write checkpoint.pt at all (the demo does not keep one per arm)."""
    pad_to_max_len: bool | None = None
    """Pad every batch to max_len; None: when compiled, so the graph compiles once for one shape."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms(True)` for the run: inductor's CPU kernels (e.g. the embedding
    backward) otherwise accumulate in parallel, so two compiled fp32 runs can differ in the last bit
    (CUDA also needs CUBLAS_WORKSPACE_CONFIG=:4096:8)."""
    progress: bool = True


@dataclass
class Prepared:
    """A validated run: resolved config, data and (when resuming) the checkpoint."""

    cfg: TrainConfig
    opt_cfg: AdamWConfig
    tokenizer: D.Tokenizer
    train: D.EncodedSet
    held_out: list[D.Example]
    data_hash: str
    out: Path
    checkpoint: dict[str, Any] | None

    @property
    def identity(self) -> dict[str, Any]:
        fields = {k: getattr(self.cfg, k) for k in IDENTITY_FIELDS}
        fields["model_overrides"] = dict(sorted(self.cfg.model_overrides.items()))
        return {**fields, "data": self.data_hash}


@dataclass
class RunResult:
    summary: dict[str, Any]
    model: nn.Module
    method: TrainingMethod


class WarmupCosine:
    """LR multiplier: linear warm-up to 1, then cosine to `min_ratio` at the last step.

    A class, not a closure, so `LambdaLR.state_dict()` saves its fields with the checkpoint.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup  # +1: the first step already learns
        progress = min(1.0, (step - self.warmup) / max(1, self.total - 1 - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------ validation


def prepare(cfg: TrainConfig) -> Prepared:
    """Validate everything and load the data; raises before any model is built or trained."""
    _check_flags(cfg)
    out = _writable_dir(cfg.out)
    local = cfg.model not in TINY_MODELS
    if local and not Path(cfg.model).is_dir():
        raise ConfigError(
            f"--model {cfg.model!r}: not a built-in model ({', '.join(TINY_MODELS)}) nor a local "
            "checkpoint directory; pick a built-in name or pass the directory of a saved model"
        )
    if local and cfg.model_overrides:
        raise ConfigError("--model-override applies to built-in tiny models only; drop it for a checkpoint")
    tokenizer = _tokenizer(cfg.tokenizer or (cfg.model if local else "byte"))
    train_records, held_records = _records(cfg)
    train = D.encode_records(train_records, tokenizer, cfg.max_len)
    held = D.encode_records(held_records, tokenizer, cfg.max_len).examples if held_records else []
    cfg = _resolve(cfg, local=local, n_train=len(train.examples))
    opt_cfg = _adamw_config(cfg)
    stream = D.BatchStream(train.examples, cfg.batch_size, seed=cfg.seed, pad_id=tokenizer.pad_id)
    prep = Prepared(cfg, opt_cfg, tokenizer, train, held, D.data_hash(stream), out, None)
    if cfg.resume is not None:
        path = ckpt_io.resolve_path(out if cfg.resume == "auto" else cfg.resume)
        prep.checkpoint = ckpt_io.load_checkpoint(path)
        prep.checkpoint["path"] = str(path)
        ckpt_io.check_identity(path, prep.checkpoint["identity"], prep.identity)
    return prep


def _check_flags(cfg: TrainConfig) -> None:
    checks = [
        (cfg.method in METHODS, "--method", f"one of {', '.join(METHODS)}"),
        (cfg.compiler in COMPILERS, "--compiler", f"one of {', '.join(COMPILERS)}"),
        (cfg.dtype in (None, *DTYPES), "--dtype", f"one of {', '.join(DTYPES)}"),
        (cfg.steps is None or cfg.steps >= 1, "--steps", ">= 1"),
        (cfg.batch_size >= 1, "--batch-size", ">= 1"),
        (cfg.max_len >= 2, "--max-len", ">= 2"),
        (cfg.warmup is None or cfg.warmup >= 0, "--warmup", ">= 0"),
        (cfg.min_lr >= 0, "--min-lr", ">= 0"),
        (cfg.eval_every >= 0, "--eval-every", ">= 0"),
        (cfg.held_out is None or cfg.held_out >= 0, "--held-out", ">= 0"),
        (cfg.train_size is None or cfg.train_size >= 1, "--train-size", ">= 1"),
        (cfg.save_every >= 0, "--save-every", ">= 0"),
        (cfg.stop_after is None or cfg.stop_after >= 1, "--stop-after", ">= 1"),
    ]
    for ok, flag, expected in checks:
        if not ok:
            value = getattr(cfg, flag[2:].replace("-", "_"))
            raise ConfigError(f"{flag} {value!r} is invalid: expected {expected}")
    if cfg.device is not None and cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {cfg.device}: CUDA is not available here; use --device cpu")


def _writable_dir(out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".sonar-fx-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--out {out}: cannot write there ({exc.strerror}); pick a writable folder"
        ) from exc
    return path


def _tokenizer(spec: str) -> D.Tokenizer:
    try:
        return D.load_tokenizer(spec)
    except ValueError as exc:
        raise ConfigError(f"--tokenizer: {exc}") from exc


def _records(cfg: TrainConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    held = BUILTIN_HELD_OUT if cfg.held_out is None else cfg.held_out
    if cfg.data is None:
        n_train = cfg.train_size or BUILTIN_TRAIN
        records = D.synthetic_records(n_train + held, seed=0)
    else:
        records = D.load_records(cfg.data)
        n_train = cfg.train_size or len(records) - held
        if n_train < 1:
            raise D.DataError(
                f"{cfg.data}: {len(records)} records leave none for training after --held-out {held}; "
                "lower --held-out or add records"
            )
    try:
        return D.split_records(records, n_train, held, seed=cfg.seed)
    except D.DataError as exc:
        raise D.DataError(f"{cfg.data or 'built-in data'}: {exc} (flags --train-size, --held-out)") from exc


def _resolve(cfg: TrainConfig, *, local: bool, n_train: int) -> TrainConfig:
    if n_train < cfg.batch_size:
        raise D.DataError(
            f"only {n_train} training examples for --batch-size {cfg.batch_size}; lower the batch size or "
            "add data (--train-size, --data)"
        )
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    steps = cfg.steps or n_train // cfg.batch_size
    lr = cfg.lr if cfg.lr is not None else (2e-5 if local else 3e-3)
    if cfg.min_lr > lr:
        raise ConfigError(f"--min-lr {cfg.min_lr} is above --lr {lr}: the cosine decays down to --min-lr")
    return dataclasses.replace(
        cfg,
        device=device,
        steps=steps,
        lr=lr,
        warmup=cfg.warmup if cfg.warmup is not None else math.ceil(0.03 * steps),
        dtype=cfg.dtype or ("bf16" if device.startswith("cuda") else "fp32"),
        held_out=BUILTIN_HELD_OUT if cfg.held_out is None else cfg.held_out,
        train_size=n_train,
        pad_to_max_len=cfg.pad_to_max_len if cfg.pad_to_max_len is not None else cfg.compiler != "eager",
    )


def _adamw_config(cfg: TrainConfig) -> AdamWConfig:
    assert cfg.lr is not None
    try:
        return AdamWConfig(
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
        )  # fmt: skip
    except ValueError as exc:
        match = re.search(r"AdamWConfig\.(\w+)", str(exc))
        flag = "--" + match.group(1).replace("_", "-") if match else "an optimizer flag"
        raise ConfigError(f"{flag}: {exc}") from exc


# -------------------------------------------------------------------------------------- building


def build(prep: Prepared) -> tuple[nn.Module, TrainingMethod, list[torch.optim.lr_scheduler.LambdaLR]]:
    """Model (seeded init, or the checkpoint's weights), method and LR schedulers, ready to train."""
    cfg = prep.cfg
    assert cfg.dtype is not None and cfg.steps is not None and cfg.warmup is not None and cfg.lr
    model = build_model(cfg.model, dtype=DTYPES[cfg.dtype], seed=cfg.seed, **cfg.model_overrides)
    model = model.to(cfg.device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and prep.tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"--tokenizer has {prep.tokenizer.vocab_size} ids but --model {cfg.model} embeds only {vocab}; "
            "use the model's own tokenizer"
        )
    if prep.checkpoint is not None:
        ckpt_io.check_model_state(Path(prep.checkpoint["path"]), model, prep.checkpoint["model"])
    method = build_method(cfg.method, model, prep.opt_cfg, compiler=cfg.compiler, sonar_pass=cfg.sonar_pass)
    shape = WarmupCosine(cfg.warmup, cfg.steps, cfg.min_lr / cfg.lr)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, shape) for opt in method.optimizers]
    if prep.checkpoint is not None:
        ckpt_io.restore(prep.checkpoint, model=model, optimizers=method.optimizers, schedulers=schedulers)
    return model, method, schedulers


# -------------------------------------------------------------------------------------- training


def train(cfg: TrainConfig) -> RunResult:
    """Validate, build, train, evaluate and write metrics.jsonl, summary.json and checkpoint.pt."""
    started = time.perf_counter()
    prep = prepare(cfg)
    cfg = prep.cfg
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        # Global state, so set for this run only; compiled graphs are generated under it (first step).
        torch.use_deterministic_algorithms(cfg.deterministic or deterministic)
        model, method, schedulers = build(prep)
        start = int(prep.checkpoint["step"]) if prep.checkpoint else 0
        stream = D.BatchStream(
            prep.train.examples, cfg.batch_size, seed=cfg.seed, pad_id=prep.tokenizer.pad_id
        )
        if prep.checkpoint:
            stream.load_state_dict(prep.checkpoint["stream"])
            prep.checkpoint = None  # free its tensors: they now live in the model and optimizers
        _announce(prep, start)
        loop = StepLoop(prep, model, method, schedulers, stream, start)
        loop.run()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    summary = loop.summary(time.perf_counter() - started)
    (prep.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return RunResult(summary, model, method)


def _announce(prep: Prepared, start: int) -> None:
    cfg, train = prep.cfg, prep.train
    source = cfg.data or "built-in synthetic instructions"
    lines = [
        f"sonar-fx finetune: {cfg.model}, {cfg.method}, --compiler {cfg.compiler}, {cfg.dtype}, {cfg.device}",
        f"data: {source}: {len(train.examples)} train, {len(prep.held_out)} held-out examples "
        f"({train.n_dropped} dropped, {train.n_truncated} truncated at --max-len {cfg.max_len}); "
        f"hash of the first batches {prep.data_hash[:16]}",
    ]
    if start:
        lines.append(f"resuming at step {start} of {cfg.steps}")
    for line in lines:
        tqdm.write(line)
