"""One fine-tuning run end to end: plan, build, train, write summary.json.

For: `train(cfg)` (what `sonar-fx finetune` and the demo call) and its two halves, `plan_run` and
`run_plan`, for callers that act on the plan first (the command line says "already finished"
without building a model). Never: write into `--out` before the whole plan is valid, or rewrite the
summary of a run it did not train.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from sonar_fx import data as D
from sonar_fx.config import ConfigFieldError
from sonar_fx.environment import Environment
from sonar_fx.memory import process_peak_rss_bytes
from sonar_fx.methods import Method, TrainingMethod, build_method
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.config import ConfigError, TrainConfig, config_record
from sonar_fx.trainer.loop import Outcome, Trainer
from sonar_fx.trainer.plan import RunPlan, plan_run
from sonar_fx.trainer.rundir import (
    SUMMARY,
    atomic_write_text,
    locked,
    remove_stale_temps,
    replace_run,
    to_json,
)
from sonar_fx.trainer.schedule import WarmupCosine
from sonar_fx.trainer.validate import build_checked_model, field_error


@dataclass
class RunResult:
    summary: dict[str, Any]
    model: nn.Module
    method: TrainingMethod
    outcome: Outcome


def train(cfg: TrainConfig) -> RunResult:
    """Validate, build, train, evaluate and write metrics.jsonl, summary.json and checkpoint.pt."""
    return run_plan(plan_run(cfg))


def build(plan: RunPlan) -> tuple[nn.Module, TrainingMethod, list[torch.optim.lr_scheduler.LambdaLR]]:
    """Model (seeded init, or the checkpoint's weights), method and LR schedulers, ready to train."""
    cfg = plan.cfg
    assert cfg.steps is not None and cfg.warmup is not None and cfg.lr and cfg.device is not None
    model = build_checked_model(cfg).to(cfg.device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and plan.tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"--tokenizer has {plan.tokenizer.vocab_size} ids but --model {cfg.model} embeds only {vocab}; "
            "use the model's own tokenizer",
            flag="--tokenizer",
        )
    parallel = plan.parallel
    if plan.checkpoint is not None and not parallel.sharded:  # sharded: checked on the sharded model below
        assert plan.checkpoint_path is not None
        ckpt_io.check_model_state(plan.checkpoint_path, model, plan.checkpoint["model"])
    sonar_kwargs: dict[str, Any] = {"nonfinite": cfg.nonfinite} if Method.named(cfg.method).sonar else {}
    try:
        method = build_method(cfg.method, model, plan.opt_cfg, execution=cfg.execution,
                              engine=parallel.engine, **sonar_kwargs)  # fmt: skip
    except ConfigFieldError as exc:  # the engine's check of the model (ep: the world; fsdp2_ep: --ep-size)
        raise field_error(exc) from exc
    shape = WarmupCosine(cfg.warmup, cfg.steps, cfg.min_lr / cfg.lr)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, shape) for opt in method.optimizers]
    if plan.checkpoint is not None:
        state_model, state_optimizers = parallel.checkpoint_views(model, method)
        if parallel.sharded:
            assert plan.checkpoint_path is not None
            ckpt_io.check_model_state(plan.checkpoint_path, state_model, plan.checkpoint["model"])
        ckpt_io.restore(
            plan.checkpoint, model=state_model, optimizers=state_optimizers, schedulers=schedulers
        )
    return model, method, schedulers


def run_plan(plan: RunPlan, *, handle_signals: bool = False) -> RunResult:
    """Train a planned run (see `train`); the output folder is locked for the whole run.
    `handle_signals`: SIGTERM/SIGINT stop at the next step boundary, with a checkpoint (see
    `sonar_fx.trainer.signals`); off by default, so a caller's own handlers stay in charge."""
    started = time.perf_counter()
    cfg = plan.cfg
    if plan.nothing_to_do:
        raise ConfigError(f"--resume: {plan.nothing_to_do}; nothing to train", flag="--resume")
    deterministic = torch.are_deterministic_algorithms_enabled()
    parallel = plan.parallel
    assert cfg.device is not None
    created = parallel.join(cfg.device)
    writer = parallel.writer
    try:
        with locked(plan.out) if writer else contextlib.nullcontext():
            result = _train_locked(plan, handle_signals, started, deterministic, writer)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    return result


