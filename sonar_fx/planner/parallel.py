"""Planning one rank of a data-parallel or expert-parallel run (`sonar-fx plan --parallel ... --world N`).

For: the per-rank peak of a step when `world` processes train together, from the one-process planned
step with what the engine changes on a rank:
- "ddp": every rank holds the whole model and its own batch. DDP's reducer holds a bucket copy of
  every gradient it reduces, for the whole run (`gradient_as_bucket_view=False`, its default): every
  parameter under the plain engine, the dense ones under Sonar (`sonar_fx.distributed.ddp` keeps the
  experts out of DDP). The deferred step's reduction of each expert gradient is in flight while the
  next one is computed (`sonar_fx.optim.deferred_pipeline`): planned with a reduction whose handles
  say so (`InFlight`), so the planned step holds what the rank holds;
- "ep": each rank holds E/world experts per layer (`sonar_fx.distributed.expert_parallel`); the
  routed slots it computes are, on average, its own batch's (batch x seq x top-k), so a rank is
  planned as the model with E/world experts and the same top-k; the dense parameters are DDP's
  (buckets for them). The rank's experts need no collective: nothing in flight.
- "fsdp2": refused, naming why: FSDP2's sharded step (all-gathered groups, reduce-scatter buffers,
  the deferred step's unsharded expert gradients) is not modelled, and no measured step checks it.
Never: start a process group, or plan what the engine does not run.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.models.families import EXPERT_COUNT_FIELDS
from sonar_fx.optim.norms import total_norm
from sonar_fx.optim.reduction import StepReduce, Update
from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.models import ModelSource

PARALLEL = ("ddp", "ep", "fsdp2")
"""Engines `--parallel` names (fsdp2 is refused, with why)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One rank of `world` processes under `engine`."""

    engine: Literal["ddp", "ep"]
    world: int

    def source(self, source: ModelSource) -> ModelSource:
        """The model one rank holds: expert parallelism keeps E/world experts per layer."""
        if self.engine != "ep":
            return source
        if source.config is None:
            raise PlanError(f"{source.name}: --parallel ep plans a transformers config's experts.")
        config = copy.deepcopy(source.config)
        fields = [f for f in EXPERT_COUNT_FIELDS if isinstance(getattr(config, f, None), int)]
        if not fields:
            raise PlanError(f"{source.name}: no expert count in its config to shard over --world.")
        experts = getattr(config, fields[0])
        top_k = getattr(config, "num_experts_per_tok", 1)
        if experts % self.world or experts // self.world < top_k:
            raise PlanError(
                f"{source.name}: {experts} experts over --world {self.world} ranks: expert parallelism "
                f"needs the experts to divide evenly, at least top-k ({top_k}) per rank."
            )
        setattr(config, fields[0], experts // self.world)
        return ModelSource(name=f"{source.name} (E/{self.world} per rank)", config=config)

    def bucket_bytes(self, model: nn.Module, sonar: bool) -> int:
        """DDP's buckets on a rank: a copy of every gradient DDP reduces (Sonar and expert parallelism
        keep the experts out of DDP)."""
        experts = {id(p) for p in ExpertSet.discover(model).params} if sonar or self.engine == "ep" else set()
        reduced = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
        return sum(p.numel() * p.element_size() for p in reduced)

    def set_up(self, optimizer: Any) -> None:
        """A Sonar optimizer on this rank reduces as the engine does (the deferred step: DDP's
        all-reduce in flight while the next gradient is computed)."""
        if self.engine == "ddp" and hasattr(optimizer, "distributed"):
            optimizer.distributed = InFlight(self.world)


def layout(parallel: str | None, world: int, methods: Sequence[str]) -> Layout | None:
    """The rank `--parallel` / `--world` ask for (None: one process), or a `PlanError` naming why not."""
    if parallel is None:
        if world != 1:
            raise PlanError(
                f"world={world}: name the engine the ranks run (--parallel {' | '.join(PARALLEL)})."
            )
        return None
    if parallel not in PARALLEL:
        raise PlanError(f"parallel {parallel!r}: choose from {', '.join(PARALLEL)}.")
    if parallel == "fsdp2":
        raise PlanError(
            "--parallel fsdp2: not planned yet. FSDP2's sharded step (each group's all-gathered "
            "parameters, the reduce-scatter buffers, the deferred step's unsharded expert gradients) is "
            "not modelled, and no measured step checks it; plan --parallel ddp or ep."
        )
    if world < 2:
        raise PlanError(f"--world {world}: a {parallel} run has 2 or more ranks.")
    return Layout(engine="ddp" if parallel == "ddp" else "ep", world=world)


@dataclass
class InFlight:
    """DDP's reduction of a planned rank: the mean over ranks is this rank's gradient scaled by
    1/world (the bytes are what matters), and the deferred step's reduction is in flight until waited,
    as DDP's asynchronous all-reduce is."""

    world_size: int
    name: str = "ddp"
    in_graph: Literal["update", "all_reduce", "hooks"] = "hooks"
    group_name: str | None = None

    def reduce_then_update(self, name: str, grad: Tensor, *, path: str, reduced: str, update: Update) -> None:
        update(grad.mul_(1.0 / self.world_size) if path == "hook" else grad * (1.0 / self.world_size))

    def any_rank(self, local: bool) -> bool:
        return local

    def global_norm(self, norms: Sequence[Tensor], experts: Sequence[bool]) -> Tensor:
        return total_norm(norms)

    def at_step(self) -> StepReduce:
        return lambda name, grad: _Waiting(grad.mul_(1.0 / self.world_size))

    def replay(self, experts: list[Tensor]) -> AbstractContextManager[list[Tensor]]:
        return nullcontext(experts)

    def live_grads(self) -> list[Tensor]:
        return []


@dataclass(frozen=True)
class _Waiting:
    grad: torch.Tensor
    in_flight: bool = True

    def wait(self) -> Tensor:
        return self.grad
