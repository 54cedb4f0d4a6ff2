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

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.reduction import Update
from sonar_fx.passes.reduce_grads import GraphReduce


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


@dataclass
class MeanAllReduce:
    """DDP: `grad * (1/world)`, all-reduce sum over `group`, update (see the module docstring)."""

    group: dist.ProcessGroup
    name: str = "ddp"
    in_graph: Literal["update", "all_reduce", "hooks"] = "all_reduce"
    reduced_here: int = 0
    """Gradients this object all-reduced itself (hooks, or graphs compiled without the all-reduce)."""

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
        if reduced == self.tag:
            update(grad)  # the graph averaged it already
            return
        self._check_tag(name, reduced)
        update(self._wait(self._start(grad, in_place=path == "hook")))

    def any_rank(self, local: bool) -> bool:
        # Every expert and dense gradient is averaged before use, so every rank sees the same flags.
        return local

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

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        if path != "hook" or reduced:
            raise SonarUsageError(
                f"{name}: a compiled graph produced this FSDP2-managed expert gradient, i.e. the unsharded, "
                "unreduced one; FSDP2 reduce-scatters it only after the graph. Updating it would train "
                "silently wrong: compile per block (sonar_fx.distributed.fsdp2(..., compiler=...)), where "
                "FSDP2's hooks hand Sonar the reduced shard."
            )
        update(grad)

    def any_rank(self, local: bool) -> bool:
        # Shard flags come from DTensor reductions and the dense norm is global: the same on every rank.
        return local

    def live_grads(self) -> list[Tensor]:
        return []


@dataclass
class LocalExperts:
    """Expert parallelism: gradients are complete on the owning rank; scale them by 1/world."""

    group: dist.ProcessGroup
    name: str = "ep"
    in_graph: Literal["update", "all_reduce", "hooks"] = "update"
    group_name: str | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        if reduced:
            raise SonarUsageError(
                f"{name}: expert-parallel experts are local to their rank; a graph all-reduced their "
                f"gradient ({reduced}), which would mix different experts. Compile the model after "
                "sonar_fx.distributed.expert_parallel, in this process group."
            )
        scale = 1.0 / self.world_size
        update(grad.mul_(scale) if path == "hook" else grad * scale)

    def any_rank(self, local: bool) -> bool:
        # Each rank holds different experts: one rank's non-finite gradient must stop every rank.
        return any_rank(local, self.group)

    def live_grads(self) -> list[Tensor]:
        return []
