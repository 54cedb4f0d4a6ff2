"""Sonar under DistributedDataParallel: dense parameters through DDP, experts beside it.

DDP's buckets persist across steps and hold every gradient they cover, and a post-accumulate-grad
hook fires before DDP has reduced the gradient it sees, so experts left in DDP would either save no
memory or train on local gradients. `ddp(model, cfg)` therefore keeps the expert tensors out of DDP
(`_set_params_and_buffers_to_ignore_for_model`), broadcasts them from rank 0 itself (DDP broadcasts
only what it manages), and gives the optimizer a reduction that averages each expert gradient across
ranks before its update: in the hook (eager), or in the backward graph (compiled; one graph, or the
bucket-sized subgraphs of DDP's optimizer). Dense parameters keep DDP's normal path. It never changes
the model's arithmetic: the result is bitwise equal to DDP + fused AdamW with dense-only clipping at
world size 2 (see the README for larger worlds). The wrapper it returns (`SonarDDP`) refuses what
would reach DDP's buckets and miss the experts: a communication hook, `join()` for uneven inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sonar_fx import api
from sonar_fx.config import OptimizerConfig
from sonar_fx.distributed.deferred import watch_forward_syncs
from sonar_fx.distributed.model_checks import refuse_unfit_model
from sonar_fx.distributed.reductions import AsyncMeanAllReduce, MeanAllReduce
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.optimizer import NonFinite, Schedule, SonarOptimizer
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
    schedule: Schedule = "in_backward",
    **torch_compile_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap `model` (unwrapped, on this rank's device) in DDP for Sonar training; its optimizer is
    `wrapped.sonar` (also `model.sonar`).

    `compiler`: "eager" (hooks), "aot_eager" or "inductor" (the graph pass all-reduces each expert
    gradient in the backward graph; DDP's optimizer may split the graph, both work). `async_reduce`
    (eager): overlap each expert all-reduce with the next layer's backward, one more expert gradient
    alive. `ddp_kwargs` go to `DistributedDataParallel` (e.g. `gradient_as_bucket_view=True`).
    `schedule="deferred"` (see `sonar_fx.compile`): each expert gradient computed at `step()` and
    averaged across ranks there (`sonar_fx.distributed.deferred`), so a compiled graph keeps operands
    and reduces nothing; accumulate with `no_sync()` on every micro-batch but the last, as DDP does.
    """
    group = require_process_group("sonar_fx.distributed.ddp", process_group)
    if async_reduce and compiler != "eager":
        raise ValueError(
            "async_reduce=True is the eager hooks' overlap; compiled graphs overlap their all-reduce already "
            "(it is waited for just before the next expert's weight gradient). Drop one of the two."
        )
    model = beside_ddp(
        model, opt_cfg, group, "sonar_fx.distributed.ddp", compiler=compiler, async_reduce=async_reduce,
        experts=experts, nonfinite=nonfinite, fallback=fallback, regional=regional, schedule=schedule,
        **torch_compile_kwargs,
    )  # fmt: skip
    wrapped = SonarDDP(model, process_group=group, **(ddp_kwargs or {}))
    wrapped.__dict__["sonar"] = api.sonar_of(model)
    attach_ddp_wrapper(wrapped, api.sonar_of(model))
    return wrapped


def beside_ddp(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    group: dist.ProcessGroup,
    who: str,
    *,
    compiler: api.Compiler = "eager",
    async_reduce: bool = False,
    schedule: Schedule = "in_backward",
    **compile_kwargs: Any,
) -> nn.Module:
    """`ddp` up to the wrapper, for a caller whose own code builds the DDP module (transformers'
    Trainer, through accelerate): Sonar prepared with the reduction that averages each expert gradient
    as DDP would, the experts kept out of any DDP built on `model` later and broadcast from rank 0.
    Hand the wrapper to `attach_ddp_wrapper` once it exists; `compile_kwargs` go to `sonar_fx.compile`."""
    refuse_unfit_model(model, who, group)
    # Deferred: a compiled graph keeps operands and reduces nothing; each gradient is reduced at step().
    in_graph: Literal["update", "all_reduce"] = "update" if schedule == "deferred" else "all_reduce"
    reduction = (AsyncMeanAllReduce if async_reduce else MeanAllReduce)(group, in_graph=in_graph)
    model = api.compile(model, opt_cfg, compiler=compiler, distributed=reduction, schedule=schedule,
                        **compile_kwargs)  # fmt: skip
    optimizer = api.sonar_of(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names(optimizer))
    broadcast_experts_(optimizer, group)
    return model


