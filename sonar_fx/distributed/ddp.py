"""Sonar under DistributedDataParallel: dense parameters through DDP, experts beside it.

DDP's buckets persist across steps and hold every gradient they cover, and a post-accumulate-grad
hook fires before DDP has reduced the gradient it sees, so experts left in DDP would either save no
memory or train on local gradients. `ddp(model, cfg)` therefore keeps the expert tensors out of DDP
(`_set_params_and_buffers_to_ignore_for_model`), broadcasts them from rank 0 itself (DDP broadcasts
only what it manages), and gives the optimizer a reduction that averages each expert gradient across
ranks before its update: in the hook (eager), or in the backward graph (compiled; one graph, or the
bucket-sized subgraphs of DDP's optimizer). Dense parameters keep DDP's normal path. It never changes
the model's arithmetic: the result is bitwise equal to DDP + fused AdamW with dense-only clipping at
world size 2 (see the README for larger worlds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sonar_fx import api
from sonar_fx.config import OptimizerConfig
from sonar_fx.distributed.reductions import AsyncMeanAllReduce, MeanAllReduce
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.optimizer import NonFinite, SonarOptimizer
from sonar_fx.optim.reduction import require_process_group


def ddp(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    compiler: api.Compiler = "eager",
    async_reduce: bool = False,
    experts: Iterable[nn.Parameter | str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    nonfinite: NonFinite = "raise",
    fallback: bool = True,
    regional: bool = False,
    ddp_kwargs: dict[str, Any] | None = None,
    **torch_compile_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap `model` (unwrapped, on this rank's device) in DDP for Sonar training; its optimizer is
    `wrapped.sonar` (also `model.sonar`).

    `compiler`: "eager" (hooks), "aot_eager" or "inductor" (the graph pass all-reduces each expert
    gradient in the backward graph; DDP's optimizer may split the graph, both work). `async_reduce`
    (eager): overlap each expert all-reduce with the next layer's backward, one more expert gradient
    alive. `ddp_kwargs` go to `DistributedDataParallel` (e.g. `gradient_as_bucket_view=True`).
    """
    group = require_process_group("sonar_fx.distributed.ddp", process_group)
    if async_reduce and compiler != "eager":
        raise ValueError(
            "async_reduce=True is the eager hooks' overlap; compiled graphs overlap their all-reduce already "
            "(it is waited for just before the next expert's weight gradient). Drop one of the two."
        )
    if isinstance(model, DistributedDataParallel):
        raise SonarUsageError(
            "sonar_fx.distributed.ddp wraps the model itself: pass the model before DistributedDataParallel."
        )
    reduction = AsyncMeanAllReduce(group) if async_reduce else MeanAllReduce(group)
    model = api.compile(
        model, opt_cfg, compiler=compiler, experts=experts, nonfinite=nonfinite, fallback=fallback,
        regional=regional, distributed=reduction, **torch_compile_kwargs,
    )  # fmt: skip
    optimizer = api.sonar_of(model)
    names = expert_names(optimizer)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    broadcast_experts_(optimizer, group)
    wrapped = DistributedDataParallel(model, process_group=group, **(ddp_kwargs or {}))
    wrapped.__dict__["sonar"] = optimizer
    return wrapped


def expert_names(optimizer: SonarOptimizer) -> list[str]:
    """Qualified names of the optimizer's expert tensors (as `model.named_parameters()` spells them)."""
    return optimizer.experts.names


@torch.no_grad()
def broadcast_experts_(optimizer: SonarOptimizer, group: dist.ProcessGroup) -> None:
    """Give every rank rank 0's expert weights (DDP broadcasts only the parameters it manages)."""
    src = dist.get_global_rank(group, 0)
    for param in optimizer.experts.params:
        dist.broadcast(param.data, src=src, group=group)
