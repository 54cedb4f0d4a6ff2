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
partial by an exception. A compiled graph's update that the running backward does not want
(`sonar_fx.runtime.engine`: `torch.autograd.grad`, `backward(inputs=...)` leaving the expert out) is
recorded as left out, so a later refusal names that side backward; an expert requested by
`torch.autograd.grad`, or an update in a `create_graph=True` backward, is refused before the update. It never
updates anything itself.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from sonar_fx.errors import InterruptedStepError, SonarUsageError
from sonar_fx.runtime.engine import GradientFate

Accumulation = Literal["per_microbatch"] | None
NO_TASK = -1  # what autograd reports outside any backward
SECOND_BEGINNING = (
    "a backward reached the model's outputs again after it had begun there and updated experts (nothing "
    "raised: the outputs of a second forward were reached inside one backward, e.g. through the sum of two "
    "forwards' losses; run one backward per forward)"
)


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
        self.left_out: dict[str, tuple[str, int]] = {}
        """Expert tensor name -> the backward of this step that did not want its in-graph update."""
        self.create_graph = False
        """The open backward, seen beginning, builds a graph of its gradients (`create_graph=True`)."""
        self._warned_accumulation = False

    def backward_began(self) -> None:
        """A backward reached the model's outputs: the outermost graph task of a new backward, before any
        of its updates (the caller then queues the end-of-backward callback on it)."""
        if self.interrupted is None and self.open_task is not None and self.updated:
            self.interrupted = list(self.updated)
            if self.rooted and self.open_task == torch._C._current_graph_task_id():
                # Nothing raised: the running backward, already told, is told again after its updates.
                raise self.interrupted_error("a new backward", what=SECOND_BEGINNING)
        if self.interrupted is not None:
            raise self.interrupted_error("a new backward")
        if self.updated and self.open_task is None and self.accumulation is None:
            # The last backward finished and updated experts; refused here, before this one's graph runs:
            # a compiled backward would otherwise first meet weights the last one updated in place and
            # stop with torch's "modified by an inplace operation".
            self._accumulating(self._earlier_backward())
        self.open_task, self.rooted = torch._C._current_graph_task_id(), True
        # Autograd runs a backward's nodes and hooks in grad mode exactly when it creates a graph.
        self.create_graph = torch.is_grad_enabled()
        self.backwards += 1

    def backward_refused(self) -> None:
        """A backward that reached the model's outputs was refused before it moved anything: counted as
        begun (it spent its forward's graph, so the next forward is not a second one before a backward),
        and nothing else: the step goes on as if it had never run."""
        self.backwards += 1

    def _earlier_backward(self) -> str:
        first, more = next(iter(self.updated)), len(self.updated) - 1
        what = f"a second backward began (this step already updated {first} and {more} more in-backward"
        side = self._side_left_out()
        if not side:
            return what + ")"
        return (
            f"{what}, in a side backward that left {len(side)} expert tensor(s) out, e.g. {side[0]}: "
            "backward(inputs=...) with expert tensors among its inputs)"
        )

    def _side_left_out(self) -> list[str]:
        """Experts left out by a backward of this step that updated others: a `backward(inputs=...)`."""
        updating = set(self.updated.values())
        return sorted(name for name, key in self.left_out.items() if key in updating)

    def not_accumulated(self, name: str, fate: GradientFate) -> None:
        """The running backward adds nothing to `name`'s `.grad` (`sonar_fx.runtime.engine`): a left-out
        update is recorded; a gradient `torch.autograd.grad` asked for is refused."""
        if fate == "requested":
            raise SonarUsageError(
                f"torch.autograd.grad(...) asked for the gradient of the expert tensor {name}, which the "
                "compiled backward consumes in-graph for its update (the default in_backward schedule): "
                "it cannot be returned. This call moved no weight. Leave expert tensors out of "
                "torch.autograd.grad's inputs, or train with compiler='eager', whose hooks leave "
                "torch.autograd.grad alone."
            )
        self.left_out[name] = self._backward_key(torch._C._current_graph_task_id())

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
        if self.rooted and self.create_graph:
            raise SonarUsageError(
                f"backward(create_graph=True) reached the expert tensor {name}: it asks for expert "
                "gradients that carry a graph (for a second backward through them), but Sonar updates each "
                "expert in this backward and keeps no .grad. Refused before the update. Leave the experts "
                "out of it (backward(inputs=dense_params, create_graph=True), or torch.autograd.grad of "
                "the tensors you differentiate), or use a plain optimizer for that model."
            )
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

    def updated_in_open_backward(self) -> bool:
        """Whether the backward seen beginning updated an expert yet (under accumulation="per_microbatch",
        `updated` also holds the earlier backwards of the step)."""
        key = ("began", self.backwards)
        return self.rooted and any(done == key for done in self.updated.values())

    def backward_finished(self) -> None:
        self.open_task, self.rooted, self.create_graph = None, False, False

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
        self.left_out, self.create_graph = {}, False

    def interrupted_error(self, at: str, *, what: str | None = None) -> InterruptedStepError:
        """`what` happened (default: `at` was called after a backward that raised part-way)."""
        names = self.interrupted or []
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = what or f"{at} was called after a backward that raised part-way"
        return InterruptedStepError(
            f"Sonar: {what}: it had already updated "
            f"{len(names)} expert tensor(s) in-backward ({shown or 'none'}), and those updates cannot be "
            "taken back. To go on, call optimizer.abandon_step() (drops this step's dense gradients; the "
            "experts keep their update, so the run is no longer bitwise equal to an uninterrupted one), or "
            "restore the last checkpoint for an exact run.",
            names,
        )

    def _accumulating(self, what: str) -> None:
        if self.accumulation is None:
            cause = (
                "a side backward that reached the experts"
                if self._side_left_out()
                else "this looks like gradient accumulation (or a second backward through a retained graph)"
            )
            raise SonarUsageError(
                f"{what} before optimizer.step(): {cause}. Sonar updates experts inside each backward that "
                "adds to their .grad, so a second one would apply a second update, a different optimizer. "
                "Call step() after every backward; keep side backwards off the experts "
                "(torch.autograd.grad, or backward(inputs=...) without expert tensors: they move nothing); "
                "or opt in with sonar_fx.compile(..., accumulation='per_microbatch')."
            )
        if not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                "accumulation='per_microbatch': expert tensors are updated once per micro-batch (the "
                "paper's semantics), not once per optimizer step.",
                stacklevel=4,
            )
