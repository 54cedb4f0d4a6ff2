"""FSDP2 and expert parallelism in 2-D: the experts sharded by expert over one mesh dimension and by
FSDP2 over the other, the dense parameters by FSDP2 over every rank (torchtitan's MoE layout).

Legend: a 2-D device mesh ("dp", "ep") over all `world` ranks; an "ep" row holds all E experts, E/ep
per rank (tokens travel within the row by all-to-all, `ExpertParallelExperts`); a "dp" column holds
the same experts, and FSDP2 shards each rank's E/ep experts over the column (each experts module its
own `fully_shard` group on the "dp" mesh). Every rank trains on its own batch, so an expert's
gradient must average all `world` ranks' tokens: the all-to-all's backward sums the row's, FSDP2's
reduce-scatter sums the column's, and the experts' groups divide by `world` (not by dp, FSDP2's
default). Dense parameters are FSDP2-sharded over all ranks (a 1-D mesh of the default group).

`shard_fsdp2_ep(model, mesh)` lays a model out that way for any optimizer (the standard recipe);
`fsdp2_ep(model, cfg, mesh=mesh)` does it and sets Sonar up: FSDP2 calls the sharded experts' hooks
after the column's reduce-scatter, with the whole-world average, and Sonar updates the shard there.
Never: change the routing, or reduce an expert gradient other than through FSDP2 and the all-to-all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from sonar_fx import api
from sonar_fx.compiled import repeated_blocks
from sonar_fx.config import OptimizerConfig
from sonar_fx.distributed.deferred_sharded import set_up_deferred
from sonar_fx.distributed.expert_parallel import ExpertParallelExperts, shard_experts_, sharded_expert_names
from sonar_fx.distributed.fsdp import unsharded_params, warn_unless_own_groups
from sonar_fx.distributed.model_checks import refuse_unfit_model
from sonar_fx.distributed.reductions import ShardedGrads
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet, discover_experts
from sonar_fx.optim.optimizer import NonFinite, Schedule
from sonar_fx.optim.reduction import require_process_group

MESH_DIMS = ("dp", "ep")


def shard_fsdp2_ep(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    experts: Iterable[nn.Parameter | str] | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Lay `model` out on the 2-D `mesh` (see the module docstring); every rank must hold the same full
    weights before (e.g. the same seed). `experts` (parameters or names): only the experts modules
    holding them are laid out as experts, the others stay dense. Returns `model`, now an `FSDPModule`."""
    check_mesh(mesh)
    world = dist.get_world_size()
    layers = shard_experts_(model, mesh.get_group("ep"), experts)
    for name in layers:
        experts_module = model.get_submodule(name)
        fully_shard(experts_module, mesh=mesh["dp"], **fully_shard_kwargs)
        sharded = cast_fsdp(experts_module)
        sharded.set_gradient_divide_factor(float(world))  # every rank's tokens: average by world
        if dist.get_backend(mesh.get_group("dp")) == "gloo":
            sharded.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum: divide after
    every_rank = DeviceMesh.from_group(dist.group.WORLD, mesh.device_type)  # type: ignore[arg-type]
    # Every block that holds experts is its own group, laid out as experts or not.
    for _, block in repeated_blocks(model, [layer.name for layer in discover_experts(model)]):
        fully_shard(block, mesh=every_rank, **fully_shard_kwargs)
    fully_shard(model, mesh=every_rank, **fully_shard_kwargs)
    return model


def fsdp2_ep(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    mesh: DeviceMesh,
    compiler: api.Compiler = "eager",
    experts: Iterable[nn.Parameter | str] | None = None,
    nonfinite: NonFinite = "raise",
    fallback: bool = True,
    fully_shard_kwargs: dict[str, Any] | None = None,
    schedule: Schedule = "in_backward",
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Lay `model` out on the 2-D `mesh` (`shard_fsdp2_ep`, unless it is an `FSDPModule` already) and set
    Sonar up; its optimizer is `model.sonar`. `compiler` "aot_eager" / "inductor" compiles each block
    (the all-to-alls and FSDP2's collectives run between graphs; the hooks update, after FSDP2)."""
    require_process_group("sonar_fx.distributed.fsdp2_ep")
    gap = api.distributed_gap(opt_cfg, "fsdp2_ep", schedule)
    if gap is not None:  # refused before the model is laid out
        raise SonarUsageError(gap[1] + ".")
    refuse_unfit_model(model, "sonar_fx.distributed.fsdp2_ep", fsdp_root=True)
    if not isinstance(model, FSDPModule):
        shard_fsdp2_ep(model, mesh, experts=experts, **(fully_shard_kwargs or {}))
        if experts is not None:  # the laid-out modules are new: name their tensors
            experts = sharded_expert_names(
                [n for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]
            )
    warn_unless_own_groups(model, ExpertSet.discover(model, experts))
    reduction = ShardedGrads(
        name="fsdp2_ep", world_size=dist.get_world_size(), expert_group=mesh.get_group("ep"),
        unsharded=functools.partial(unsharded_params, model),
    )  # fmt: skip
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


def check_mesh(mesh: DeviceMesh) -> None:
    """A 2-D ("dp", "ep") mesh over every rank of the default group, in its order."""
    world = dist.get_world_size()
    if mesh.mesh_dim_names != MESH_DIMS or mesh.mesh.flatten().tolist() != list(range(world)):
        raise SonarUsageError(
            f"sonar_fx.distributed.fsdp2_ep needs a 2-D mesh over all {world} ranks named {MESH_DIMS}, e.g. "
            f"init_device_mesh('cpu', ({world // 2}, 2), mesh_dim_names=('dp', 'ep')); got "
            f"{mesh.mesh_dim_names} over {mesh.mesh.tolist()}."
        )


def cast_fsdp(module: nn.Module) -> FSDPModule:
    assert isinstance(module, FSDPModule)  # fully_shard made it one
    return module