def _train_locked(
    plan: RunPlan, handle_signals: bool, started: float, deterministic: bool, writer: bool
) -> RunResult:
    cfg = plan.cfg
    _check_same_start(plan)
    if writer:
        remove_stale_temps(plan.out)
    try:
        # Global state, so set for this run only; compiled graphs are generated under it (first step).
        torch.use_deterministic_algorithms(cfg.deterministic or deterministic)
        model, method, schedulers = build(plan)
        stream = D.BatchStream(
            plan.train.examples, cfg.batch_size, seed=cfg.seed, pad_id=plan.tokenizer.pad_id
        )
        if plan.checkpoint is not None:
            stream.load_state_dict(plan.checkpoint["stream"])
            plan.checkpoint = None  # free its tensors: they now live in the model and optimizers
        if cfg.overwrite and writer:  # only now: a run that cannot even be built replaces nothing
            replace_run(plan.out)
        if writer:
            _announce(plan)
        trainer = Trainer(plan, model, method, schedulers, stream, handle_signals=handle_signals)
        outcome = trainer.run()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    summary = _summary(plan, trainer, outcome, time.perf_counter() - started)
    if writer:
        atomic_write_text(plan.out / SUMMARY, to_json(summary, indent=2) + "\n")
    return RunResult(summary, model, method, outcome)


def _check_same_start(plan: RunPlan) -> None:
    """Every rank resumes from the same step (sharded engines read one checkpoint file per rank)."""
    parallel = plan.parallel
    start = parallel.from_writer(plan.start)
    if parallel.any_rank(start != plan.start):
        raise ckpt_io.CheckpointError(
            f"--resume: the ranks' checkpoints disagree (rank {parallel.rank} is at step {plan.start}, "
            f"rank 0 at step {start}): a save was cut short on some rank; start a fresh --out"
        )


def _summary(plan: RunPlan, trainer: Trainer, outcome: Outcome, wall_s: float) -> dict[str, Any]:
    cfg, stats = plan.cfg, trainer.stats
    assert cfg.device is not None
    memory = stats.memory()
    if cfg.device.startswith("cuda"):
        memory["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(cfg.device)
        memory["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(cfg.device)
    memory["process_peak_rss_bytes"] = process_peak_rss_bytes()
    optimizer = trainer.method.optimizer
    return {
        "config": config_record(cfg),
        "steps_done": outcome.steps_done,
        "stopped_by": outcome.stopped_by,
        "resumed_from_step": plan.start,
        "final_train_loss": stats.losses[-1] if stats.losses else None,
        "held_out_loss": stats.evals.get(outcome.steps_done),
        "held_out_loss_initial": stats.evals.get(0),
        "held_out_curve": {str(k): v for k, v in sorted(stats.evals.items())},
        "median_step_ms": stats.median_step_ms(),
        "timed_steps": len(stats.times),
        "supervised_tokens_per_s": stats.median_rate(),
        "supervised_tokens_per_s_overall": stats.overall_rate(),
        "memory": memory,
        "data": {
            "hash": plan.data_hash,
            "source": cfg.data or "built-in synthetic",
            "n_train": len(plan.train.examples),
            "n_held_out": len(plan.held_out),
            "n_dropped": plan.train.n_dropped,
            "n_truncated": plan.train.n_truncated,
        },
        "sonar": optimizer.report() if isinstance(optimizer, SonarOptimizer) else None,
        "wall_s": wall_s,
        "world_size": plan.parallel.world,
        **Environment.now(cfg.device).summary(),
    }


def _announce(plan: RunPlan) -> None:
    cfg, train = plan.cfg, plan.train
    source = cfg.data or "built-in synthetic instructions"
    lines = [
        f"sonar-fx finetune: {cfg.model}, {cfg.method}, --compiler {cfg.execution.compiler}, {cfg.dtype}, "
        f"{cfg.device}",
        f"data: {source}: {len(train.examples)} train, {len(plan.held_out)} held-out examples "
        f"({train.n_dropped} dropped, {train.n_truncated} truncated at --max-len {cfg.max_len}); "
        f"hash of the first batches {plan.data_hash[:16]}",
    ]
    if plan.start:
        lines.append(f"resuming at step {plan.start} of {cfg.steps}")
    for line in lines:
        tqdm.write(line)
