"""The `Trainer`: the step loop of a planned run, and what it does at each step boundary.

For: running the steps of a `RunPlan` (a step is `TrainingMethod.train_step`, then the LR schedulers),
held-out evaluation, one metrics line per finished step, checkpoints on the run's cadence, the
progress bar, and stopping cleanly: on SIGTERM/SIGINT it finishes the step, saves and stops; a step
that raises (in forward, backward, the optimizer step, or with a non-finite loss) ends the run with
`StepFailed` and NOTHING from that step written, so `--resume` from the last checkpoint continues
exactly. Never: build or validate anything, or touch a method's arithmetic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from sonar_fx import data as D
from sonar_fx.memory import high_water_mib, measure_peak, state_bytes
from sonar_fx.methods import TrainingMethod
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.metrics import MetricsFile, RunStats
from sonar_fx.trainer.plan import RunPlan
from sonar_fx.trainer.rundir import METRICS
from sonar_fx.trainer.signals import StopSignals

WARMUP_STEPS = 2  # the first steps compile and allocate optimizer state: never timed


class StepFailed(RuntimeError):
    """A training step raised; nothing from it was written. The message says where to resume."""

    def __init__(self, step: int, cause: BaseException, saved: tuple[int, Path] | None) -> None:
        where = (
            f"the last checkpoint is step {saved[0]} ({saved[1]}): continue from it with --resume"
            if saved
            else "no checkpoint was written yet: start again"
        )
        super().__init__(
            f"step {step} failed ({type(cause).__name__}: {cause}); nothing from step {step} was written; "
            f"{where}"
        )
        self.step, self.cause, self.saved = step, cause, saved


@dataclass(frozen=True)
class Outcome:
    steps_done: int
    stopped_by: str | None = None
    """The signal that stopped the run early ("SIGTERM", "SIGINT"), or None."""
    signum: int | None = None


@torch.no_grad()
def evaluate(model: nn.Module, examples: list[D.Example], batch_size: int, pad_id: int, device: str) -> float:
    """Held-out loss: mean over every supervised token (not a mean of batch means)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = D.collate(examples[i : i + batch_size], pad_id)
        n = D.supervised_tokens(batch)
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        total, count = total + float(loss) * n, count + n
    model.train(was_training)
    return total / max(count, 1)


