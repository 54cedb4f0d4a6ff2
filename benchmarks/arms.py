"""Arms of a benchmark comparison: build each (method x execution mode), then measure them together.

The measuring is `sonar_fx.measure`'s (warm-up, one profiled memory step, interleaved timed rounds,
paired ratios); this module adds what a benchmark needs around it:
- every arm starts from the same weights and trains on the same batches in the same order, so the
  held-out losses after the run compare like with like;
- per arm: the bytes of weights and optimizer state, Sonar's predicted saving
  (`sonar_fx.memory.ExpertGradBytes`), its update calls and paths, and the held-out loss.
All arms stay alive through the timed rounds. An arm that fails is reported with its error; it never
takes the others down. This module never decides what to compare; the scripts do.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from benchmarks.handwritten import METHOD as HANDWRITTEN
from benchmarks.handwritten import handwritten_expert_hooks
from sonar_fx.api import Compiler
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.measure import ArmResult as MeasuredArm
from sonar_fx.measure import StepFn, measure_arm, run_rounds, side_by_side
from sonar_fx.memory import ExpertGradBytes, state_bytes
from sonar_fx.methods import Execution, Method, TrainingMethod, build_method
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import Batch, held_out_loss

MethodStep = Callable[[TrainingMethod, Any], Any]
"""One step of a method on a batch (default: `TrainingMethod.train_step`)."""
EAGER = Execution()
COMPILED = Execution(compiler="inductor")
"""Compiled with inductor: Sonar with its in-graph pass, every other method as torch.compile makes it."""
HOOKS_ON_COMPILED = Execution(compiler="inductor", sonar_pass=False)
"""Sonar's eager hooks on the torch.compile'd model (what the pass improves on)."""


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One way to train: a method of `sonar_fx.methods` in an execution mode."""

    method: str
    execution: Execution = EAGER
    accumulation: str | None = None
    """Sonar's accumulation mode ("per_microbatch" for A >= 2)."""

    @property
    def kind(self) -> Method:
        return Method.named(self.method)

    @property
    def label(self) -> str:
        """ "sonar · compiled pass", "oib_all · compiled + hooks", "standard · eager", ..."""
        hooks = self.kind.updates_in_hooks(self.execution)
        if not self.execution.compiled:
            how = "eager hooks" if hooks else "eager"
        elif self.kind.sonar and self.execution.sonar_pass:
            how = "compiled pass"
        else:
            how = "compiled + hooks" if hooks else "compiled"
        return f"{self.method} · {how}"

    def under(self, compiler: Compiler) -> Arm:
        """This arm with its compiled execution on `compiler` (an eager arm stays eager)."""
        if not self.execution.compiled:
            return self
        return replace(self, execution=replace(self.execution, compiler=compiler))

    def baseline(self) -> Arm:
        """The standard method (global clip) in this arm's execution: what Δ and × compare with."""
        return Arm(method="standard", execution=Execution(compiler=self.execution.compiler))

    def build(self, model: nn.Module, cfg: AdamWConfig) -> TrainingMethod:
        extra: dict[str, Any] = {"accumulation": self.accumulation} if self.kind.sonar else {}
        return build_method(self.method, model, cfg, execution=self.execution, **extra)


@dataclass(frozen=True, kw_only=True)
class HandwrittenHooksArm(Arm):
    """The hand-written expert hooks of PyTorch's tutorial (`benchmarks.handwritten`): eager only, the
    equal-work reference of Sonar's eager hooks. Not a `sonar_fx.methods` method."""

    method: str = HANDWRITTEN

    @property
    def label(self) -> str:
        return f"{HANDWRITTEN} · eager hooks"

    def under(self, compiler: Compiler) -> Arm:
        return self

    def build(self, model: nn.Module, cfg: AdamWConfig) -> TrainingMethod:
        return handwritten_expert_hooks(model, cfg)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How many steps of which kind each arm runs."""

    warmup: int = 2
    """Untimed steps first (the first one compiles); then one profiled memory step."""
    rounds: int = 10
    """Timed steps per arm, interleaved with the other arms."""
    held_out_batches: int = 4


@dataclass(kw_only=True)
class ArmResult(MeasuredArm):
    """What one arm measured (times in seconds, memory in bytes): `sonar_fx.measure.ArmResult`'s figures
    and what a benchmark table adds."""

    arm: Arm
    resident_bytes: int = 0
    """Weights and optimizer state alive between steps; + `peak_bytes` compares with the paper's
    absolute peaks (which include them)."""
    held_out_loss: float = float("nan")
    predicted_saving_bytes: int = 0
    """`ExpertGradBytes.predicted_saving`: all expert-gradient bytes but one layer's."""
    update_calls_per_step: int | None = None
    """Fused-AdamW calls on expert tensors in one step (Sonar arms only)."""
    update_paths: dict[str, int] = field(default_factory=dict)
    """Expert tensors updated in the last step, by path ("graph", "hook", "deferred" or "kept")."""
    kept_operand_bytes: int | None = None
    """The deferred schedule's kept operands at their peak in the last step (None: another method)."""
    keep_budget: dict[str, Any] = field(default_factory=dict)
    """The deferred schedule: its keep budget's figures in the last step (`report()["deferred"]`)."""
    fallbacks: list[str] = field(default_factory=list)


