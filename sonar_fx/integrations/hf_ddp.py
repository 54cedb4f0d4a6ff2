"""SonarTrainer under torchrun: the Trainer's own DDP (accelerate wraps the model), Sonar's experts beside it.

Started by torchrun, transformers' Trainer trains data-parallel: accelerate wraps the model in
`DistributedDataParallel` and accumulates under `no_sync()` on every micro-batch but the last. Left in
that DDP, an expert tensor would be updated from this rank's gradient (in-backward hooks fire before
DDP reduces; a deferred gradient is computed at `step()` from this rank's operands) and train
silently wrong. So a model SonarTrainer prepares for a distributed run is set up as
`sonar_fx.distributed.ddp` sets it up (`beside_ddp`): experts kept out of any DDP built on it and
broadcast from rank 0, each expert gradient averaged as DDP averages it; once accelerate has built
its DDP module, `attach_to_trainer_ddp` hands it to Sonar (which micro-batches it synced: the deferred
step's loop rule, which the Trainer's accumulation meets). The result is bitwise the plain Trainer on
the same ranks at world size 2 (tests/test_distributed_trainer_deferred.py).

Every other way the Trainer runs on several devices is refused, naming the fix: when the Trainer is
built, FSDP and DeepSpeed (they shard or reduce the experts themselves), one process driving several
GPUs (`nn.DataParallel`) (`trainer_engine`, before anything is prepared) and a model prepared for one
process that the Trainer would wrap in DDP (`refuse_one_process_model`); before the first step, a
wrapper accelerate built other than a DDP of the model (`attach_to_trainer_ddp`).
Never: build the DDP module itself (accelerate's is the plain Trainer's) or reduce a dense gradient.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.optimizer import Schedule, SonarOptimizer

TrainerEngine = Literal["single", "ddp"]


def trainer_engine(args: Any) -> TrainerEngine:
    """Where the Trainer with `args` trains: one process ("single"), or data-parallel over the
    processes torchrun started ("ddp"). Any other layout is refused, naming the fix."""
    from transformers.training_args import ParallelMode

    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if fsdp or deepspeed:
        engine = "FSDP" if fsdp else "DeepSpeed"
        raise SonarUsageError(
            f"SonarTrainer with the Trainer's {engine}: {engine} shards or reduces the expert gradients "
            "itself, after Sonar would have used them, and no test shows Sonar exact there. Train "
            "data-parallel with the Trainer's own DDP (torchrun without fsdp / deepspeed arguments), or "
            "use sonar_fx.distributed.fsdp2 in a loop of your own."
        )
    mode = args.parallel_mode
    if mode == ParallelMode.NOT_DISTRIBUTED:
        raise SonarUsageError(
            f"SonarTrainer on {args.n_gpu} GPUs in one process (the Trainer's nn.DataParallel): each "
            "replica's backward would update the experts from its own gradient. Start one process per GPU "
            "with torchrun (the Trainer's DDP, which SonarTrainer runs exactly), or make one GPU visible."
        )
    if mode == ParallelMode.DISTRIBUTED and args.world_size > 1:
        return "ddp"
    if mode not in (ParallelMode.NOT_PARALLEL, ParallelMode.DISTRIBUTED):
        raise SonarUsageError(
            f"SonarTrainer under the Trainer's {mode.value} mode: not verified (Sonar runs in one process "
            "or data-parallel under torchrun); train with one of those."
        )
    return "single"


def prepare_beside_trainer_ddp(
    model: nn.Module, cfg: OptimizerConfig, device: Any, *, compiler: str, schedule: Schedule
) -> nn.Module:
    """`model` prepared for the Trainer's DDP (`sonar_fx.distributed.ddp.beside_ddp` over the default
    process group, which accelerate joined); `attach_to_trainer_ddp` completes it once wrapped. It is
    moved to the rank's `device` first, as the Trainer would move it: the experts are broadcast from
    rank 0 here, on the backend's device (NCCL: this rank's GPU)."""
    from sonar_fx.distributed.ddp import beside_ddp

    group = dist.group.WORLD
    assert group is not None  # trainer_engine said "ddp": the process group exists
    who = "SonarTrainer under torchrun"
    model = model.to(device)
    return beside_ddp(model, cfg, group, who, compiler=compiler, schedule=schedule)  # type: ignore[arg-type]


def reduced_as_ddp(optimizer: SonarOptimizer) -> bool:
    """Whether `optimizer` averages each expert gradient as DDP would (prepared by
    `prepare_beside_trainer_ddp` or `sonar_fx.distributed.ddp`)."""
    from sonar_fx.distributed.reductions import MeanAllReduce

    return isinstance(optimizer.distributed, MeanAllReduce)


def refuse_one_process_model(optimizer: SonarOptimizer) -> None:
    """A model the user prepared without the DDP reduction, given to a Trainer that will wrap it in DDP."""
    if not reduced_as_ddp(optimizer):
        raise SonarUsageError(
            "SonarTrainer under torchrun (the Trainer wraps the model in DDP) got a model prepared for one "
            "process: its experts would sit in DDP's buckets and be updated from this rank's gradient "
            "(in-backward hooks fire before DDP reduces; deferred gradients are computed from this rank's "
            "operands). Refused before anything trained. Pass the model unprepared (SonarTrainer sets "
            "Sonar up beside the Trainer's DDP), or prepare it with "
            "sonar_fx.integrations.hf.prepare_for_trainer(model, args)."
        )


def attach_to_trainer_ddp(wrapped: nn.Module, model: nn.Module, optimizer: SonarOptimizer) -> None:
    """After accelerate wrapped `model`: give Sonar the DDP module (`attach_ddp_wrapper`); a wrapper
    that is not a DDP of `model` (the Trainer took another route) is refused before the first step."""
    from sonar_fx.distributed.ddp import attach_ddp_wrapper

    inner = getattr(wrapped, "_orig_mod", wrapped)  # accelerate may torch.compile the DDP module
    if not isinstance(inner, DistributedDataParallel) or inner.module is not model:
        raise SonarUsageError(
            f"SonarTrainer under torchrun expected the Trainer to wrap the model in DistributedDataParallel, "
            f"found {type(wrapped).__name__}: Sonar averages each expert gradient beside DDP, which needs "
            "that wrapper. Refused before the first step; train with the Trainer's plain DDP (no FSDP, "
            "DeepSpeed, tensor or context parallelism)."
        )
    if getattr(optimizer.distributed, "wrapper", None) is not inner:
        attach_ddp_wrapper(inner, optimizer)
