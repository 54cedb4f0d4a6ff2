"""Counters behind `SonarOptimizer.report()`: what was found, compiled, and which path updated what."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SonarStats:
    """Counters the optimizer and the backend record through the methods below; `report()` reads them."""

    updates: Counter[str] = field(default_factory=Counter)
    """Expert updates so far, by path: "graph", "hook", or at step() under the deferred schedule,
    "deferred" (from kept operands) or "kept" (from a gradient kept whole)."""
    left_out: int = 0
    """In-graph updates not run because the backward did not add to that expert's .grad
    (`torch.autograd.grad`, `backward(inputs=...)` leaving it out): the gradient was dropped, as torch's."""
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

    def record_update(self, name: str, path: str, *, calls: int = 1) -> None:
        """One expert tensor updated by `path` ("graph" or "hook") in `calls` kernel calls."""
        self.updates[path] += 1
        self.update_calls += calls
        self.current_step[name] = path

    def record_graph(self, *, from_cache: bool, inserted: int | None, recompile: bool) -> None:
        """A backward graph compiled for this optimizer's model: served by the cache (`from_cache`) or
        rewritten by the pass with `inserted` update nodes (None: the pass did not run on it)."""
        if from_cache:
            self.graphs_from_cache += 1
        elif inserted is not None:
            self.graphs_compiled += 1
            self.updates_inserted += inserted
        self.recompiles += recompile

    def record_fallback(self, cause: str) -> bool:
        """A compilation that fell back to hooks; True the first time this cause is seen."""
        if cause in self.fallbacks:
            return False
        self.fallbacks.append(cause)
        return True

    def record_skipped_step(self, experts: Iterable[str]) -> bool:
        """A step skipped for a non-finite gradient, with the expert updates it skipped; True for the
        first skip of the run (the one that warns)."""
        self.skipped_updates.update(experts)
        self.skipped_steps += 1
        return self.skipped_steps == 1

    def end_step(self) -> None:
        self.last_step = self.current_step
        self.current_step = {}

    def abandon_step(self, updated: list[str]) -> None:
        """`abandon_step()`: `updated` the tensors the interrupted backward had updated."""
        self.abandoned_steps.append(updated)
        self.current_step = {}