def run_arms(
    build_model: Callable[[], nn.Module],
    arms: Sequence[Arm],
    cfg: AdamWConfig,
    plan: Plan,
    batches: Sequence[Any],
    held_out: Sequence[Batch],
    *,
    step: MethodStep | None = None,
    device: str = "cpu",
) -> list[ArmResult]:
    """Build, warm up and measure every arm, then time them in interleaved rounds; results in the
    order of `arms`."""
    need = plan.warmup + 1 + plan.rounds
    if len(batches) < need:
        raise ValueError(f"run_arms needs {need} batches (warm-up, memory step, rounds); got {len(batches)}")
    step_of = step or _train_step
    live: list[_Live] = []
    results = [ArmResult(label=arm.label, arm=arm) for arm in arms]
    with side_by_side():
        for result in results:
            print(f"  {result.label}: building and warming up", flush=True)
            try:
                model = build_model().to(device)
                method = result.arm.build(model, cfg)
            except Exception as err:  # reported in the table; the other arms still run
                result.fail(err)
                continue
            run = _Live(result, model, method, partial(step_of, method))
            measure_arm(result, run.step, batches[: plan.warmup], batches[plan.warmup], device=device)
            live.append(run)
        calls_before = [_update_calls(run.method) for run in live]
        run_rounds(
            [(run.result, run.step) for run in live], batches[plan.warmup + 1 : need],
            after_round=lambda r: print(f"  round {r + 1}/{plan.rounds} done", flush=True),
        )  # fmt: skip
    for run, calls in zip(live, calls_before, strict=True):
        _describe(run, calls, held_out)
    live.clear()
    torch._dynamo.reset()  # drop compiled code that holds this comparison's models
    gc.collect()
    return results


@dataclass
class _Live:
    """An arm while it runs."""

    result: ArmResult
    model: nn.Module
    method: TrainingMethod
    step: StepFn


def _train_step(method: TrainingMethod, batch: Batch) -> Any:
    return method.train_step(batch)


def _describe(run: _Live, calls_before: int, held_out: Sequence[Batch]) -> None:
    """Record what the arm is and did beside its timings: state bytes, predicted saving, update calls
    (counted over the timed rounds), fallbacks, and the held-out loss it reached."""
    result, method = run.result, run.method
    result.resident_bytes = state_bytes(run.model, method.optimizers)
    result.predicted_saving_bytes = ExpertGradBytes.of(ExpertSet.discover(run.model).layers).predicted_saving
    report = _report(method)
    if report and result.step_s:
        result.update_calls_per_step = (report["update_calls"] - calls_before) // len(result.step_s)
        result.update_paths = dict(Counter(report["last_step"].values()))
        result.fallbacks = list(report["fallbacks"])
        if "deferred" in report:
            result.kept_operand_bytes = report["deferred"]["kept_operand_peak"]
            keys = ("keep_budget_bytes", "kept_grad_bytes", "computed_grad_bytes", "recomputed_share")
            result.keep_budget = {k: report["deferred"][k] for k in keys}
    try:
        result.held_out_loss = held_out_loss(run.model, list(held_out))
    except Exception as err:
        if result.error is None:  # an arm that already failed keeps its first, root-cause error
            result.fail(err)


def _update_calls(method: TrainingMethod) -> int:
    return _report(method).get("update_calls", 0)


def _report(method: TrainingMethod) -> dict[str, Any]:
    return method.optimizer.report() if isinstance(method.optimizer, SonarOptimizer) else {}


def by_label(results: Sequence[ArmResult]) -> dict[str, ArmResult]:
    return {r.label: r for r in results}