def attach_ddp_wrapper(wrapped: DistributedDataParallel, optimizer: SonarOptimizer) -> None:
    """Give the reduction of `beside_ddp` the DDP module of the dense parameters: expert_clip="global"
    replays its forward without DDP's reducer, the in-backward updates read whether DDP syncs this
    backward, and the deferred step which micro-batches it synced (each forward, recorded)."""
    reduction = optimizer.distributed
    assert isinstance(reduction, MeanAllReduce)  # set by beside_ddp
    reduction.wrapper = wrapped
    if optimizer.schedule == "deferred":  # the step checks that DDP synced its last micro-batch only
        reduction.forward_syncs = watch_forward_syncs(wrapped, optimizer)


class SonarDDP(DistributedDataParallel):
    """The DDP wrapper `ddp` and `expert_parallel` return: DDP itself, refusing what would reach the
    dense buckets and miss the experts, which Sonar reduces (or, under expert parallelism, exchanges)
    outside DDP: a communication hook (under `ddp`) and the uneven-inputs `join()`. Each is refused
    when it is called, before any gradient or weight moves."""

    experts_reduced_by_ddp_twin = True
    """The plain engine's DDP reduces the experts too (data parallelism), so a hook there reaches them;
    under expert parallelism the plain engine keeps them out of DDP as Sonar does, and a hook on the
    dense buckets is the same in both (`expert_parallel` sets False)."""

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        if not self.experts_reduced_by_ddp_twin:
            super().register_comm_hook(state, hook)
            return
        raise SonarUsageError(
            f"DDP.register_comm_hook({getattr(hook, '__name__', hook)!r}): a communication hook runs on "
            "DDP's buckets, which hold the dense gradients only; Sonar reduces each expert gradient itself, "
            "in its own dtype, inside backward, so the hook would apply to the dense gradients and not to "
            "the experts (plain DDP applies it to every gradient). Train without the hook (for bf16 "
            "communication, train the model in bf16)."
        )

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        if not self.experts_reduced_by_ddp_twin:
            super()._register_builtin_comm_hook(comm_hook_type)
            return
        self.register_comm_hook(None, comm_hook_type)

    def _register_fused_optim(self, optim: type, *args: Any, **kwargs: Any) -> None:
        raise SonarUsageError(
            "DDP._register_fused_optim: Sonar's optimizer (wrapped.sonar) already updates the experts in "
            "backward and the dense parameters at step(); a second optimizer in DDP's buckets would step "
            "the dense parameters twice. Use wrapped.sonar alone."
        )

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise SonarUsageError(_JOIN_REFUSED)

    def join_hook(self, **kwargs: Any) -> Any:
        raise SonarUsageError(_JOIN_REFUSED)


_JOIN_REFUSED = (
    "DDP.join() (uneven inputs): a rank that runs out of batches shadows the all-reduces of DDP's buckets, "
    "not the collectives Sonar runs for the experts (one all-reduce per expert tensor under DDP, the "
    "all-to-alls of expert parallelism), so the ranks' collectives would mismatch: gloo aborts, NCCL can "
    "hang. Refused before any rank joined. Give every rank the same number of batches (a "
    "DistributedSampler with drop_last=True, or each rank's count cut to the smallest by an "
    "all_reduce(MIN))."
)


def expert_names(optimizer: SonarOptimizer) -> list[str]:
    """Qualified names of the optimizer's expert tensors (as `model.named_parameters()` spells them)."""
    return optimizer.experts.names


@torch.no_grad()
def broadcast_experts_(optimizer: SonarOptimizer, group: dist.ProcessGroup) -> None:
    """Give every rank rank 0's expert weights (DDP broadcasts only the parameters it manages)."""
    src = dist.get_global_rank(group, 0)
    for param in optimizer.experts.params:
        dist.broadcast(param.data, src=src, group=group)
