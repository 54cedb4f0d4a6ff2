"""The step loop of a fine-tuning run: train steps, LR schedule steps, evaluation and bookkeeping.

For: running the steps of a validated run (`sonar_fx.train.Prepared`) and reporting them (progress
bar, metrics.jsonl lines, checkpoints at step boundaries, the numbers of summary.json). Never: build
or validate anything, or touch a method's arithmetic: a step is `TrainingMethod.train_step`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from sonar_fx import checkpoint as ckpt_io
from sonar_fx import data as D
from sonar_fx.memory import measure_peak, process_peak_rss_bytes
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.train_log import MetricsFile, environment, memory_now, tensor_state_bytes

if TYPE_CHECKING:
    from sonar_fx.methods import TrainingMethod
    from sonar_fx.train import Prepared

WARMUP_STEPS = 2  # the first steps compile and allocate optimizer state: never timed


def supervised_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    """Tokens that carry loss (labels are shifted by one inside the model)."""
    return int((batch["labels"][:, 1:] != D.IGNORE_INDEX).sum())


def pad_to(batch: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a collated batch to `length` (one shape for every step: one compiled graph)."""
    extra = length - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    fill = {"input_ids": pad_id, "labels": D.IGNORE_INDEX, "attention_mask": 0}
    return {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model: nn.Module, examples: list[D.Example], batch_size: int, pad_id: int, device: str) -> float:
    """Held-out loss: mean over every supervised token (not a mean of batch means)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = D.collate(examples[i : i + batch_size], pad_id)
        n = supervised_tokens(batch)
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        total, count = total + float(loss) * n, count + n
    model.train(was_training)
    return total / max(count, 1)


class StepLoop:
    """The step loop and its bookkeeping (timings, memory, evaluations, metrics lines)."""

    def __init__(
        self,
        prep: Prepared,
        model: nn.Module,
        method: TrainingMethod,
        schedulers: list[torch.optim.lr_scheduler.LambdaLR],
        stream: D.BatchStream,
        start: int,
    ) -> None:
        self.prep, self.cfg, self.model, self.method = prep, prep.cfg, model, method
        self.schedulers, self.stream, self.start = schedulers, stream, start
        assert self.cfg.steps is not None and self.cfg.device is not None  # resolved by `prepare`
        self.steps, self.device = self.cfg.steps, self.cfg.device
        self.end = min(self.steps, self.cfg.stop_after or self.steps)
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.evals: dict[int, float] = {}
        self.peak: dict[str, Any] = {}
        n_local = self.end - start
        self.measure_at = start + min(WARMUP_STEPS, max(n_local - 1, 0))
        self.metrics = MetricsFile(prep.out / "metrics.jsonl", keep_until=start)

    def run(self) -> None:
        cfg = self.cfg
        if self.start == 0 and self.prep.held_out:
            self.evals[0] = self._evaluate()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        if cfg.compiler != "eager" and self.start < self.end:
            tqdm.write(f"compiling with {cfg.compiler}: the first step takes a while")
        bar = tqdm(total=cfg.steps, initial=self.start, desc=f"{cfg.method}/{cfg.compiler}",
                   disable=not cfg.progress, dynamic_ncols=True, mininterval=0.5)  # fmt: skip
        with self.metrics, bar:
            for step in range(self.start, self.end):
                record = self._step(step)
                done = step + 1
                if self.prep.held_out and (
                    done == self.end or (cfg.eval_every and done % cfg.eval_every == 0)
                ):
                    record["held_out_loss"] = self.evals[done] = self._evaluate()
                    bar.write(f"step {done}: held-out loss {record['held_out_loss']:.4f}")
                self.metrics.write(record)
                if cfg.checkpoint and (done == self.end or (cfg.save_every and done % cfg.save_every == 0)):
                    self._save(done)
                bar.set_postfix(self._postfix(record), refresh=False)
                bar.update(1)

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        batch = self.stream.next_batch()
        if cfg.pad_to_max_len:
            batch = pad_to(batch, cfg.max_len, self.prep.tokenizer.pad_id)
        n_tok = supervised_tokens(batch)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        lr = self.method.optimizers[0].param_groups[0]["lr"]
        t0 = time.perf_counter()
        if step == self.measure_at:
            state_bytes = tensor_state_bytes(self.model, self.method.optimizers)
            loss, peak = measure_peak(lambda: self.method.train_step(batch), self.device)
            self.peak = {"step": step + 1, "state_bytes": state_bytes, "transient_bytes": peak.peak_bytes}
        else:
            loss = self.method.train_step(batch)
        loss_value = float(loss)  # synchronizes, so the time below is the whole step
        seconds = time.perf_counter() - t0
        if not math.isfinite(loss_value):
            raise FloatingPointError(
                f"training loss is {loss_value} at step {step + 1}; lower --lr or check the data"
            )
        for sched in self.schedulers:
            sched.step()
        if step - self.start >= WARMUP_STEPS and step != self.measure_at:
            self.times.append(seconds)
            self.tokens.append(n_tok)
        self.losses.append(loss_value)
        return {"step": step + 1, "loss": loss_value, "lr": lr, "step_ms": seconds * 1e3,
                "supervised_tokens": n_tok, "tokens_per_s": n_tok / seconds, "epoch": self.stream.epoch,
                **memory_now(self.device)}  # fmt: skip

    def _evaluate(self) -> float:
        cfg = self.cfg
        bs = max(cfg.batch_size, 8)
        return evaluate(self.model, self.prep.held_out, bs, self.prep.tokenizer.pad_id, self.device)

    def _save(self, done: int) -> None:
        ckpt_io.save_checkpoint(
            self.prep.out / ckpt_io.FILENAME,
            identity=self.prep.identity,
            step=done,
            model=self.model,
            optimizers=self.method.optimizers,
            schedulers=self.schedulers,
            stream_state=self.stream.state_dict(),
        )

    def _postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        mem = record.get("cuda_max_allocated_mib", record.get("peak_rss_mib", 0.0))
        return {"loss": f"{record['loss']:.3f}", "ms": f"{record['step_ms']:.0f}",
                "tok/s": f"{record['tokens_per_s']:.0f}", "peak": f"{mem:.0f}MiB"}  # fmt: skip

    def summary(self, wall_s: float) -> dict[str, Any]:
        cfg, prep = self.cfg, self.prep
        timed = self.times or [float("nan")]
        return {
            "config": _jsonable(dataclasses.asdict(cfg)),
            "steps_done": self.end,
            "resumed_from_step": self.start,
            "final_train_loss": self.losses[-1] if self.losses else None,
            "held_out_loss": self.evals.get(self.end),
            "held_out_loss_initial": self.evals.get(0),
            "held_out_curve": {str(k): v for k, v in sorted(self.evals.items())},
            "median_step_ms": statistics.median(timed) * 1e3,
            "timed_steps": len(self.times),
            # Medians: one stall on a shared machine must not decide the throughput.
            "supervised_tokens_per_s": self._median_rate(),
            "supervised_tokens_per_s_overall": sum(self.tokens) / sum(self.times) if self.times else None,
            "memory": self._memory_summary(),
            "data": {
                "hash": prep.data_hash,
                "source": cfg.data or "built-in synthetic",
                "n_train": len(prep.train.examples),
                "n_held_out": len(prep.held_out),
                "n_dropped": prep.train.n_dropped,
                "n_truncated": prep.train.n_truncated,
            },
            "sonar": self.method.optimizer.report()
            if isinstance(self.method.optimizer, SonarOptimizer)
            else None,
            "wall_s": wall_s,
            **environment(self.device),
        }

    def _median_rate(self) -> float | None:
        rates = [n / t for n, t in zip(self.tokens, self.times, strict=True)]
        return statistics.median(rates) if rates else None

    def _memory_summary(self) -> dict[str, Any]:
        mem: dict[str, Any] = {"measured_step": self.peak.get("step")}
        if self.peak:
            # CPU has no allocator high-water mark: peak = tensors alive at the step's start (weights,
            # optimizer states) + the profiler's peak of the bytes the step allocated above them.
            mem["step_transient_bytes"] = self.peak["transient_bytes"]
            mem["state_bytes"] = self.peak["state_bytes"]
            mem["peak_bytes"] = self.peak["state_bytes"] + self.peak["transient_bytes"]
        if self.device.startswith("cuda"):
            mem["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            mem["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        mem["process_peak_rss_bytes"] = process_peak_rss_bytes()
        return mem


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
