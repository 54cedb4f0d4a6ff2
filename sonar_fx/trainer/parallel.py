"""This process's place in a run: one process, or `--parallel ddp|fsdp2|ep|fsdp2_ep` on every process
torchrun started.

For: `Parallel` (the engine, rank and world size; one process is world 1, so the trainer never asks
whether a run is distributed), its process group, each rank's batch (all ranks draw the same `world`
batches from one seeded stream and keep their own, so the stream state is the same everywhere and
resumes exactly), the agreement of ranks (mean loss, stop requests, a barrier) and the checkpoint
files: rank 0 writes the run's files; on the sharded engines every other rank writes its own
`checkpoint.rank<r>.pt` beside it, holding its local shards (FSDP2 DTensors as local tensors). The
method is built on `Parallel.engine` by `sonar_fx.methods.build_method`, like any other. A checkpoint
resumes on the same engine and world size only. Never: write from a rank other than 0 outside its own
checkpoint file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sonar_fx import data as D
from sonar_fx.config import ConfigFieldError
from sonar_fx.distributed.reductions import any_rank, collective_device
from sonar_fx.engines import ENGINES, SINGLE_PROCESS, Engine, FSDP2EPEngine
from sonar_fx.methods import Execution, Method, TrainingMethod, check_engine
from sonar_fx.trainer.config import ConfigError
from sonar_fx.trainer.validate import field_error


@dataclass(frozen=True)
class Parallel:
    """This process's place in a run (one process: the single-process engine, rank 0 of 1)."""

    engine: Engine = field(default_factory=lambda: SINGLE_PROCESS)
    rank: int = 0
    world: int = 1

    @property
    def writer(self) -> bool:
        """Rank 0 logs and writes the run's files."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Ranks hold different state (FSDP2 shards, EP experts): each saves its own checkpoint file."""
        return self.engine.sharded

    def checkpoint_path(self, path: Path) -> Path:
        """This rank's checkpoint file beside rank 0's `path`."""
        if self.rank == 0 or not self.sharded:
            return path
        return path.with_name(f"{path.stem}.rank{self.rank}{path.suffix}")

    def check(self, method: str, execution: Execution) -> None:
        """Refuse a method or execution mode the engine does not run, naming the flag."""
        try:
            check_engine(self.engine, Method.named(method), execution)
        except ConfigFieldError as exc:
            raise field_error(exc) from exc

    def join(self, device: str) -> bool:
        """Join torchrun's process group (gloo on CPU, nccl on CUDA); True if this call created it."""
        if not self.engine.distributed or dist.is_initialized():
            return False
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if dist.get_world_size() != self.world:
            raise RuntimeError(
                f"process group has {dist.get_world_size()} ranks, WORLD_SIZE says {self.world}"
            )
        return True

    def rank_batch(self, stream: D.BatchStream) -> tuple[dict[str, Tensor], int]:
        """This rank's batch of the step and the supervised tokens of the whole step (all ranks)."""
        batches = [stream.next_batch() for _ in range(self.world)]
        return batches[self.rank], sum(D.supervised_tokens(b) for b in batches)

    def mean_loss(self, loss: Tensor) -> float:
        """The step's loss as data parallelism averages it: the mean over ranks (synchronises)."""
        if not self.engine.distributed:
            return float(loss)
        total = loss.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / dist.get_world_size()

    def any_rank(self, local: bool) -> bool:
        """Whether `local` holds on any rank; every rank calls it at the same point."""
        return any_rank(local) if self.engine.distributed else local

    def from_writer(self, value: int) -> int:
        """Rank 0's `value` on every rank."""
        if not self.engine.distributed:
            return value
        held = torch.tensor([value], device=collective_device())
        dist.broadcast(held, src=0)
        return int(held)

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on."""
        if self.engine.distributed:
            dist.barrier()

    def checkpoint_views(self, model: nn.Module, method: TrainingMethod) -> tuple[Any, list[Any]]:
        """What a checkpoint saves and loads: the model and optimizers, DTensors as local tensors."""
        if not self.engine.local_state:
            return model, list(method.optimizers)
        return LocalState(model), [LocalState(opt) for opt in method.optimizers]


def from_env(engine: str | None, ep_size: int | None = None) -> Parallel:
    """The `Parallel` of `--parallel engine` from torchrun's RANK / WORLD_SIZE (one process without it);
    `ep_size`: `--ep-size`, fsdp2_ep's mesh (checked against the world here, before anything is built)."""
    if ep_size is not None and engine != "fsdp2_ep":
        ep = engine == "ep"
        instead = "--parallel ep shards experts over every rank" if ep else "use --parallel fsdp2_ep"
        raise ConfigError(
            f"--ep-size {ep_size}: the expert-parallel degree of --parallel fsdp2_ep's mesh; {instead} or "
            "drop --ep-size",
            flag="--ep-size",
        )
    if engine is None:
        return Parallel()
    if engine not in ENGINES:
        raise ConfigError(
            f"--parallel {engine!r} is invalid: expected one of {', '.join(ENGINES)}", flag="--parallel"
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"--parallel {engine} runs on the processes torchrun starts: "
            "torchrun --nproc-per-node 2 -m sonar_fx finetune ... --parallel " + engine,
            flag="--parallel",
        )
    chosen, world = ENGINES[engine], int(os.environ["WORLD_SIZE"])
    if isinstance(chosen, FSDP2EPEngine):
        chosen = replace(chosen, ep_size=ep_size)
        try:
            chosen.mesh_shape(world)
        except ConfigFieldError as exc:
            raise field_error(exc) from exc
    return Parallel(chosen, int(os.environ["RANK"]), world)


# ------------------------------------------------------------------------------------ checkpoints


class LocalState:
    """`state_dict()` / `load_state_dict()` of a module or optimizer with every DTensor as its local
    shard, so a rank's checkpoint file holds plain tensors (FSDP2); anything else passes through."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return _map(self.obj.state_dict(), lambda t, _: t.to_local() if hasattr(t, "to_local") else t)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Any:
        init = getattr(self.obj, "init_state", None)
        if init is not None:
            init()  # a fresh SonarOptimizer: templates for the DTensor states
        elif isinstance(self.obj, torch.optim.Optimizer) and not self.obj.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.obj)
        current = self.obj.state_dict()
        rebuilt = _map(state, lambda t, where: _like(t, _at(current, where)))
        if isinstance(self.obj, nn.Module):
            return self.obj.load_state_dict(rebuilt, strict=strict)
        return self.obj.load_state_dict(rebuilt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.obj, name)


def _like(saved: Tensor, template: Any) -> Tensor:
    if hasattr(template, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(saved, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())  # fmt: skip
    return saved


def _map(obj: Any, fn: Any, where: tuple[Any, ...] = ()) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj, where)
    if isinstance(obj, Mapping):
        return {k: _map(v, fn, (*where, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, fn, (*where, i)) for i, v in enumerate(obj)]
    return obj


def _at(obj: Any, where: tuple[Any, ...]) -> Any:
    for key in where:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj
