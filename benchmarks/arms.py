"""Arms of a comparison: build each (method x execution mode), warm it up, measure it, time it.

How it measures, and why:
- Every arm starts from the same weights and trains on the same batches in the same order, so the
  held-out losses after the run compare like with like.
- Peak memory: `sonar_fx.memory.measure_peak` over one whole train step after warm-up (optimizer
  state exists, compiled graphs are built): the step's transient bytes above weights and state.
- Time: all arms stay alive and are stepped round-robin, one step each per round, in an order that
  rotates every round, so a burst of load on a shared machine lands on every arm alike; ratios are
  paired per round. The profiled memory step is never timed.
An arm that fails is reported with its error; it never takes the others down. This module never
decides what to compare; the scripts do.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from benchmarks.common import Spread, paired_ratio
from benchmarks.workload import Batch, held_out_loss, predicted_saving
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.memory import measure_peak
from sonar_fx.methods import TrainingMethod, build_method
from sonar_fx.optim.optimizer import SonarOptimizer

Mode = Literal["eager", "compiled", "pass"]
StepFn = Callable[[TrainingMethod, Any], Any]
HOOKED = ("oib_all", "sonar", "sonar_per_expert")


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One way to train: a method of `sonar_fx.methods` in an execution mode."""

    method: str
    mode: Mode
    """"eager": no torch.compile; "compiled": torch.compile'd model (sonar and oib_all keep their
    post-accumulate-grad hooks); "pass": `sonar_fx.compile` with the in-graph update pass."""
    compiler: str = "inductor"
    """torch.compile backend of the "compiled" and "pass" modes ("inductor" or "aot_eager")."""
    accumulation: str | None = None
    """Sonar's accumulation mode ("per_microbatch" for A >= 2)."""

    @property
    def label(self) -> str:
        if self.mode == "eager":
            how = "eager hooks" if self.method in HOOKED else "eager"
        elif self.mode == "compiled":
            how = "compiled + hooks" if self.method in HOOKED else "compiled"
        else:
            how = "compiled pass"
        return f"{self.method} · {how}"

    def build(self, model: nn.Module, cfg: AdamWConfig) -> TrainingMethod:
        extra: dict[str, Any] = {"accumulation": self.accumulation} if self.method.startswith("sonar") else {}
        if self.mode == "eager":
            return build_method(self.method, model, cfg, compiler="eager", **extra)
        return build_method(
            self.method, model, cfg, compiler=self.compiler, sonar_pass=self.mode == "pass", **extra
        )


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How many steps of which kind each arm runs."""

    warmup: int = 2
    """Untimed steps first (the first one compiles); then one profiled memory step."""
    rounds: int = 10
    """Timed steps per arm, interleaved with the other arms."""
    held_out_batches: int = 4


@dataclass(frozen=True, kw_only=True)
class ArmResult:
    """What one arm measured (times in seconds, memory in bytes)."""

    arm: Arm
    label: str
    first_step_s: float = float("nan")
    """The first train step, compilation included."""
    peak_bytes: int = 0
    """Transient peak of one step (CPU: allocator events; CUDA: max allocated above the start)."""
    allocated_bytes: int | None = None
    """CUDA only: `max_memory_allocated` (absolute)."""
    reserved_bytes: int | None = None
    """CUDA only: `max_memory_reserved` (absolute)."""
    resident_bytes: int = 0
    """Weights and optimizer state alive between steps; + `peak_bytes` compares with the paper's
    absolute peaks (which include them)."""
    step_s: list[float] = field(default_factory=list)
    held_out_loss: float = float("nan")
    predicted_saving_bytes: int = 0
    update_calls_per_step: int | None = None
    """Fused-AdamW calls on expert tensors in one step (Sonar arms only)."""
    update_paths: dict[str, int] = field(default_factory=dict)
    """Expert tensors updated in the last step, by path ("graph" or "hook")."""
    fallbacks: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.step_s)

    @property
    def step_ms(self) -> Spread:
        return Spread.of([t * 1e3 for t in self.step_s])


@dataclass
class _Live:
    """An arm while it runs (mutable; frozen into an ArmResult at the end)."""

    arm: Arm
    model: nn.Module
    method: TrainingMethod
    fields: dict[str, Any]


def run_arms(
    build_model: Callable[[], nn.Module],
    arms: Sequence[Arm],
    cfg: AdamWConfig,
    plan: Plan,
    batches: Sequence[Any],
    held_out: Sequence[Batch],
    *,
    step: StepFn | None = None,
    device: str = "cpu",
) -> list[ArmResult]:
    """Build, warm up, measure and time every arm; results in the order of `arms`."""
    need = plan.warmup + 1 + plan.rounds
    if len(batches) < need:
        raise ValueError(f"run_arms needs {need} batches (warm-up, memory step, rounds); got {len(batches)}")
    step_fn = step or _train_step
    results: dict[int, ArmResult] = {}
    live: dict[int, _Live] = {}
    for i, arm in enumerate(arms):
        print(f"  {arm.label}: building and warming up", flush=True)
        try:
            live[i] = _prepare(arm, build_model, cfg, plan, batches, step_fn, device)
        except Exception as err:  # reported in the table; the other arms still run
            results[i] = ArmResult(arm=arm, label=arm.label, error=_short(err))
    _time_rounds(live, plan, batches, step_fn, device)
    for i, run in live.items():
        try:
            run.fields["held_out_loss"] = held_out_loss(run.model, list(held_out))
        except Exception as err:
            run.fields["error"] = _short(err)
        results[i] = ArmResult(arm=run.arm, label=run.arm.label, **run.fields)
    live.clear()
    torch._dynamo.reset()  # drop compiled code that holds this comparison's models
    gc.collect()
    return [results[i] for i in range(len(arms))]


def _train_step(method: TrainingMethod, batch: Batch) -> Any:
    return method.train_step(batch)


def _prepare(
    arm: Arm,
    build_model: Callable[[], nn.Module],
    cfg: AdamWConfig,
    plan: Plan,
    batches: Sequence[Any],
    step_fn: StepFn,
    device: str,
) -> _Live:
    model = build_model().to(device)
    layers = discover_experts(model)
    method = arm.build(model, cfg)
    start = time.perf_counter()
    step_fn(method, batches[0])
    _sync(device)
    first = time.perf_counter() - start
    for b in batches[1 : plan.warmup]:
        step_fn(method, b)
    calls_before = _report(method).get("update_calls", 0)
    gc.collect()
    _, peak = measure_peak(lambda: step_fn(method, batches[plan.warmup]), device)
    report = _report(method)
    fields: dict[str, Any] = dict(
        first_step_s=first,
        resident_bytes=resident_bytes(model, method),
        peak_bytes=peak.peak_bytes,
        allocated_bytes=peak.allocated_bytes,
        reserved_bytes=peak.reserved_bytes,
        predicted_saving_bytes=predicted_saving(layers),
        step_s=[],
    )
    if report:
        fields["update_calls_per_step"] = report["update_calls"] - calls_before
        fields["update_paths"] = dict(Counter(report["last_step"].values()))
        fields["fallbacks"] = list(report["fallbacks"])
    return _Live(arm, model, method, fields)


def _time_rounds(
    live: dict[int, _Live], plan: Plan, batches: Sequence[Any], step_fn: StepFn, device: str
) -> None:
    order = list(live)
    gc.collect()
    for r in range(plan.rounds):
        batch = batches[plan.warmup + 1 + r]
        shift = r % max(len(order), 1)
        for i in order[shift:] + order[:shift]:
            run = live[i]
            if "error" in run.fields:
                continue
            try:
                _sync(device)
                start = time.perf_counter()
                step_fn(run.method, batch)
                _sync(device)
                run.fields["step_s"].append(time.perf_counter() - start)
            except Exception as err:
                run.fields["error"] = _short(err)
        print(f"  round {r + 1}/{plan.rounds} done", flush=True)


def resident_bytes(model: nn.Module, method: TrainingMethod) -> int:
    """Bytes of the parameters and every optimizer state tensor (each storage counted once)."""
    optimizers = [method.optimizer] if method.optimizer is not None else list(method.hook_optimizers.values())
    tensors: list[torch.Tensor] = [*model.parameters()]
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _report(method: TrainingMethod) -> dict[str, Any]:
    return method.optimizer.report() if isinstance(method.optimizer, SonarOptimizer) else {}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _short(err: BaseException) -> str:
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return last if len(last) <= 300 else last[:297] + "..."


def by_label(results: Sequence[ArmResult]) -> dict[str, ArmResult]:
    return {r.label: r for r in results}


def ratio(a: ArmResult | None, b: ArmResult | None) -> Spread | None:
    """Paired step-time ratio a/b, or None when either arm did not run."""
    if a is None or b is None or not (a.ok and b.ok) or len(a.step_s) != len(b.step_s):
        return None
    return paired_ratio(a.step_s, b.step_s)