class Trainer:
    """Runs the steps of a planned, built run (see the module docstring)."""

    def __init__(
        self,
        plan: RunPlan,
        model: nn.Module,
        method: TrainingMethod,
        schedulers: list[torch.optim.lr_scheduler.LambdaLR],
        stream: D.BatchStream,
        *,
        handle_signals: bool = False,
    ) -> None:
        """`handle_signals`: SIGTERM/SIGINT stop the run at the next step boundary with a checkpoint
        (the command line's choice; a library caller keeps its own handlers by default)."""
        self.plan, self.cfg, self.model, self.method = plan, plan.cfg, model, method
        self.handle_signals = handle_signals
        self.schedulers, self.stream = schedulers, stream
        assert self.cfg.device is not None and self.cfg.save_every is not None  # resolved by `plan_run`
        self.device, self.save_every = self.cfg.device, self.cfg.save_every
        self.start, self.end = plan.start, plan.end
        self.stats = RunStats(start=plan.start)
        self.measure_at = self.start + min(WARMUP_STEPS, max(self.end - self.start - 1, 0))
        self.saved: tuple[int, Path] | None = (
            (plan.start, plan.checkpoint_path) if plan.checkpoint_path is not None else None
        )
        self.parallel = plan.parallel
        self.writer = self.parallel.writer
        """Rank 0 (or the only process) logs and writes the run's files."""

    def run(self) -> Outcome:
        """Train from `plan.start` to `plan.end`; raises `StepFailed` when a step raises."""
        cfg = self.cfg
        if self.start == 0 and self.plan.held_out:
            self.stats.evals[0] = self._evaluate()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        if cfg.execution.compiled and self.writer:
            tqdm.write(f"compiling with {cfg.execution.compiler}: the first step takes a while")
        show = cfg.progress and self.writer
        bar = tqdm(total=self.plan.steps, initial=self.start, desc=f"{cfg.method}/{cfg.execution.label}",
                   disable=not show, dynamic_ncols=True, mininterval=0.5)  # fmt: skip
        metrics: MetricsFile | _NoMetrics = (
            MetricsFile(self.plan.out / METRICS, keep_until=self.start if self.saved else None)
            if self.writer
            else _NoMetrics()
        )
        with metrics, bar, StopSignals(enabled=self.handle_signals) as stop:
            for step in range(self.start, self.end):
                record = self._guarded_step(step)
                metrics.write(record)
                done = step + 1
                # Ranks get a signal at different moments: stop at the same step boundary on all.
                stopping = self.parallel.any_rank(stop.requested)
                if cfg.checkpoint and (done == self.end or stopping or self._due(done)):
                    self._save(done)
                bar.set_postfix(_postfix(record), refresh=False)
                bar.update(1)
                if stopping and done < self.end:
                    return Outcome(done, stop.name, stop.signum)
        return Outcome(self.end)

    def _due(self, done: int) -> bool:
        return self.save_every > 0 and done % self.save_every == 0

    def _guarded_step(self, step: int) -> dict[str, Any]:
        """One step and its evaluation; any exception becomes `StepFailed` before anything is written."""
        try:
            record = self._step(step)
            done = step + 1
            if self.plan.held_out and (
                done == self.end or (self.cfg.eval_every and done % self.cfg.eval_every == 0)
            ):
                record["held_out_loss"] = self.stats.evals[done] = self._evaluate()
                if self.writer:
                    tqdm.write(f"step {done}: held-out loss {record['held_out_loss']:.4f}")
            return record
        except Exception as exc:
            raise StepFailed(step + 1, exc, self.saved) from exc

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        micro, n_tok = [], 0
        for _ in range(cfg.grad_accum):  # the step's micro-batches, in stream order
            batch, tokens = self.parallel.rank_batch(self.stream)  # tokens: every rank's
            if cfg.pad_to_max_len:
                batch = D.pad_to(batch, cfg.max_len, self.plan.tokenizer.pad_id)
            micro.append({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
            n_tok += tokens
        step_batch: Any = micro[0] if len(micro) == 1 else micro
        lr = self.method.optimizers[0].param_groups[0]["lr"]
        t0 = time.perf_counter()
        if step == self.measure_at:
            held = state_bytes(self.model, self.method.optimizers)
            loss, peak = measure_peak(lambda: self.method.train_step(step_batch), self.device)
            self.stats.peak = {
                "step": step + 1,
                "state_bytes": held,
                "transient_bytes": peak.peak_bytes,
            }
        else:
            loss = self.method.train_step(step_batch)
        # synchronizes, so the time below is the whole step; ranks log the mean loss over ranks
        loss_value = self.parallel.mean_loss(loss)
        seconds = time.perf_counter() - t0
        finite = math.isfinite(loss_value)
        if not finite and self.cfg.nonfinite == "raise":
            raise FloatingPointError(f"training loss is {loss_value}; lower --lr or check the data")
        for sched in self.schedulers:
            sched.step()
        if step - self.start >= WARMUP_STEPS and step != self.measure_at:
            self.stats.times.append(seconds)
            self.stats.tokens.append(n_tok)
        if finite:
            self.stats.losses.append(loss_value)
        # A non-finite loss under --nonfinite skip/ignore: the line says so (strict JSON has no NaN).
        return {"step": step + 1, "loss": loss_value if finite else None, "nonfinite_loss": not finite,
                "lr": lr, "step_ms": seconds * 1e3, "supervised_tokens": n_tok,
                "tokens_per_s": n_tok / seconds, "epoch": self.stream.epoch,
                "world_size": self.parallel.world,
                **self._grad_norms(), **self._expert_grads(), **high_water_mib(self.device)}  # fmt: skip

    def _expert_grads(self) -> dict[str, Any]:
        """Sonar's measured peak of expert-gradient bytes alive at once in this step (its meter)."""
        optimizer = self.method.optimizer
        if not isinstance(optimizer, SonarOptimizer) or optimizer.meter.last_peak is None:
            return {}
        record: dict[str, Any] = {"expert_grad_peak_bytes": optimizer.meter.last_peak}
        if optimizer.schedule == "deferred":  # report()["deferred"]["kept_operand_peak"], without a report
            record["kept_operand_peak_bytes"] = optimizer.deferred.last_peak_bytes
            keep = optimizer.kept_grads.last  # the norm pass's keep budget (clip over all, a scaler)
            if keep is not None:
                record.update(keep_budget_bytes=keep.budget_bytes, kept_grad_bytes=keep.kept_bytes,
                              recomputed_share=keep.recomputed_share)  # fmt: skip
        return record

    def _grad_norms(self) -> dict[str, Any]:
        """Sonar's gradient norms of the step (taken inside its updates; before clipping)."""
        optimizer = self.method.optimizer
        if not isinstance(optimizer, SonarOptimizer):
            return {}
        norms = optimizer.grad_norms()
        experts: dict[str, float] = norms["experts"]
        record = {"grad_norm_dense": norms["dense"],
                  "grad_norm_expert_max": max(experts.values(), default=None),
                  "grad_norm_experts": experts}  # fmt: skip
        if norms["total"] is not None:
            record["grad_norm_total"] = norms["total"]
        return record

    def _evaluate(self) -> float:
        bs = max(self.cfg.batch_size, 8)
        return evaluate(self.model, self.plan.held_out, bs, self.plan.tokenizer.pad_id, self.device)

    def _save(self, done: int) -> None:
        path = self.parallel.checkpoint_path(self.plan.out / ckpt_io.FILENAME)  # sharded: one file per rank
        if self.writer or self.parallel.sharded:
            model, optimizers = self.parallel.checkpoint_views(self.model, self.method)
            ckpt_io.save_checkpoint(
                path,
                identity=self.plan.identity,
                step=done,
                model=model,
                optimizers=optimizers,
                schedulers=self.schedulers,
                stream_state=self.stream.state_dict(),
            )
        self.parallel.barrier()  # every rank's file is written before any goes on
        self.saved = (done, path)


class _NoMetrics:
    """What ranks other than 0 write metrics to: nothing."""

    def __enter__(self) -> _NoMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def write(self, record: Mapping[str, Any]) -> None:
        return None


def _postfix(record: Mapping[str, Any]) -> dict[str, str]:
    """The progress bar: each memory figure named for what it is (a high-water mark of the process or
    of CUDA's allocator since the start; the expert gradients alive at once in this step)."""
    loss = record["loss"]
    postfix = {"loss": "nan" if loss is None else f"{loss:.3f}", "ms": f"{record['step_ms']:.0f}",
               "tok/s": f"{record['tokens_per_s']:.0f}"}  # fmt: skip
    if "cuda_max_allocated_mib" in record:
        postfix["cuda_hw"] = f"{record['cuda_max_allocated_mib']:.0f}MiB"
    elif "peak_rss_mib" in record:
        postfix["rss_hw"] = f"{record['peak_rss_mib']:.0f}MiB"
    if record.get("expert_grad_peak_bytes") is not None:
        postfix["exp_grads"] = f"{record['expert_grad_peak_bytes'] / 2**20:.1f}MiB"
    for key, label in (("grad_norm_dense", "gn"), ("grad_norm_expert_max", "gn_exp")):
        if record.get(key) is not None:
            postfix[label] = f"{record[key]:.3g}"
    return postfix
