"""Sonar under FSDP2 (`fully_shard`): each rank updates its shard of each expert tensor in backward.

FSDP2 reduce-scatters a parameter group's gradients after its backward and then calls the
post-accumulate-grad hooks of the sharded parameters itself, each with its reduced `Shard(0)`
gradient: Sonar's hooks are exact there as they are. The saving needs the experts module to be its
own `fully_shard` group: a sharded gradient is a view of its group's reduce-scatter output, so any
other gradient in the group (attention, norms) keeps the expert gradients' memory alive until
`step()`. `fully_shard_experts` shards a model that way (experts, then blocks, then the root);
`fsdp2` does that and prepares Sonar, eager or compiled per block (the reduce-scatter runs between
graphs, so a compiled graph never updates: its gradient would be the unsharded, local one).
`save_state` / `load_state` checkpoint model and optimizer with `torch.distributed.checkpoint`.
Never: reshard, move or cast a parameter other than through `fully_shard`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from sonar_fx import api
from sonar_fx.compiled import repeated_blocks
from sonar_fx.config import OptimizerConfig
from sonar_fx.distributed.deferred_sharded import set_up_deferred
from sonar_fx.distributed.model_checks import refuse_unfit_model
from sonar_fx.distributed.reductions import ShardedGrads
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet, discover_experts
from sonar_fx.optim.optimizer import NonFinite, Schedule, SonarOptimizer
from sonar_fx.optim.reduction import require_process_group


def fully_shard_experts(
    model: nn.Module, *, experts: Iterable[nn.Parameter | str] | None = None, **fully_shard_kwargs: Any
) -> nn.Module:
    """`fully_shard` each experts module as its own group, then each block that holds one, then the
    root; returns `model` (now an `FSDPModule`). `fully_shard_kwargs` go to every `fully_shard` call
    (mesh, reshard_after_forward, mp_policy, ...)."""
    layers = discover_experts(model, experts)
    for layer in layers:
        fully_shard(model.get_submodule(layer.name), **fully_shard_kwargs)
    for _, block in repeated_blocks(model, [layer.name for layer in layers]):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def fsdp2(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    compiler: api.Compiler = "eager",
    experts: Iterable[nn.Parameter | str] | None = None,
    nonfinite: NonFinite = "raise",
    fallback: bool = True,
    fully_shard_kwargs: dict[str, Any] | None = None,
    schedule: Schedule = "in_backward",
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Shard `model` with `fully_shard_experts` (unless it is an `FSDPModule` already) and prepare Sonar;
    its optimizer is `model.sonar`. `compiler` "aot_eager" / "inductor" compiles each block (hooks
    still do the updates, after FSDP2's reduce-scatter). Warns when an expert tensor shares its
    `fully_shard` group with other parameters (exact, but no memory saved)."""
    require_process_group("sonar_fx.distributed.fsdp2")
    gap = api.distributed_gap(opt_cfg, "fsdp2", schedule)
    if gap is not None:  # refused before the model is sharded
        raise SonarUsageError(gap[1] + ".")
    refuse_unfit_model(model, "sonar_fx.distributed.fsdp2", fsdp_root=True)
    if not isinstance(model, FSDPModule):
        fully_shard_experts(model, experts=experts, **(fully_shard_kwargs or {}))
    warn_unless_own_groups(model, ExpertSet.discover(model, experts))
    reduction = ShardedGrads(
        world_size=dist.get_world_size(), unsharded=functools.partial(unsharded_params, model)
    )
    if schedule == "deferred":  # a compiled block keeps operands; each gradient is reduced at step()
        reduction.in_graph = "update"
    api.compile(
        model, opt_cfg, compiler=compiler, experts=experts, nonfinite=nonfinite, fallback=fallback,
        regional=compiler != "eager", distributed=reduction, schedule=schedule, **torch_compile_kwargs,
    )  # fmt: skip
    if schedule == "deferred":
        deferred = set_up_deferred(model, api.sonar_of(model))
        reduction.deferred_step, reduction.unsynced_backward = deferred.at_step, deferred.unsynced_backward
    return model


def unsharded_params(model: nn.Module, params: list[Tensor]) -> list[Tensor]:
    """The unsharded parameter FSDP2 computes with for each sharded one of `params` (a parameter FSDP2
    keeps across steps, re-filled by each all-gather; it exists after the first forward). Autograd
    reaches these, never the sharded ones, whose gradients FSDP2 sets after its reduce-scatter."""
    by_id = {
        id(fsdp_param.sharded_param): fsdp_param
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    }
    missing = [
        i for i, p in enumerate(params) if id(p) not in by_id or not hasattr(by_id[id(p)], "_unsharded_param")
    ]
    if missing:
        raise SonarUsageError(
            f"{len(missing)} expert tensor(s) are not FSDP2 parameters that have run a forward: expert_clip="
            "'global' replays the forward of sharded experts only (shard them with fully_shard_experts)."
        )
    return [by_id[id(p)].unsharded_param for p in params]


def shared_groups(model: nn.Module, experts: ExpertSet) -> dict[str, list[str]]:
    """Expert tensor name -> the other parameters in its `fully_shard` group (empty: its own group)."""
    expert_ids = experts.names_by_id()
    others = {id(p): n for n, p in model.named_parameters() if id(p) not in expert_ids}  # frozen ones too
    return {
        name: [others[id(p)] for p in _group_params(_group_owner(model, name)) if id(p) in others]
        for name in experts.names
    }


def warn_unless_own_groups(model: nn.Module, experts: ExpertSet) -> None:
    crowded = {name: mates for name, mates in shared_groups(model, experts).items() if mates}
    if crowded:
        name, mates = next(iter(crowded.items()))
        warnings.warn(
            f"sonar_fx.distributed.fsdp2: {len(crowded)} expert tensor(s) share their fully_shard group with "
            f"other parameters (e.g. {name} with {mates[0]}): their gradients are views of one "
            "reduce-scatter buffer that the others keep alive, so Sonar saves no memory there (training "
            "stays exact). Shard each experts module on its own first: fully_shard_experts(model).",
            stacklevel=3,
        )


def _group_owner(model: nn.Module, param_name: str) -> nn.Module:
    """The innermost `FSDPModule` above the parameter `param_name` (its group)."""
    parts = param_name.split(".")[:-1]
    owner: nn.Module = model
    module: nn.Module = model
    for part in parts:
        module = module.get_submodule(part)
        if isinstance(module, FSDPModule):
            owner = module
    return owner


def _group_params(owner: nn.Module) -> list[nn.Parameter]:
    """Parameters `owner`'s group manages: its own, not those of nested `FSDPModule`s."""
    nested = [m for n, m in owner.named_modules() if n and isinstance(m, FSDPModule)]
    skip = {id(p) for m in nested for p in cast(nn.Module, m).parameters()}
    return [p for p in owner.parameters() if id(p) not in skip]


def save_state(path: str | Path, model: nn.Module, optimizer: SonarOptimizer, **extra: Any) -> None:
    """Save model and optimizer (dense and expert states) with `torch.distributed.checkpoint`: every
    rank writes its shards; `extra` entries (step, scheduler states) are saved beside them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd, **extra}, checkpoint_id=str(path))


def load_state(path: str | Path, model: nn.Module, optimizer: SonarOptimizer, **extra: Any) -> dict[str, Any]:
    """Load what `save_state` wrote into a model sharded the same way (same world size); `extra`
    gives the entries to read back beside model and optimizer (their templates)."""
    optimizer.init_state()  # the template: DCP loads into existing tensors
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, **extra}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {k: state[k] for k in extra}
