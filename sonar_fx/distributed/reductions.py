"""How each distributed engine turns a local expert gradient into the one its update needs.

One `GradReduction` (see `sonar_fx.optim.reduction`) per engine, set on the `SonarOptimizer`:
- `MeanAllReduce` (DDP): multiply by 1/world and all-reduce (sum), DDP's own arithmetic, then update;
  a compiled graph does the same with functional collectives (`in_graph="all_reduce"`), and any
  gradient that reaches it unreduced (a graph that fell back, a hook) is reduced here, never updated
  locally.
- `AsyncMeanAllReduce` (DDP, async): the same all-reduce started in the background; the update runs
  when the next expert gradient arrives (or the backward ends), so communication overlaps the next
  layer's backward at the cost of one more expert gradient alive.
- `ShardedGrads` (FSDP2): FSDP2 reduce-scatters before it calls the hook, so the gradient is already
  the reduced shard; a compiled graph must never update (it would see the unsharded, local gradient).
- `LocalExperts` (expert parallelism): each rank owns its experts and their gradients hold every
  rank's tokens, so no collective: scale by 1/world to match data-parallel averaging.
Nothing here decides which tensors are experts or builds an engine; see `ddp`, `fsdp`,
`expert_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from sonar_fx.distributed.deferred import ForwardSyncs, mean_all_reduce, refuse_unmatched_syncs
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.norms import plain, total_norm
from sonar_fx.optim.reduction import Reduced, StepReduce, Update
from sonar_fx.passes.reduce_grads import GraphReduce

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor for a collective over `group` must live (NCCL reduces CUDA tensors only)."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def any_rank(local: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `local` holds on any rank of `group`; every rank calls it at the same point."""
    flag = torch.tensor([1.0 if local else 0.0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def expert_parallel_norm(dense: Tensor, expert_norms: Sequence[Tensor], group: dist.ProcessGroup) -> Tensor:
    """The global gradient norm under expert parallelism, as torchtitan clips it (`get_total_norm` over
    the experts as DTensors sharded over `group`, then `full_tensor()`), combined with the dense norm
    (the same on every rank) as p-th powers. DTensor reduces each expert tensor's partial norm over the
    ranks before it stacks them (`stack` takes replicated inputs), so the experts' norm is the norm of
    per-tensor norms over every rank (`norms_over_ranks`), not of each rank's total: other bits, at
    world size 2 as well. `expert_norms`: this rank's, one per expert tensor in parameter order. Every
    rank of `group` calls it at the same point."""
    experts = total_norm(norms_over_ranks(expert_norms, group))
    return (experts**2 + dense**2) ** (1.0 / 2)


def norms_over_ranks(norms: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Each tensor's norm over the ranks of `group` from each rank's norm of its part, one collective
    per tensor as DTensor redistributes each partial norm (the sum order of a reduction depends on its
    buffer: one per tensor, as there); all started, then waited. A group of one rank reduces nothing,
    as DTensor skips a mesh dimension of size 1."""
    if dist.get_world_size(group) == 1:
        return list(norms)
    squares = [norm**2 for norm in norms]
    works = [dist.all_reduce(square, group=group, async_op=True) for square in squares]
    for work in works:
        work.wait()
    return [square ** (1.0 / 2) for square in squares]


def split_norms(norms: Sequence[Tensor], experts: Sequence[bool]) -> tuple[Tensor, list[Tensor]]:
    """The total norm of the dense tensors' norms, and the experts' norms (each in parameter order)."""
    dense = total_norm([n for n, e in zip(norms, experts, strict=True) if not e])
    return dense, [n for n, e in zip(norms, experts, strict=True) if e]


class DenseWrapped(Protocol):
    """A reduction whose dense parameters go through a DDP wrapper (DDP, expert parallelism)."""

    wrapper: DistributedDataParallel | None
    replaying: bool


@contextmanager
def without_reducer(reduction: DenseWrapped, experts: list[Tensor]) -> Iterator[list[Tensor]]:
    """Pass 2 of expert_clip="global" under DDP: `no_sync`, so that its forward leaves the reducer
    unprepared; an expert-only backward would otherwise leave DDP waiting for dense gradients that
    never come (the next forward raises). Dense gradients are pass 1's, reduced already. The
    reduction is told (`replaying`), so that `refuse_unsynced` lets Sonar's own `no_sync` through."""
    wrapper = reduction.wrapper
    if wrapper is None:
        raise SonarUsageError(
            "expert_clip='global' under DDP needs the DDP wrapper of the model, which sonar_fx.distributed."
            "ddp / expert_parallel record: build the model with them rather than a reduction by hand."
        )
    reduction.replaying = True
    try:
        with wrapper.no_sync():
            yield experts
    finally:
        reduction.replaying = False


def refuse_unsynced(name: str, reduction: DenseWrapped) -> None:
    """Refuse an expert update in a backward DDP does not reduce: the last forward ran under
    `no_sync()` or with `require_backward_grad_sync = False` (DDP decides at the forward and records
    it in `require_forward_param_sync`). Called before the update, on every rank alike (the flag is
    the user's, set the same on every rank), so nothing has moved when it raises."""
    wrapper = reduction.wrapper
    if wrapper is None or reduction.replaying or wrapper.require_forward_param_sync:
        return
    raise SonarUsageError(
        f"{name}: this backward runs under DDP's no_sync() (or require_backward_grad_sync = False), so DDP "
        "reduces no gradient in it, but Sonar updates each expert inside backward: it cannot keep a local "
        "step local nor leave a micro-batch for later, and would train otherwise than DDP. Refused before "
        "any weight moved. Run every backward with gradient sync and call step() after each; to "
        "accumulate micro-batches, drop no_sync() and opt in with accumulation='per_microbatch' (one "
        "expert update per micro-batch), or keep no_sync() and build the model with schedule='deferred' (the "
        "exact accumulation, DDP and expert parallelism). Call optimizer.abandon_step() to drop this "
        "backward's dense gradients before going on."
    )


def not_deferred(engine: str) -> str:
    """Why the deferred schedule does not run on `engine` (`api.distributed_gap` refuses it first)."""
    return (
        f"schedule='deferred' is not supported on the {engine} engine yet: nothing reduces the expert "
        "gradients computed at step() as that engine would; use the default schedule there."
    )


@dataclass
class MeanAllReduce:
    """DDP: `grad * (1/world)`, all-reduce sum over `group`, update (see the module docstring)."""

    group: dist.ProcessGroup
    name: str = "ddp"
    in_graph: Literal["update", "all_reduce", "hooks"] = "all_reduce"
    reduced_here: int = 0
    """Gradients this object all-reduced itself (hooks, or graphs compiled without the all-reduce)."""
    wrapper: DistributedDataParallel | None = None
    """The DDP module of the dense parameters (set by `sonar_fx.distributed.ddp`), for `replay` and
    `refuse_unsynced`."""
    replaying: bool = False
    """Inside pass 2 of expert_clip="global" (`without_reducer`)."""
    forward_syncs: ForwardSyncs | None = None
    """schedule="deferred": which forwards of the step synced (set by `sonar_fx.distributed.ddp`)."""

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def group_name(self) -> str:
        return self.group.group_name

    @property
    def tag(self) -> str:
        return GraphReduce(self.group_name, self.world_size).tag

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        refuse_unsynced(name, self)
        if reduced == self.tag:
            update(grad)  # the graph averaged it already
            return
        self._check_tag(name, reduced)
        update(self._wait(self._start(grad, in_place=path == "hook")))

    def at_step(self) -> StepReduce:
        refuse_unmatched_syncs(self.forward_syncs)  # before any weight moves: DDP synced the last only
        return lambda name, grad: mean_all_reduce(grad, self.group)

    def any_rank(self, local: bool) -> bool:
        # Every expert and dense gradient is averaged before use, so every rank sees the same flags.
        return local

    def global_norm(self, norms: Sequence[Tensor], experts: Sequence[bool]) -> Tensor:
        return total_norm(norms)  # every gradient is averaged: as in one process

    def replay(self, experts: list[Tensor]) -> AbstractContextManager[list[Tensor]]:
        return without_reducer(self, experts)

    def live_grads(self) -> list[Tensor]:
        """Expert gradients held between their reduction and their update (memory accounting)."""
        return []

    def _check_tag(self, name: str, reduced: str) -> None:
        if reduced:
            raise SonarUsageError(
                f"{name}: a compiled graph reduced this gradient as {reduced!r}, but this model averages "
                f"over {self.tag!r}: the graph was compiled for another process group or world size. Compile "
                "each distributed model in the process group it trains in."
            )

    def _start(self, grad: Tensor, *, in_place: bool) -> tuple[Tensor, dist.Work | None]:
        # DDP multiplies by 1/world as it copies into its bucket (reducer: mul_out with 1/div_factor).
        scaled = grad.mul_(1.0 / self.world_size) if in_place else grad * (1.0 / self.world_size)
        scaled = scaled.contiguous()  # a graph's gradient may be a transposed view; collectives need dense
        self.reduced_here += 1
        return scaled, dist.all_reduce(scaled, group=self.group, async_op=True)

    @staticmethod
    def _wait(started: tuple[Tensor, dist.Work | None]) -> Tensor:
        grad, work = started
        if work is not None:
            work.wait()
        return grad


@dataclass
class AsyncMeanAllReduce(MeanAllReduce):
    """DDP, asynchronous: start each all-reduce, update the previous expert when the next arrives."""

    name: str = "ddp-async"
    pending: list[tuple[Tensor, dist.Work | None, Update]] = field(default_factory=list)
    _task: int | None = None

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        refuse_unsynced(name, self)
        if reduced == self.tag:
            update(grad)
            return
        self._check_tag(name, reduced)
        task = torch._C._current_graph_task_id()
        if self._task != task:
            self._drop_stale()
            self._task = task
            # Runs when this backward ends (never if it raises): the last expert's update.
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        scaled, work = self._start(grad, in_place=path == "hook")
        self.pending.append((scaled, work, update))
        while len(self.pending) > 1:
            self._finish_oldest()

    def flush(self) -> None:
        """Finish every pending all-reduce and update (end of backward)."""
        while self.pending:
            self._finish_oldest()
        self._task = None

    def live_grads(self) -> list[Tensor]:
        return [g for g, _, _ in self.pending]

    def _finish_oldest(self) -> None:
        grad, work, update = self.pending.pop(0)
        update(self._wait((grad, work)))

    def _drop_stale(self) -> None:
        """A backward that raised left all-reduces behind: complete them (every rank started them) and
        drop their updates; the optimizer's step tracker reports that step as interrupted."""
        for grad, work, _ in self.pending:
            self._wait((grad, work))
        self.pending.clear()


@dataclass
class ShardedGrads:
    """FSDP2: the hook receives the reduce-scattered shard; update it as it is."""

    name: str = "fsdp2"
    in_graph: Literal["update", "all_reduce", "hooks"] = "hooks"
    group_name: str | None = None
    world_size: int = 1
    unsharded: Callable[[list[Tensor]], list[Tensor]] | None = None
    """Sharded expert parameters -> the unsharded ones FSDP2 computes with (set by `fsdp2`): pass 2 of
    expert_clip="global" differentiates those (autograd never reaches a sharded parameter)."""
    expert_group: dist.ProcessGroup | None = None
    """2-D layouts: the group over which ranks hold different experts (expert parallelism beside
    FSDP2), which every rank-dependent decision spans too; None: FSDP2 alone."""
    deferred_step: Callable[[], StepReduce] | None = None
    """schedule="deferred": the loop check and the reduce-scatter of each gradient computed at step()
    (`deferred_sharded.ShardedDeferred.at_step`, set by `fsdp2` / `fsdp2_ep`)."""
    unsynced_backward: Callable[[], bool] | None = None
    """schedule="deferred": whether the last forward ran without gradient sync (FSDP2 then holds its
    dense gradients unsharded, and no `.grad` exists until a synced backward: no step comes before it)."""

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        if path != "hook" or reduced:
            raise SonarUsageError(
                f"{name}: a compiled graph produced this FSDP2-managed expert gradient, i.e. the unsharded, "
                "unreduced one; FSDP2 reduce-scatters it only after the graph. Updating it would train "
                "silently wrong: compile per block (sonar_fx.distributed.fsdp2(..., compiler=...)), where "
                "FSDP2's hooks hand Sonar the reduced shard."
            )
        update(grad)

    def at_step(self) -> StepReduce:
        if self.deferred_step is None:
            raise SonarUsageError(not_deferred(self.name))
        return self.deferred_step()

    def holds_dense_grads(self) -> bool:
        """Whether FSDP2 holds the dense gradients of the last backward itself (no gradient sync)."""
        return self.unsynced_backward is not None and self.unsynced_backward()

    def any_rank(self, local: bool) -> bool:
        if self.expert_group is not None:  # other ranks hold other experts: ask all of them
            return any_rank(local)
        # Shard flags come from DTensor reductions and the dense norm is global: the same on every rank.
        return local

    def global_norm(self, norms: Sequence[Tensor], experts: Sequence[bool]) -> Tensor:
        if self.expert_group is None:
            return plain(total_norm(norms))  # DTensor partial norms, reduced as clip_grad_norm_ does
        dense, own = split_norms(norms, experts)  # two meshes: dense over every rank, experts over dp
        return expert_parallel_norm(plain(dense), [plain(n) for n in own], self.expert_group)

    def replay(self, experts: list[Tensor]) -> AbstractContextManager[list[Tensor]]:
        if self.unsharded is None:
            raise SonarUsageError(
                "expert_clip='global' under FSDP2 differentiates the unsharded expert parameters, which "
                "sonar_fx.distributed.fsdp2 finds: build the model with it rather than a reduction by hand."
            )
        return nullcontext(self.unsharded(experts))

    def live_grads(self) -> list[Tensor]:
        return []


@dataclass
class LocalExperts:
    """Expert parallelism: gradients are complete on the owning rank; scale them by 1/world."""

    group: dist.ProcessGroup
    name: str = "ep"
    in_graph: Literal["update", "all_reduce", "hooks"] = "update"
    group_name: str | None = None
    wrapper: DistributedDataParallel | None = None
    """The DDP module of the dense parameters (set by `expert_parallel`), for `replay` and
    `refuse_unsynced`."""
    replaying: bool = False
    """Inside pass 2 of expert_clip="global" (`without_reducer`)."""
    forward_syncs: ForwardSyncs | None = None
    """schedule="deferred": which forwards of the step synced (set by `expert_parallel`)."""

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        refuse_unsynced(name, self)
        if reduced:
            raise SonarUsageError(
                f"{name}: expert-parallel experts are local to their rank; a graph all-reduced their "
                f"gradient ({reduced}), which would mix different experts. Compile the model after "
                "sonar_fx.distributed.expert_parallel, in this process group."
            )
        scale = 1.0 / self.world_size
        update(grad.mul_(scale) if path == "hook" else grad * scale)

    def at_step(self) -> StepReduce:
        refuse_unmatched_syncs(self.forward_syncs)  # the dense half's DDP synced the last only
        scale = 1.0 / self.world_size  # the rank's own experts: data-parallel averaging, no collective
        return lambda name, grad: Reduced(grad.mul_(scale))  # so nothing in flight, nothing to overlap

    def any_rank(self, local: bool) -> bool:
        # Each rank holds different experts: one rank's non-finite gradient must stop every rank.
        return any_rank(local, self.group)

    def global_norm(self, norms: Sequence[Tensor], experts: Sequence[bool]) -> Tensor:
        return expert_parallel_norm(*split_norms(norms, experts), self.group)

    def replay(self, experts: list[Tensor]) -> AbstractContextManager[list[Tensor]]:
        return without_reducer(self, experts)

    def live_grads(self) -> list[Tensor]:
        return []
