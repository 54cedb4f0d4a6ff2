"""Planning a run: validated flags, the output folder, the data and the checkpoint to resume.

For: `plan_run(cfg) -> RunPlan`, everything a run needs decided before any model is built: the flags
(`validate`), whether `--out` may be written (a fresh run never overwrites a run by accident), the
tokenizer, records, split and encoded examples, the resolved config, and the verified checkpoint of a
resumed run. Never: build a model, train, or change a file in `--out` (an `--overwrite` is carried out
by the trainer once the whole plan is valid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sonar_fx import data as D
from sonar_fx.config import OptimizerConfig
from sonar_fx.models import TINY_MODELS
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.config import ConfigError, TrainConfig, run_identity
from sonar_fx.trainer.parallel import Parallel, from_env
from sonar_fx.trainer.rundir import run_files
from sonar_fx.trainer.validate import check_flags, check_overrides, resolve

BUILTIN_TRAIN, BUILTIN_HELD_OUT = 8000, 500  # the paper's Alpaca split sizes


@dataclass
class RunPlan:
    """A validated run: resolved config, data and (when resuming) the verified checkpoint."""

    cfg: TrainConfig
    opt_cfg: OptimizerConfig
    tokenizer: D.Tokenizer
    train: D.EncodedSet
    held_out: list[D.Example]
    data_hash: str
    out: Path
    checkpoint: dict[str, Any] | None
    """The loaded checkpoint of a resumed run (freed once restored into the model and optimizers)."""
    checkpoint_path: Path | None = None
    start: int = 0
    """The step the run starts from: 0, or the checkpoint's."""
    parallel: Parallel = field(default_factory=Parallel)
    """This process's place in the run (one process by default)."""

    @property
    def identity(self) -> dict[str, Any]:
        return run_identity(self.cfg, self.data_hash)

    @property
    def steps(self) -> int:
        assert self.cfg.steps is not None  # resolved
        return self.cfg.steps

    @property
    def end(self) -> int:
        """The step this process stops after (`--stop-after`, else the last step)."""
        return min(self.steps, self.cfg.stop_after or self.steps)

    @property
    def nothing_to_do(self) -> str | None:
        """Why a resumed run has no step left to run (it then changes no file), or None."""
        if self.start >= self.steps:
            return f"already finished: the checkpoint is at step {self.start} of {self.steps}"
        if self.start >= self.end:
            return f"already at step {self.start} (--stop-after {self.cfg.stop_after})"
        return None


def plan_run(cfg: TrainConfig) -> RunPlan:
    """Validate everything and load the data; raises before any model is built or file changed."""
    check_flags(cfg)
    parallel = from_env(cfg.parallel, cfg.ep_size)
    parallel.check(cfg.method, cfg.execution)
    check_overrides(cfg.model, cfg.model_overrides)
    out = _writable_dir(cfg.out)
    local = cfg.model not in TINY_MODELS
    if local and not Path(cfg.model).is_dir():
        raise ConfigError(
            f"--model {cfg.model!r}: not a built-in model ({', '.join(TINY_MODELS)}) nor a local "
            "checkpoint directory; pick a built-in name or pass the directory of a saved model",
            flag="--model",
        )
    resume_path = (
        None if cfg.resume is None else ckpt_io.resolve_path(out if cfg.resume == "auto" else cfg.resume)
    )
    _check_out_is_free(cfg, out, resume_path)
    tokenizer = _tokenizer(cfg.tokenizer or (cfg.model if local else "byte"))
    train_records, held_records = _records(cfg)
    train = D.encode_records(train_records, tokenizer, cfg.max_len)
    held = D.encode_records(held_records, tokenizer, cfg.max_len).examples if held_records else []
    cfg, opt_cfg = resolve(cfg, local=local, n_train=len(train.examples), n_held_out=len(held_records))
    stream = D.BatchStream(train.examples, cfg.batch_size, seed=cfg.seed, pad_id=tokenizer.pad_id)
    plan = RunPlan(cfg, opt_cfg, tokenizer, train, held, D.data_hash(stream), out, None, parallel=parallel)
    if resume_path is not None:
        resume_path = parallel.checkpoint_path(resume_path)  # sharded engines: this rank's own file
        plan.checkpoint = ckpt_io.load_checkpoint(resume_path)
        plan.checkpoint_path = resume_path
        plan.start = int(plan.checkpoint["step"])
        ckpt_io.check_identity(resume_path, plan.checkpoint["identity"], plan.identity)
    return plan


def _writable_dir(out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".sonar-fx-write-test.{os.getpid()}"  # one per process: torchrun starts several
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--out {out}: cannot write there ({exc.strerror}); pick a writable folder", flag="--out"
        ) from exc
    return path


def _check_out_is_free(cfg: TrainConfig, out: Path, resume_path: Path | None) -> None:
    """A fresh run (or one resumed from another folder) never writes over a run in --out unasked."""
    if cfg.overwrite:
        return
    if resume_path is not None and resume_path.resolve().parent == out.resolve():
        return  # continuing the run that lives in --out
    held = run_files(out)
    if held:
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(held)}); continue it with --resume, replace it "
            "with --overwrite, or pick another --out",
            flag="--out",
        )


def _tokenizer(spec: str) -> D.Tokenizer:
    try:
        return D.load_tokenizer(spec)
    except ValueError as exc:
        raise ConfigError(f"--tokenizer: {exc}", flag="--tokenizer") from exc


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
