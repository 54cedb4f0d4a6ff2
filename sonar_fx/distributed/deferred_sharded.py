"""The deferred schedule on FSDP2 and FSDP2 x EP: each expert gradient computed at `step()` from the
rank's kept operands (unsharded: E x out x in, this rank's tokens only), then reduce-scattered to the
rank's `Shard(0)` slice exactly as FSDP2 reduces it, and the full one freed.

Three pieces, each set up by `sonar_fx.distributed.fsdp2` / `fsdp2_ep` under schedule="deferred":
- Capture. Autograd reaches FSDP2's unsharded parameters, never the sharded ones Sonar owns.
  `UnshardedAliases` binds each experts module's unsharded parameters (FSDP2 keeps one object per
  parameter across steps, re-filled by each all-gather) to the optimizer in Sonar's registry, so the
  eager capture and the graph pass keep their operands under the sharded parameter. The unsharded
  parameter then gets no gradient, and FSDP2 reduce-scatters nothing for it in backward.
- Reduction. FSDP2's `foreach_reduce` for one parameter, built from FSDP2's own pieces and its
  group's own settings (`_get_gradient_divide_factors`: ReduceOp.AVG for fp32/bf16, or PREMUL_SUM /
  SUM and a post-divide where the group forces sums or sets a divide factor, fp16's pre- and
  post-divide; the chunk_cat copy-in, where the gradient does not already lie so; the group's
  reduce-scatter; the cast to the parameter's dtype),
  so each element is the same op on the same operands as in plain FSDP2. It is split into
  `start_reduce_scatter` (the collective in flight) and `finish_reduce_scatter` (wait, give back the
  rank's shard as a DTensor): `step_reduce` starts it and the deferred step waits for it only after
  computing the next tensor's gradient (`sonar_fx.optim.deferred_pipeline`), so the collective
  overlaps that GEMM. A
  gradient that arrived whole (a use of the weight no capture keeps) went through FSDP2's own
  reduce-scatter in backward and reaches `step()` as that shard (a DTensor): it passes through.
- Loop rule. The deferred step sums a rank's micro-batches and reduces once: the arithmetic of FSDP2
  under `set_requires_gradient_sync(False)` for every micro-batch but the last. `GradientSyncs`
  records, at each gradient-enabled forward of the root, whether the experts' groups would reduce;
  `refuse_unmatched_gradient_syncs` refuses any other loop at `step()`, before any weight moves.
This module never updates a weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    _div_if_needed,
    _get_gradient_divide_factors,
    foreach_reduce_scatter_copy_in,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import _get_dim0_padded_size, _to_dtype_if_needed

from sonar_fx.distributed.deferred import DeferredHolder
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim import deferred_intake
from sonar_fx.optim.amp import scaler_step
from sonar_fx.optim.reduction import Reduced, Reducing, StepReduce
from sonar_fx.runtime import registry


@dataclass(frozen=True)
class ShardedExpert:
    """One expert tensor as FSDP2 manages it: its `FSDPParam` and the group that reduces it."""

    fsdp_param: Any  # torch's FSDPParam (private)
    group: Any  # torch's FSDPParamGroup (private): its reduce-scatter group, dtypes, divide factor


def sharded_experts(model: nn.Module, params: Iterable[Tensor]) -> dict[int, ShardedExpert]:
    """id(sharded expert parameter) -> its `ShardedExpert`, for each of `params`."""
    wanted = {id(p) for p in params}
    found = {
        id(fsdp_param.sharded_param): ShardedExpert(fsdp_param, group)
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        if id(fsdp_param.sharded_param) in wanted
    }
    missing = len(wanted) - len(found)
    if missing:
        raise SonarUsageError(
            f"schedule='deferred' on FSDP2: {missing} expert tensor(s) are not FSDP2 parameters; shard the "
            "model with sonar_fx.distributed.fully_shard_experts (sonar_fx.distributed.fsdp2 does)."
        )
    for expert in found.values():
        if expert.fsdp_param.fsdp_placement.dim != 0:
            raise SonarUsageError(
                f"schedule='deferred' on FSDP2 reduce-scatters each expert gradient to its Shard(0) slice; "
                f"an expert tensor is sharded as {expert.fsdp_param.fsdp_placement} (shard_placement_fn): "
                "shard expert tensors on dim 0 (FSDP2's default)."
            )
    return found


# ------------------------------------------------------------------------------------- the reduction


@dataclass
class PendingShard:
    """A reduce-scatter in flight: `finish_reduce_scatter` waits for it and gives the shard."""

    expert: ShardedExpert
    output: Tensor
    work: dist.Work | None
    postdivide: float | None
    buffer: Tensor | None
    """The reduce-scatter's input (world x shard; a view of the gradient where its layout is that
    input), alive until the collective completes."""


def start_reduce_scatter(expert: ShardedExpert, full: Tensor) -> PendingShard:
    """Start FSDP2's reduction of `full` (one expert tensor's unsharded local gradient, in the
    parameter's layout) over its group: FSDP2's divide factors and op, its world-chunked input
    (`_world_chunked`: `full` itself where its layout is that input), the group's reduce-scatter,
    asynchronously. The caller may drop `full` after (the pending shard keeps the input alive) but
    must not write it until `finish_reduce_scatter`."""
    group = expert.group
    rs_group = group._reduce_scatter_process_group
    world = rs_group.size()
    reduce_dtype = group._reduce_dtype or full.dtype
    predivide, postdivide, op, _ = _get_gradient_divide_factors(
        rs_group, None, reduce_dtype, group.device.type, group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
    )  # fmt: skip
    padded = _get_dim0_padded_size(full.size(), world)
    rs_input = _world_chunked(full, padded, reduce_dtype, predivide, world)
    output = torch.empty((padded.numel() // world,), dtype=reduce_dtype, device=full.device)
    _div_if_needed(rs_input, predivide)
    if world > 1:
        work = group._reduce_scatter_comm(
            output_tensor=output, input_tensor=rs_input, group=rs_group, op=op, async_op=True
        )
    else:  # FSDP2's own one-rank branch: a copy, divided by the group's factor if it sets one
        factor = group.gradient_divide_factor
        output.copy_(rs_input / factor if factor is not None else rs_input)
        work = None
    return PendingShard(expert, output, work, postdivide, rs_input)


def _world_chunked(
    full: Tensor, padded: torch.Size, reduce_dtype: torch.dtype, predivide: float | None, world: int
) -> Tensor:
    """The reduce-scatter's input: `full` cut into `world` chunks on dim 0, each flattened, in rank
    order (FSDP2's copy-in, `chunk_cat`). A contiguous gradient in the reduce dtype whose dim 0 the
    world divides already lies so in memory, chunk for chunk: its flat view is that input, the same
    values without the copy. A copy where it pads, casts or re-lays out, or where the pre-divide
    writes into it (a gradient the step may still hold)."""
    if full.is_contiguous() and full.dtype == reduce_dtype and padded == full.size() and predivide is None:
        return full.view(-1)
    rs_input = torch.empty((padded.numel(),), dtype=reduce_dtype, device=full.device)
    foreach_reduce_scatter_copy_in([full], rs_input, world)
    return rs_input


def finish_reduce_scatter(pending: PendingShard) -> Tensor:
    """Wait for the reduce-scatter, post-divide and cast as FSDP2 does, and give this rank's shard of
    the reduced gradient as the DTensor FSDP2 would have set as the sharded parameter's `.grad`."""
    if pending.work is not None:
        pending.work.wait()
    pending.buffer = None  # freed: the collective has read it
    output = pending.output
    _div_if_needed(output, pending.postdivide)
    output = _to_dtype_if_needed(output, pending.expert.group._orig_dtype)
    fsdp_param = pending.expert.fsdp_param
    shard = torch.as_strided(output, fsdp_param.sharded_size, fsdp_param.contiguous_sharded_stride, 0)
    return fsdp_param.to_sharded_dtensor(shard)


@dataclass
class ShardInFlight:
    """A reduce-scatter started at `step()` (`Reducing`): the deferred step computes the next expert
    gradient while it runs (`deferred_pipeline`); `wait()` gives the shard."""

    pending: PendingShard
    in_flight: bool = True

    def wait(self) -> Tensor:
        return finish_reduce_scatter(self.pending)


def step_reduce(experts: dict[int, ShardedExpert], by_name: Callable[[str], Tensor]) -> StepReduce:
    """The deferred step's reduction on FSDP2: a gradient computed from kept operands (a plain tensor,
    unsharded) starts its reduce-scatter to the shard; one FSDP2 already reduced in backward (a
    DTensor: arrived whole) passes through."""

    def reduce(name: str, grad: Tensor) -> Reducing:
        if hasattr(grad, "full_tensor"):
            return Reduced(grad)
        return ShardInFlight(start_reduce_scatter(experts[id(by_name(name))], grad))

    return reduce


# ---------------------------------------------------------------------------------------- capture


@dataclass(eq=False)
class UnshardedAliases:
    """The registry's owner of FSDP2's unsharded expert parameters: operands kept for one of them are
    kept under its sharded parameter, by the optimizer that owns that one."""

    optimizer: Any  # SonarOptimizer (it imports this package's engines, not the reverse)
    experts: dict[int, ShardedExpert]
    sharded_of: dict[int, Tensor] = field(default_factory=dict)
    """id(unsharded parameter) -> the sharded parameter it is the all-gather of."""
    schedule: str = "deferred"
    meter: Any = None
    """The optimizer's (`ExpertGradMeter`): what the runtime counts expert gradients on."""

    def __post_init__(self) -> None:
        self.meter = self.optimizer.meter

    def bind(self) -> None:
        """Bind every unsharded expert parameter FSDP2 has made so far (once each: FSDP2 keeps them)."""
        for expert in self.experts.values():
            unsharded = getattr(expert.fsdp_param, "_unsharded_param", None)
            if unsharded is not None and id(unsharded) not in self.sharded_of:
                self.sharded_of[id(unsharded)] = expert.fsdp_param.sharded_param
                registry.bind(unsharded, self)

    def defer_expert_(self, param: Tensor, recipe: str, operands: list[Tensor]) -> None:
        sharded = self.sharded_of[id(param)]
        deferred_intake.keep_operands(self.optimizer, sharded, recipe, operands, reached=param)

    def update_expert_(self, param: Tensor, grad: Tensor, *, path: str, reduced: str = "") -> None:
        raise SonarUsageError(
            "an in-backward update reached FSDP2's unsharded expert parameter of a model built with "
            "schedule='deferred': a graph compiled for the in-backward schedule was reused. Prepare every "
            "model of one class with the same schedule, or call torch._dynamo.reset() between them."
        )

    def not_accumulated(self, param: Tensor, fate: Any) -> None:
        self.optimizer.not_accumulated(self.sharded_of[id(param)], fate)

    def keep_whole_(self, param: Tensor) -> None:  # FSDP2 calls the sharded parameter's hook itself
        self.optimizer.keep_whole_(self.sharded_of[id(param)])


def bind_unsharded_experts(model: nn.Module, aliases: UnshardedAliases, layer_names: Iterable[str]) -> None:
    """Bind the unsharded expert parameters before each experts module's forward (FSDP2's own
    pre-forward, which all-gathers them, is registered first, and runs first)."""

    @torch._dynamo.disable  # bookkeeping in Python, between graphs
    def bind(_module: nn.Module, _args: Any) -> None:
        aliases.bind()

    for name in layer_names:
        model.get_submodule(name).register_forward_pre_hook(bind)


# --------------------------------------------------------------------------------------- loop rule


@dataclass
class GradientSyncs:
    """Whether FSDP2 reduced the experts in the backward of each gradient-enabled forward of this step
    (None: their groups disagreed)."""

    fresh: Callable[[], bool]
    """Whether the optimizer holds nothing of an earlier backward: a forward then begins a step."""
    synced: list[bool | None] = field(default_factory=list)

    def take(self) -> list[bool | None]:
        """This step's flags, forgotten for the next step."""
        synced, self.synced = self.synced, []
        return synced


def watch_gradient_syncs(
    root: nn.Module, experts: dict[int, ShardedExpert], optimizer: DeferredHolder
) -> GradientSyncs:
    """Record, at each gradient-enabled forward of `root`, whether FSDP2 would reduce the experts'
    gradients in its backward (`set_requires_gradient_sync`, read by FSDP2 in that backward; set
    before the forward in its recipe): a step is exact only when just its last micro-batch does."""
    groups = list({id(e.group): e.group for e in experts.values()}.values())

    def fresh() -> bool:
        return not optimizer.deferred.kept and all(p.grad is None for p in optimizer.experts.params)

    syncs = GradientSyncs(fresh)

    def record(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.is_grad_enabled():  # an evaluation forward under no_grad reduces nothing either way
            return
        if syncs.fresh():
            syncs.synced.clear()
        flags = {bool(g.reduce_grads) for g in groups}
        syncs.synced.append(flags.pop() if len(flags) == 1 else None)

    root.register_forward_hook(record)
    return syncs


def refuse_unmatched_gradient_syncs(syncs: GradientSyncs) -> None:
    """Refuse a step whose micro-batches FSDP2 did not reduce as the deferred step reduces the experts:
    exactly one synced backward, the last. Called at the start of `step()` on every rank alike (the
    flags are the loop's), so nothing has moved when it raises."""
    synced = syncs.take()
    if not synced:
        return
    fix = (
        "Call model.set_requires_gradient_sync(False) before every micro-batch but the last and "
        "model.set_requires_gradient_sync(True) before the last (on the root module: it recurses), as "
        "FSDP2's accumulation recipe does; call optimizer.zero_grad() to drop this step."
    )
    mixed = [i + 1 for i, s in enumerate(synced) if s is None]
    if mixed:
        raise SonarUsageError(
            f"schedule='deferred' under FSDP2: in micro-batch {mixed[0]} of {len(synced)} some experts' "
            "fully_shard groups had gradient sync on and others off, so FSDP2 reduced their gradients at "
            "different micro-batches. Refused at step(), before any weight moved. " + fix
        )
    early = [i + 1 for i, s in enumerate(synced[:-1]) if s]
    if early:
        raise SonarUsageError(
            f"schedule='deferred' under FSDP2: micro-batch {early[0]} of {len(synced)} in this step ran with "
            "gradient sync, so FSDP2 reduce-scattered its gradients before the next micro-batch, while the "
            "deferred step sums each rank's micro-batches and reduces once (other bits). Refused at "
            "step(), before any weight moved. " + fix
        )
    if not synced[-1]:
        syncs.synced = [*synced, *syncs.synced]  # the step goes on: its micro-batches are kept, unsynced
        raise SonarUsageError(
            f"schedule='deferred' under FSDP2: the last micro-batch of this step ({len(synced)}) ran with "
            "set_requires_gradient_sync(False), so FSDP2 reduced no dense gradient (it holds them unsharded "
            "until a synced backward), while the deferred step would reduce the experts. Refused at step(), "
            "before any weight moved. Run the step's last micro-batch after "
            "model.set_requires_gradient_sync(True), then call step() again: the micro-batches so far "
            "stay accumulated, in FSDP2 and in Sonar alike."
        )


@dataclass
class ShardedDeferred:
    """What `ShardedGrads.at_step` runs under schedule="deferred" (set by `fsdp2` / `fsdp2_ep`)."""

    experts: dict[int, ShardedExpert]
    syncs: GradientSyncs
    param_of: Callable[[str], Tensor]
    optimizer: Any  # SonarOptimizer

    def unsynced_backward(self) -> bool:
        return bool(self.syncs.synced) and self.syncs.synced[-1] is False

    def at_step(self) -> StepReduce:
        scaler = scaler_step(self.optimizer)
        if scaler is not None:  # it unscaled the dense shards in place before calling step(): its write,
            # not a clip of the user's (one after the unscale still shows, and is refused by the watch)
            self.optimizer.grad_watch.accept_unscale(self.optimizer.dense_params(), scaler.inv_scale)
        refuse_unmatched_gradient_syncs(self.syncs)  # before any weight moves
        return step_reduce(self.experts, self.param_of)


def set_up_deferred(model: nn.Module, optimizer: Any) -> ShardedDeferred:
    """Under schedule="deferred": bind the unsharded experts, watch the loop's syncs, and give what
    the reduction's `at_step` runs. `model` is the FSDP2 root; `optimizer` its `SonarOptimizer`."""
    experts = sharded_experts(model, optimizer.experts.params)
    aliases = UnshardedAliases(optimizer, experts)
    optimizer.unsharded_aliases = aliases  # the registry holds owners weakly: the optimizer keeps it
    bind_unsharded_experts(model, aliases, [layer.name for layer in optimizer.expert_layers])
    by_name = dict(zip(optimizer.experts.names, optimizer.experts.params, strict=True))
    syncs = watch_gradient_syncs(model, experts, optimizer)
    return ShardedDeferred(experts, syncs, by_name.__getitem__, optimizer)
