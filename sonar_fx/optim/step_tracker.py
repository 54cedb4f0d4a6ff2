"""The step in progress: which expert tensors it updated, in which backward, and whether that ended.

An in-backward update cannot be taken back, so the optimizer must know exactly what a step has done. A
backward through the prepared model starts at its outputs: a hook there (`backward_root`: a forward hook of
the model, or the sonar backend's mark on a compiled graph's outputs) tells the tracker, in the outermost
graph task, that a backward began, and the optimizer queues a callback on that task, which autograd runs only
when the whole backward finishes, so a backward that raised leaves it open. Without that hook (a submodule
called directly), backwards are told apart by autograd's graph-task id and the callback is queued at the first
update. Graph-task ids alone would be wrong for a backward that runs nested backwards (reentrant checkpointing
runs each layer's backward as its own task inside the outer one): the first nested task to finish would look
like the end of the step. From that the tracker tells apart: gradient accumulation (a second backward before
`step()`), one tensor updated twice in ONE backward (a module that runs twice per forward), and a step left
partial by an exception. It never updates anything itself.
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
        self.updated: dict[str, tuple[str, int]] = {}
        """Expert tensor name -> the backward that updated it in this step (`_backward_key`)."""
        self.open_task: int | None = None
        """A backward that updated experts, or began at the model's outputs, and has not finished (yet,
        or ever: it raised)."""
        self.rooted = False
        """The open backward was seen beginning at the model's outputs (`backward_began`): updates in
        other graph tasks (nested ones) belong to it."""
        self.backwards = 0
        """Backwards seen beginning at the model's outputs."""
        self.interrupted: list[str] | None = None
        """Names the interrupted backward had updated, once an interruption was detected."""
        self._warned_accumulation = False

    def backward_began(self) -> None:
        """A backward reached the model's outputs: the outermost graph task of a new backward, before any
        of its updates (the caller then queues the end-of-backward callback on it)."""
        if self.interrupted is None and self.open_task is not None and self.updated:
            self.interrupted = list(self.updated)
        if self.interrupted is not None:
            raise self.interrupted_error("a new backward")
        if self.updated and self.open_task is None and self.accumulation is None:
            # The last backward finished and updated experts; refused here, before this one's graph runs:
            # a compiled backward would otherwise first meet weights the last one updated in place and
            # stop with torch's "modified by an inplace operation".
            first, more = next(iter(self.updated)), len(self.updated) - 1
            self._accumulating(f"a second backward began (this step already updated {first} and {more} more)")
        self.open_task, self.rooted = torch._C._current_graph_task_id(), True
        self.backwards += 1

    def before_update(self, name: str) -> bool:
        """Raise if updating `name` now would train differently from what was asked; True when this is
        the first update of a new backward the tracker did not see begin (the caller then queues its
        end-of-backward callback)."""
        task = torch._C._current_graph_task_id()
        if (
            self.interrupted is None
            and self.open_task is not None
            and task != self.open_task
            and not self.rooted
        ):
            self.interrupted = list(self.updated)
        if self.interrupted is not None:
            raise self.interrupted_error("a new backward")
        previous = self.updated.get(name)
        if previous is not None:
            if previous == self._backward_key(task) and task != NO_TASK:
                raise SonarUsageError(
                    f"{name} received two gradients in one backward: the module that holds it ran twice "
                    "in one forward (shared layers), or two compiled graphs both produced its gradient. "
                    "Sonar updates a tensor once its gradient is complete; compile the whole model "
                    "(regional=False) or use compiler='eager', whose hook fires once per backward."
                )
            self._accumulating(f"{name} received a second gradient")
        if task != NO_TASK and self.open_task is None:
            self.open_task = task
            return True
        return False

    def record(self, name: str) -> None:
        self.updated[name] = self._backward_key(torch._C._current_graph_task_id())

    def backward_finished(self) -> None:
        self.open_task, self.rooted = None, False

    def _backward_key(self, task: int) -> tuple[str, int]:
        """Which backward an update belongs to: the one seen beginning, or else its graph task."""
        return ("began", self.backwards) if self.rooted else ("task", task)

    def before_step(self) -> None:
        """Raise if the step's backward did not finish (it raised after updating experts)."""
        if self.interrupted is None and self.open_task is not None and self.updated:
            self.interrupted = list(self.updated)
        if self.interrupted is not None:
            raise self.interrupted_error("step()")

    def reset(self) -> None:
        """Forget the step in progress (after `step()` or `abandon_step()`)."""
        self.updated, self.open_task, self.interrupted, self.rooted = {}, None, None, False

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

    def _accumulating(self, what: str) -> None:
        if self.accumulation is None:
            raise SonarUsageError(
                f"{what} before optimizer.step(): this looks like gradient accumulation (or a second "
                "backward through a retained graph). Sonar updates experts inside each backward, so "
                "accumulating would apply one update per micro-batch, a different optimizer. Call step() "
                "after every backward, or opt in with sonar_fx.compile(..., accumulation='per_microbatch')."
            )
        if not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                "accumulation='per_microbatch': expert tensors are updated once per micro-batch (the "
                "paper's semantics), not once per optimizer step.",
                stacklevel=4,
            )
