"""Planning one rank of a parallel run (`sonar-fx plan --parallel ddp|ep|fsdp2 --world N`).

For: the per-rank peak of a step when `world` processes train together: the one-process planned step
with what the engine changes on a rank (DDP, expert parallelism), or the engine's own step (FSDP2):
- "ddp": every rank holds the whole model and its own batch. DDP's reducer holds a bucket copy of
  every gradient it reduces, for the whole run (`gradient_as_bucket_view=False`, its default): every
  parameter under the plain engine, the dense ones under Sonar (`sonar_fx.distributed.ddp` keeps the
  experts out of DDP). The deferred step's reduction of each expert gradient is in flight while the
  next one is computed (`sonar_fx.optim.deferred_pipeline`): planned with a reduction whose handles
  say so (`InFlight`), so the planned step holds what the rank holds;
- "ep": each rank holds E/world experts per layer (`sonar_fx.distributed.expert_parallel`) and the
  whole router (E outputs, top-k). Every rank routes its batch x seq x top-k slots over all E experts
  and sends each to the rank owning its expert: with El = E/world local experts a rank receives, in
  expectation, El/E of every rank's slots, world x (batch x seq x top-k) x El/E = batch x seq x top-k
  (exactly that when every token picks every expert, top-k = E), however El compares with top-k: one
  expert per rank (El = 1) computes batch x seq x top-k slots, not batch x seq. So a rank is planned as
  the whole model (router included) whose experts modules hold El experts and receive all of the
  rank's slots (`ExpertShardSource`); the dense parameters are DDP's (buckets for them). The rank's
  experts need no collective: nothing in flight.
- "fsdp2": FSDP2 itself runs the rank's step (`engines.FSDP2Engine`, each experts module its own
  `fully_shard` group, as `sonar_fx.distributed.fsdp2` lays it out) on the fake model, as rank 0 of
  `world` on torch's "fake" process group (collectives that move no data, in this process; made for
  the plan and destroyed after it). So the plan holds what FSDP2 holds, from FSDP2's own code: each
  rank's shards of weights, gradients and optimizer states, each group's all-gathered parameters from
  its forward to its reshard (the next group's prefetched in backward), the unsharded gradients the
  loop's `set_requires_gradient_sync(False)` micro-batches accumulate, the reduce-scatter buffers; and
  the deferred step's kept operands and each expert gradient's reduce-scatter in flight while the next
  is computed. Rank 0 is planned, the holder of the largest shards (`fully_shard` splits dim 0 as
  `torch.chunk` does); another rank differs by its smaller shards and by when a gloo thread lets go of
  a collective's buffer (0.1% on the measured step, `benchmarks.distributed_deferred --plan`).
Never: start a process group that communicates, or plan what the engine does not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from sonar_fx.engines import SINGLE_PROCESS, Engine, FSDP2Engine
from sonar_fx.experts.discovery import ExpertSet, discover_experts
from sonar_fx.models.families import EXPERT_COUNT_FIELDS
from sonar_fx.optim.norms import total_norm
from sonar_fx.optim.reduction import StepReduce, Update
from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.models import ModelSource

PARALLEL = ("ddp", "ep", "fsdp2")
"""Engines `--parallel` names."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One rank of `world` processes under `engine`."""

    engine: Literal["ddp", "ep", "fsdp2"]
    world: int

    def source(self, source: ModelSource) -> ModelSource:
        """The model one rank holds: expert parallelism keeps E/world experts per layer."""
        if self.engine != "ep":
            return source
        if source.config is None:
            raise PlanError(f"{source.name}: --parallel ep plans a transformers config's experts.")
        fields = [f for f in EXPERT_COUNT_FIELDS if isinstance(getattr(source.config, f, None), int)]
        if not fields:
            raise PlanError(f"{source.name}: no expert count in its config to shard over --world.")
        experts = getattr(source.config, fields[0])
        if experts % self.world:  # the engine's own refusal (`expert_parallel.uneven_split`)
            raise PlanError(
                f"{source.name}: {experts} experts over --world {self.world} ranks: expert parallelism "
                f"needs the experts to divide evenly (each rank holds E/{self.world}); plan a --world that "
                f"divides {experts}."
            )
        return ExpertShardSource(
            name=f"{source.name} (E/{self.world} per rank)", config=source.config,
            local_experts=experts // self.world,
        )  # fmt: skip

    def bucket_bytes(self, model: nn.Module, sonar: bool) -> int:
        """DDP's buckets on a rank: a copy of every gradient DDP reduces (Sonar and expert parallelism
        keep the experts out of DDP; FSDP2 has none: its planned step holds its own buffers)."""
        if self.engine == "fsdp2":
            return 0
        experts = {id(p) for p in ExpertSet.discover(model).params} if sonar or self.engine == "ep" else set()
        reduced = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
        return sum(p.numel() * p.element_size() for p in reduced)

    def set_up(self, optimizer: Any) -> None:
        """A Sonar optimizer on this rank reduces as the engine does (the deferred step: DDP's
        all-reduce in flight while the next gradient is computed)."""
        if self.engine == "ddp" and hasattr(optimizer, "distributed"):
            optimizer.distributed = InFlight(self.world)

    @contextlib.contextmanager
    def running(self) -> Iterator[Engine]:
        """The engine the rank's planned step runs on, for the plan's duration: one process for DDP and
        expert parallelism (the step, with what the engine changes on a rank); FSDP2 itself for fsdp2,
        on a fake process group made here and destroyed after (see the module docstring)."""
        if self.engine != "fsdp2":
            yield SINGLE_PROCESS
            return
        if dist.is_initialized():
            raise PlanError(
                "--parallel fsdp2 runs FSDP2 on a fake process group of its own (torch's 'fake' backend, "
                "rank 0 of --world ranks), and this process has a process group already: plan before "
                "init_process_group, or with the sonar-fx plan command."
            )
        dist.init_process_group("fake", rank=0, world_size=self.world)
        try:  # the mesh is made before the plan's fake tensor mode, which cannot build one
            mesh = init_device_mesh("cpu", (self.world,))
            yield FSDP2Engine(mesh=mesh)
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True)
class ExpertShardSource(ModelSource):
    """One expert-parallel rank's model: the whole model as its config builds it (the router's E
    outputs and top-k included), each experts module holding `local_experts` experts. Its forward
    sends every routed slot to those experts: on fake tensors only the slot count (batch x seq x top-k,
    the rank's expected share; module docstring) and the weights' shapes set what is allocated."""

    local_experts: int

    def build(self, dtype: torch.dtype) -> nn.Module:
        model = super().build(dtype)
        for layer in discover_experts(model):
            if layer.layout != "transformers":  # the engine shards transformers' gate_up/down experts
                raise PlanError(f"{self.name}: --parallel ep plans transformers' experts modules, not "
                                f"{layer.name} ({layer.layout} experts).")  # fmt: skip
            module = model.get_submodule(layer.name)
            for tensor in layer.tensors:  # (E, ...) weights and per-expert biases, on the meta device
                held = torch.empty((self.local_experts, *tensor.param.shape[1:]), dtype=tensor.param.dtype,
                                   device=tensor.param.device)  # fmt: skip
                setattr(
                    module, tensor.name.rpartition(".")[2], nn.Parameter(held, tensor.param.requires_grad)
                )
            # What discovery and the experts' forward read (a plain int attribute of the module).
            module.num_experts = self.local_experts  # type: ignore[assignment]
        return model


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
    if world < 2:
        raise PlanError(f"--world {world}: a {parallel} run has 2 or more ranks.")
    return Layout(engine=parallel, world=world)  # type: ignore[arg-type]


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
