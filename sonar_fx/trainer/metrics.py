"""A run's numbers: metrics.jsonl (one line per step) and the aggregates summary.json reports.

For: appending one strict-JSON line per finished step (flushed, so a crash keeps every finished
step), and, on resume, dropping the lines after the checkpoint's step without ever leaving the file
empty or torn. Never: truncate metrics.jsonl in place (the kept lines are written to a temp file that
atomically replaces it), write NaN (non-finite numbers become null), or crash on a torn last line
left by a kill (it is dropped with a warning).
"""

from __future__ import annotations

import json
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sonar_fx.trainer.rundir import atomic_write_text, to_json


class MetricsFile:
    """metrics.jsonl, opened for appending; a resumed run first drops the lines after its checkpoint."""

    def __init__(self, path: Path, *, keep_until: int | None) -> None:
        """`keep_until`: the checkpoint step a resumed run continues from (None: a fresh run)."""
        self.path, self.keep_until = path, keep_until
        self.file: IO[str] | None = None

    def __enter__(self) -> MetricsFile:
        if self.keep_until is not None and self.path.exists():
            self._keep_steps_until(self.keep_until)
        self.file = self.path.open("a", encoding="utf-8")
        return self

    def _keep_steps_until(self, step: int) -> None:
        text = self.path.read_text(encoding="utf-8", errors="replace")
        kept, torn = [], []
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= step
            except (ValueError, KeyError, TypeError):  # a write cut short by a kill
                torn.append(lineno)
                continue
            if keep:
                kept.append(line + "\n")
        if torn:
            warnings.warn(
                f"{self.path}: dropped {len(torn)} unreadable line(s) (line "
                f"{', '.join(map(str, torn[:3]))}), left by a run that was killed while writing",
                stacklevel=3,
            )
        if "".join(kept) != text:
            atomic_write_text(self.path, "".join(kept))

    def write(self, record: Mapping[str, Any]) -> None:
        assert self.file is not None, "MetricsFile.write outside `with`"
        self.file.write(to_json(record) + "\n")
        self.file.flush()  # a crashed run still leaves every finished step on disk

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


@dataclass
class RunStats:
    """What the steps of this process measured, for summary.json."""

    start: int
    """Step the run started from (0, or the checkpoint's)."""
    times: list[float] = field(default_factory=list)
    """Seconds of the timed steps (after warm-up, not the profiled one)."""
    tokens: list[int] = field(default_factory=list)
    """Supervised tokens of the timed steps."""
    losses: list[float] = field(default_factory=list)
    evals: dict[int, float] = field(default_factory=dict)
    """Held-out loss by step (0: before the first step)."""
    peak: dict[str, Any] = field(default_factory=dict)
    """The profiled step: its number, state bytes and transient bytes."""

    def median_step_ms(self) -> float | None:
        return statistics.median(self.times) * 1e3 if self.times else None

    def median_rate(self) -> float | None:
        """Median tokens/s: one stall on a shared machine must not decide the throughput."""
        rates = [n / t for n, t in zip(self.tokens, self.times, strict=True)]
        return statistics.median(rates) if rates else None

    def overall_rate(self) -> float | None:
        return sum(self.tokens) / sum(self.times) if self.times else None

    def memory(self) -> dict[str, Any]:
        mem: dict[str, Any] = {"measured_step": self.peak.get("step")}
        if self.peak:
            # CPU has no allocator high-water mark: peak = tensors alive at the step's start (weights,
            # optimizer states) + the profiler's peak of the bytes the step allocated above them.
            mem["step_transient_bytes"] = self.peak["transient_bytes"]
            mem["state_bytes"] = self.peak["state_bytes"]
            mem["peak_bytes"] = self.peak["state_bytes"] + self.peak["transient_bytes"]
        return mem
