"""The step in progress: which expert tensors it updated, in which backward, and whether that ended.

An in-backward update cannot be taken back, so the optimizer must know exactly what a step has done.
Backwards are told apart by autograd's graph-task id; the optimizer queues a callback on the first
update of a backward, which autograd runs only when that backward finishes, so a backward that raised
leaves an open task behind. From that the tracker tells apart: gradient accumulation (a second backward before
`step()`), one tensor updated twice in ONE backward (a module that runs twice per forward), and a
step left partial by an exception. It never updates anything itself.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from sonar_fx.errors import InterruptedStepError, SonarUsageError

Accumulation = Literal["per_microbatch"] | None
NO_TASK = -1  # what autograd reports outside any backward


class StepTracker:
    """Bookkeeping of the step in progress (one per `SonarOptimizer`)."""

    def __init__(self, accumulation: Accumulation) -> None:
        self.accumulation = accumulation
        self.updated: dict[str, int] = {}
        """Expert tensor name -> graph task of the backward that updated it in this step."""
        self.open_task: int | None = None
        """A backward that updated experts and has not finished (yet, or ever: it raised)."""
        self.interrupted: list[str] | None = None
        """Names the interrupted backward had updated, once an interruption was detected."""
        self._warned_accumulation = False

    def before_update(self, name: str) -> bool:
        """Raise if updating `name` now would train differently from what was asked; True when this is
        the first update of a new backward (the caller then queues its end-of-backward callback)."""
        task = torch._C._current_graph_task_id()
        if self.interrupted is None and self.open_task is not None and task != self.open_task:
            self.interrupted = list(self.updated)
        if self.interrupted is not None:
            raise self.interrupted_error("a new backward")
        previous = self.updated.get(name)
        if previous is not None:
            if previous == task and task != NO_TASK:
                raise SonarUsageError(
                    f"{name} received two gradients in one backward: the module that holds it ran twice "
                    "in one forward (shared layers), or two compiled graphs both produced its gradient. "
                    "Sonar updates a tensor once its gradient is complete; compile the whole model "
                    "(regional=False) or use compiler='eager', whose hook fires once per backward."
                )
            self._accumulating(name)
        if task != NO_TASK and self.open_task is None:
            self.open_task = task
            return True
        return False

    def record(self, name: str) -> None:
        self.updated[name] = torch._C._current_graph_task_id()

    def before_step(self) -> None:
        """Raise if the step's backward did not finish (it raised after updating experts)."""
        if self.interrupted is None and self.open_task is not None:
            self.interrupted = list(self.updated)
        if self.interrupted is not None:
            raise self.interrupted_error("step()")

    def reset(self) -> None:
        """Forget the step in progress (after `step()` or `abandon_step()`)."""
        self.updated, self.open_task, self.interrupted = {}, None, None

    def interrupted_error(self, at: str) -> InterruptedStepError:
        names = self.interrupted or []
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return InterruptedStepError(
            f"Sonar: {at} was called after a backward that raised part-way: it had already updated "
            f"{len(names)} expert tensor(s) in-backward ({shown or 'none'}), and those updates cannot be "
            "taken back. To go on, call optimizer.abandon_step() (drops this step's dense gradients; the "
            "experts keep their update, so the run is no longer bitwise equal to an uninterrupted one), or "
            "restore the last checkpoint for an exact run.",
            names,
        )

    def _accumulating(self, name: str) -> None:
        if self.accumulation is None:
            raise SonarUsageError(
                f"{name} received a second gradient before optimizer.step(): this looks like gradient "
                "accumulation. Sonar updates experts inside each backward, so accumulating would apply one "
                "update per micro-batch, a different optimizer. Call step() after every backward, or opt in "
                "with sonar_fx.compile(..., accumulation='per_microbatch')."
            )
        if not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                "accumulation='per_microbatch': expert tensors are updated once per micro-batch (the "
                "paper's semantics), not once per optimizer step.",
                stacklevel=4,
            )
