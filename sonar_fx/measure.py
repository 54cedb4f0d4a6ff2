"""The measurement core: arms stepped against each other in interleaved rounds, and their step memory.

For: the benchmarks, `sonar-fx demo` and the GPU scripts, so that every figure they print is measured
the same way. An *arm* is one way to train (a model and its method) behind a step function
`step(batch)`; its figures go into an `ArmResult`. Two phases:
1. `measure_arm`: warm-up steps (the first one timed on its own: it includes compilation), then one
   step under `sonar_fx.memory.measure_peak`, the step's transient bytes (CPU: profiler allocator
   events; CUDA: `max_memory_allocated`). That step is never timed: the profiler slows it.
2. `run_rounds`: timed steps in rounds. Every round each healthy arm takes one step on the round's
   batch, in an order that rotates every round, so a burst of load on a shared machine lands on every
   arm alike. Ratios between arms are then paired per round (`ratio`, `paired_ratio`: the r-th step of
   one arm over the r-th step of the other) and summarised by their median and interquartile range.
Statistics are `torch.utils.benchmark.Measurement`'s (median, IQR, its high-variance check; the
quartiles by `torch.quantile`, as Measurement computes them); a step is timed with
`torch.utils.benchmark.timer` (it synchronises an accelerator first). `Timer` itself is not used: its
`timeit` runs warm-up calls of the statement, and a training step must run exactly once per round.
An arm that raises is recorded with its error and skipped from then on; it never stops the others.
Never: build models, decide what to compare, or assert on a timing.
"""

from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils.benchmark import Measurement, TaskSpec, timer

from sonar_fx.memory import measure_peak

StepFn = Callable[[Any], Any]
"""One training step of an arm on one batch (forward, backward, optimizer step)."""
A = TypeVar("A", bound="ArmResult")


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Repeated measurements summarised: the median with quartiles and extremes (the noise, stated)."""

    median: float
    q25: float
    q75: float
    min: float
    max: float
    n: int
    noisy: bool = False
    """The interquartile range is 10% of the median or more (`Measurement`'s warning threshold)."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of needs at least one value")
        m = Measurement(number_per_run=1, raw_times=[float(v) for v in values], task_spec=TaskSpec("", ""))
        # Measurement states the median and the IQR but keeps the quartiles private: the same
        # linear-interpolation quantiles, from torch.
        q25, q75 = torch.tensor(m.times, dtype=torch.float64).quantile(torch.tensor([0.25, 0.75]).double())
        return cls(
            median=m.median, q25=q25.item(), q75=q75.item(), min=min(m.times), max=max(m.times),
            n=len(m.times), noisy=m.has_warnings,
        )  # fmt: skip

    def fmt(self, digits: int = 0) -> str:
        """`median [q25-q75]`, the interquartile range being the honest noise band of a shared machine."""
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.q25:.{digits}f}-{self.q75:.{digits}f}]"


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Spread:
    """Spread of a[i] / b[i]: steps timed in the same round share the machine's momentary load."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs equal, non-empty sequences (got {len(a)} and {len(b)})")
    return Spread.of([x / y for x, y in zip(a, b, strict=True)])


def fmt_ratio(spread: Spread | None) -> str:
    """A paired time ratio as `0.83x [0.80-0.86]`, or '-' when it was not measured."""
    if spread is None:
        return "-"
    if spread.n == 1:
        return f"{spread.median:.2f}x"
    return f"{spread.median:.2f}x [{spread.q25:.2f}-{spread.q75:.2f}]"


@dataclass(kw_only=True)
class ArmResult:
    """What one arm measured (seconds, bytes); filled in by `measure_arm` and `run_rounds`. Callers that
    record more about an arm subclass it."""

    label: str
    """The arm's name in tables."""
    first_step_s: float = math.nan
    """The first step alone: compilation included for a compiled arm."""
    warmup_s: float = math.nan
    """Every warm-up step together, the first one included."""
    peak_bytes: int = 0
    """Transient peak of one step above its start (CPU: allocator events; CUDA: max allocated - start)."""
    allocated_bytes: int | None = None
    """CUDA only: `torch.cuda.max_memory_allocated()` over the memory step (absolute)."""
    reserved_bytes: int | None = None
    """CUDA only: `torch.cuda.max_memory_reserved()` over the memory step (absolute)."""
    step_s: list[float] = field(default_factory=list)
    """Timed steps, one per round the arm took part in."""
    error: str | None = None
    """Why the arm stopped (the last line of its exception), or None."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.step_s)

    @property
    def step_ms(self) -> Spread:
        return Spread.of([t * 1e3 for t in self.step_s])

    def fail(self, err: BaseException) -> None:
        self.error = short_error(err)


def measure_arm(
    result: A, step: StepFn, warmup: Sequence[Any], memory_batch: Any | None, *, device: str = "cpu"
) -> A:
    """Warm `step` up on the `warmup` batches, then measure one step's peak memory on `memory_batch`
    (None: no memory step). Fills and returns `result`; an exception is recorded in it, not raised."""
    if not warmup:
        raise ValueError("measure_arm needs at least one warm-up batch (the first step compiles)")
    try:
        started = timer()
        step(warmup[0])
        result.first_step_s = timer() - started
        for batch in warmup[1:]:
            step(batch)
        result.warmup_s = timer() - started
        if memory_batch is not None:
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()  # reserved bytes then reflect this step, not earlier arms' cache
            _, peak = measure_peak(lambda: step(memory_batch), device)
            result.peak_bytes = peak.peak_bytes
            result.allocated_bytes, result.reserved_bytes = peak.allocated_bytes, peak.reserved_bytes
    except Exception as err:  # reported with the arm; the other arms still run
        result.fail(err)
    return result


def run_rounds(
    arms: Sequence[tuple[ArmResult, StepFn]],
    batches: Sequence[Any],
    *,
    after_round: Callable[[int], None] | None = None,
) -> None:
    """One round per batch: each arm without an error takes one timed step, in rotating order.

    The times go to each `ArmResult.step_s`; `after_round(r)` runs after round r (untimed), e.g. for an
    evaluation or a progress bar."""
    gc.collect()
    for r, batch in enumerate(batches):
        shift = r % max(len(arms), 1)
        for result, step in [*arms[shift:], *arms[:shift]]:
            if result.error is not None:
                continue
            try:
                started = timer()
                step(batch)
                result.step_s.append(timer() - started)
            except Exception as err:
                result.fail(err)
        if after_round is not None:
            after_round(r)


def ratio(a: ArmResult | None, b: ArmResult | None) -> Spread | None:
    """Paired step-time ratio a/b, or None when either arm did not run all of the same rounds."""
    if a is None or b is None or not (a.ok and b.ok) or len(a.step_s) != len(b.step_s):
        return None
    return paired_ratio(a.step_s, b.step_s)


SIDE_BY_SIDE: dict[str, Any] = dict(
    recompile_limit=256, accumulated_recompile_limit=4096, automatic_dynamic_shapes=False
)
"""Dynamo settings for several compiled models of one class alive at once (interleaved arms): the
default recompile limit (8 per code object) would silently send later arms to eager, and a new arm
must compile a static graph for its own batch shape, not a dynamic one because an earlier arm of the
same class saw another shape."""


@contextmanager
def side_by_side() -> Iterator[None]:
    """`SIDE_BY_SIDE` for the duration of the block."""
    with torch._dynamo.config.patch(**SIDE_BY_SIDE):
        yield


def short_error(err: BaseException) -> str:
    """The last line of an exception, at most 300 characters: what a table cell can hold."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return last if len(last) <= 300 else last[:297] + "..."
