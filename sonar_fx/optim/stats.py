"""Counters behind `SonarOptimizer.report()`: what was found, compiled, and which path updated what."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SonarStats:
    """Mutable counters; the optimizer, the hooks and the backend write them, tests read them."""

    updates: Counter[str] = field(default_factory=Counter)
    """Expert updates so far, by path ("graph" or "hook")."""
    update_calls: int = 0
    """Calls into the fused kernel (2L per step batched, 2EL per expert)."""
    graphs_compiled: int = 0
    """Backward graphs the pass rewrote in this process for this optimizer's model."""
    graphs_from_cache: int = 0
    """Graphs inductor's AOTAutograd cache served (compiled with the pass in an earlier process)."""
    updates_inserted: int = 0
    """Update nodes inserted across the graphs the pass rewrote in this process."""
    recompiles: int = 0
    """Compiled graphs beyond the first one seen for each dynamo frame."""
    fallbacks: list[str] = field(default_factory=list)
    """Why compilation fell back to eager hooks, once per cause."""
    last_step: dict[str, str] = field(default_factory=dict)
    """Expert tensor name -> path that updated it, in the last completed `step()`."""
    current_step: dict[str, str] = field(default_factory=dict)
    """The same map for the step in progress."""
    skipped_updates: Counter[str] = field(default_factory=Counter)
    """Expert updates skipped for a non-finite gradient (nonfinite="skip"), by tensor name."""
    skipped_steps: int = 0
    """Dense steps skipped for a non-finite gradient (nonfinite="skip")."""
    abandoned_steps: list[list[str]] = field(default_factory=list)
    """For each `abandon_step()`: the expert tensors its interrupted backward had already updated."""

    def record_update(self, name: str, path: str) -> None:
        self.updates[path] += 1
        self.current_step[name] = path

    def end_step(self) -> None:
        self.last_step = self.current_step
        self.current_step = {}
