"""What every engine builder refuses to take: a model in a state it cannot set up, named with what to
pass instead, before it shards, wraps or prepares anything.

A builder wraps, shards and prepares the model itself, so a model someone already wrapped (DDP),
sharded (`fully_shard`, expert parallelism) or left on a device its process group cannot reduce
would otherwise meet a raw torch assertion deep inside `fully_shard`, or train silently wrong (a
second expert-parallel split of experts already split). `refuse_unfit_model` is the one check the
builders call; `device_problem` is its device rule, a pure function of the parameters' devices.
It only reads the model; it never changes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from sonar_fx.errors import SonarUsageError


def refuse_unfit_model(
    model: nn.Module,
    who: str,
    group: dist.ProcessGroup | None = None,
    *,
    fsdp_root: bool = False,
    expert_parallel: bool = False,
) -> None:
    """Raise `SonarUsageError` if `who` cannot take `model` as it is. `fsdp_root`: the builder takes a
    model the user sharded whole (`fully_shard` applied to the root last, as FSDP2 requires);
    `expert_parallel`: it takes experts already sharded by expert parallelism (`shard=False`)."""
    wrappers = [n or "the model" for n, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
    if wrappers:
        raise SonarUsageError(
            f"{who}: {wrappers[0]} is already wrapped in DistributedDataParallel; {who} sets the engine up "
            "itself (its own wrapper keeps the experts out of DDP). Pass the model before DDP "
            "(wrapped.module)."
        )
    sharded = [n or "the model" for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded and not fsdp_root:
        raise SonarUsageError(
            f"{who}: {_listed(sharded)} already sharded by fully_shard; {who} needs the model unsharded. "
            "Pass the model before fully_shard, or train the sharded model with sonar_fx.distributed.fsdp2."
        )
    if sharded and not isinstance(model, FSDPModule):
        raise SonarUsageError(
            f"{who}: {_listed(sharded)} already sharded by fully_shard, but not the model itself. Pass the "
            "model unsharded (it shards each experts module, each block, then the root), or finish the "
            "layout with fully_shard(model) on the root and pass that."
        )
    split = _expert_parallel_modules(model)
    if split and not (expert_parallel or sharded):
        raise SonarUsageError(
            f"{who}: {_listed(split)} already holds this rank's share of the experts (expert "
            "parallelism); sharding or reducing them again would mix different experts. Pass the model "
            "before shard_experts_, or train it with sonar_fx.distributed.expert_parallel(model, cfg, "
            "shard=False, experts=[...])."
        )
    devices = {p.device for p in model.parameters()}
    # fully_shard moves parameters to its mesh's device itself (or offloads them to the CPU): only a
    # model with no data yet is unfit for it.
    problem = (
        meta_problem(devices)
        if fsdp_root
        else device_problem(devices, dist.get_backend(group), _cuda_index())
    )
    if problem is not None:
        raise SonarUsageError(f"{who}: {problem}")


def meta_problem(devices: set[torch.device]) -> str | None:
    """Parameters with no data yet (the meta device): Sonar trains the parameter objects it is given,
    and materialising (`to_empty`) replaces them."""
    if any(d.type == "meta" for d in devices):
        return (
            "the model has parameters on the meta device. Materialise and load it first (model.to_empty("
            "device=...), then load_state_dict), then pass it."
        )
    return None


def device_problem(devices: set[torch.device], backend: str, cuda_index: int | None) -> str | None:
    """Why parameters on `devices` cannot train under DDP (or expert parallelism's all-to-all) over a
    process group of `backend` (`cuda_index`: this process's current CUDA device, None without CUDA),
    with the fix; None when they can."""
    problem = meta_problem(devices)
    if problem is not None:
        return problem
    if len(devices) > 1:
        shown = ", ".join(sorted(map(str, devices)))
        return (
            f"the model's parameters lie on several devices ({shown}); every engine trains one device per "
            "rank. Move the model to this rank's device first (model.to(device))."
        )
    (device,) = devices or {torch.device("cpu")}
    if backend == "nccl" and (device.type != "cuda" or device.index not in (None, cuda_index)):
        return (
            f"the model is on {device}, but NCCL reduces CUDA tensors of this rank's device (cuda:"
            f"{cuda_index}). Call torch.cuda.set_device(local_rank) and model.to('cuda'), then pass it."
        )
    return None


def _expert_parallel_modules(model: nn.Module) -> list[str]:
    """Modules holding one rank's share of the experts (`ExpertParallelExperts` says so: this module
    sits below the builders, which import it, so it asks rather than imports the class)."""
    return [n for n, m in model.named_modules() if getattr(type(m), "holds_expert_shard", False)]


def _cuda_index() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} {'is' if len(names) == 1 else 'are'}"
