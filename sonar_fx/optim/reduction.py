"""The seam between `SonarOptimizer` and a distributed engine: what happens to an expert gradient
between backward producing it and its update.

Under data parallelism the gradient backward hands over is this rank's local one; the update needs
the one every rank would see after the engine's reduction. A `GradReduction` (set on the optimizer as
`optimizer.distributed` by `sonar_fx.distributed`) turns the local gradient into that one and calls
the update, at once or later in the same backward (an asynchronous all-reduce). With no reduction set
the optimizer runs alone and refuses a multi-process run, where it would train each rank's copy
differently. The process-group requirement of every engine is here too (`require_process_group`,
raising `ProcessGroupRequired`), so all of them refuse a missing group alike. This module only asks
torch.distributed whether a group runs; it never communicates and never updates anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import Tensor

from sonar_fx.errors import ProcessGroupRequired, SonarUsageError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Update = Callable[[Tensor], None]
"""Apply the update of one expert tensor with the given (reduced) gradient."""


class Reducing(Protocol):
    """An expert gradient's reduction at `step()`, started: `wait()` gives the reduced gradient."""

    @property
    def in_flight(self) -> bool:
        """Whether a collective may still run (False: `wait()` returns at once, nothing to overlap)."""
        ...

    def wait(self) -> Tensor: ...


@dataclass(frozen=True)
class Reduced:
    """A reduction with no collective left to run (one process, or a rank's own experts)."""

    grad: Tensor
    in_flight: bool = False

    def wait(self) -> Tensor:
        return self.grad


@dataclass(frozen=True)
class Started:
    """A collective started on `grad` in place (`async_op=True`): the deferred step computes the next
    expert gradient while it runs, and waits here before the update reads `grad`."""

    grad: Tensor
    work: Any
    """The collective's `torch.distributed.Work`."""
    in_flight: bool = True

    def wait(self) -> Tensor:
        self.work.wait()
        return self.grad


StepReduce = Callable[[str, Tensor], Reducing]
"""The deferred schedule: (expert tensor name, its gradient computed at `step()` from this rank's
kept operands) -> its reduction as the engine reduces it, started (`GradReduction.at_step`); every
rank starts them in the same order and waits each before the update reads it."""


class GradReduction(Protocol):
    """How a distributed engine reduces expert gradients before their in-backward update."""

    name: str
    """Short name for reports ("ddp", "ddp-async", "fsdp2", "ep")."""
    in_graph: Literal["update", "all_reduce", "hooks"]
    """What a compiled backward graph does with these experts' gradients: "update" them as they come
    (the reduction then runs at update time), "all_reduce" them (mean over `group_name`, as functional
    collectives in the graph) before updating, or leave them to the hooks ("hooks": the engine reduces
    them after the graph has returned)."""

    @property
    def group_name(self) -> str | None:
        """The process group a graph all-reduces over (its registered name), for `in_graph="all_reduce"`."""
        ...

    @property
    def world_size(self) -> int: ...

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        """Reduce `grad` (the expert tensor `name`'s) as the engine would, then call `update` with it,
        before the backward that produced it ends. `path` is "hook" or "graph"; `reduced` names the
        reduction a compiled graph already applied to `grad` ("" for none)."""
        ...

    def any_rank(self, local: bool) -> bool:
        """Whether `local` holds on any rank (every rank calls it at the same point), so that a
        non-finite gradient stops or skips the step on every rank alike."""
        ...

    def global_norm(self, norms: Sequence[Tensor], experts: Sequence[bool]) -> Tensor:
        """expert_clip="global": the norm of every gradient of the step as the engine's standard
        training clips it, from the per-tensor norms in parameter order (`experts[i]`: norm i is an
        expert tensor's). A norm may be a DTensor (an FSDP2 shard's: partial over ranks); the result
        is a plain 0-d tensor, the same on every rank. Every rank calls it at the same point."""
        ...

    def at_step(self) -> StepReduce:
        """schedule="deferred", at the start of `step()` (before any weight moves): refuse a loop whose
        reduction of the dense gradients differs from the one applied to the experts, then give the
        function that starts the reduction of each expert gradient computed at `step()` (a `Reducing`:
        its collective runs while the step computes the next gradient). Every rank calls it, and the
        function and each `wait()`, at the same points."""
        ...

    def replay(self, experts: list[Tensor]) -> AbstractContextManager[list[Tensor]]:
        """expert_clip="global", pass 2: a context around the replayed forward and the expert-only
        backward that keeps the engine consistent (DDP: no reducer expecting dense gradients), giving
        the tensors that backward differentiates (`experts`, or the engine's unsharded views of them)."""
        ...


def step_reduction(reduction: GradReduction | None) -> StepReduce:
    """The deferred step's reduction of each computed expert gradient: the engine's (`at_step`), or
    none in one process (with several processes and no engine set up: refused, before any weight
    moves, as `refuse_unreduced` refuses an in-backward update)."""
    world = running_world_size()
    if reduction is None and world > 1:
        raise SonarUsageError(
            f"schedule='deferred': torch.distributed runs {world} processes, but this model was prepared "
            "for one (sonar_fx.compile / prepare), so each expert gradient computed at step() would be this "
            "rank's own and each rank's copy would move differently (a DDP wrapper added after prepare "
            "holds the experts in its buckets too). Refused at step(), before any weight moved. Build it "
            "with sonar_fx.distributed (ddp, expert_parallel, fsdp2 or fsdp2_ep, schedule='deferred') on the "
            "unwrapped model; call optimizer.zero_grad() to drop this step."
        )
    return _as_computed if reduction is None else reduction.at_step()


def _as_computed(name: str, grad: Tensor) -> Reducing:
    return Reduced(grad)


def refuse_unreduced(name: str, reduced: str) -> None:
    """The check for an optimizer without a reduction: one process, and no graph that reduced."""
    if reduced:
        raise SonarUsageError(
            f"{name}: a compiled graph all-reduced this gradient ({reduced}) but its optimizer has no "
            "distributed setup: the graph was compiled for a distributed model and reused for this one. "
            "Set both up the same way (sonar_fx.distributed.ddp for data parallel runs)."
        )
    world = running_world_size()
    if world > 1:
        raise SonarUsageError(
            f"{name}: torch.distributed runs {world} processes, so this gradient is this "
            "rank's local one and Sonar would update each rank's copy differently. Set the model up with "
            "sonar_fx.distributed (ddp, fully_shard_experts or expert_parallel), which reduces expert "
            "gradients across ranks before the update."
        )


def running_world_size() -> int:
    """Processes in torch.distributed's default group (1 when none is initialised)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def require_process_group(who: str, group: ProcessGroup | None = None) -> ProcessGroup:
    """`group`, or the default group when None; raises `ProcessGroupRequired` naming `who` and the fix
    when torch.distributed has no initialised process group (every engine checks here)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupRequired(
            f"{who} needs an initialised process group: run under torchrun and call "
            "torch.distributed.init_process_group(...) first."
        )
    chosen = group if group is not None else dist.group.WORLD
    assert chosen is not None  # the default group exists once one is initialised
    return chosen
