"""The deferred schedule on DDP: each expert gradient computed at `step()`, then reduced as DDP would.

Under `schedule="deferred"` backward keeps, on each rank, the operands of that rank's expert weight
gradients; `step()` computes each gradient from them, summing the rank's micro-batches locally. DDP
reduces a gradient once, at the backward that syncs: under the accumulation loop people run
(`no_sync()` for every micro-batch but the last), the dense gradients reach `step()` as
`sum_ranks(local_sum * (1/world))`, and so must each expert gradient. `mean_all_reduce` applies that
arithmetic (mul by 1/world, all-reduce sum) to one computed gradient, started asynchronously so that it
runs while the step computes the next one (`deferred_pipeline`); `MeanAllReduce.at_step` hands it to
both of the deferred step's passes (the norm/scaler verdict and the update). Expert parallelism's
experts are the rank's own (`LocalExperts.at_step`: the 1/world scale alone), but its dense half is
DDP, so the same loop rule holds there.

A loop that syncs more than once per step has other arithmetic (DDP reduces the running sum at each
synced backward: (a1 + b1)/2 + a2 ... rather than (a1 + a2 + b1 + b2)/2 in another grouping), and a
step whose last micro-batch ran under `no_sync()` reduced no dense gradient at all; both are refused at
`step()`, before any weight moves, by `refuse_unmatched_syncs`. What each forward did is recorded by a
forward hook on the DDP wrapper (`ForwardSyncs`), which is where DDP itself decides (it sets
`require_forward_param_sync` at the end of each forward). This module never updates a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.reduction import Started


@dataclass
class ForwardSyncs:
    """Whether each gradient-enabled forward of the DDP wrapper in this step synced."""

    fresh: Callable[[], bool]
    """Whether the optimizer holds nothing of an earlier backward (no kept operands, no expert
    gradient): a forward then begins a step, even when the last one never reached `step()` (a
    GradScaler skips `step()` when a dense gradient overflowed; `zero_grad()` then dropped it)."""
    synced: list[bool] = field(default_factory=list)

    def record(self, wrapper: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.is_grad_enabled():  # an evaluation forward under no_grad reduces nothing either way
            return
        if self.fresh():
            self.synced.clear()
        self.synced.append(bool(getattr(wrapper, "require_forward_param_sync", True)))

    def take(self) -> list[bool]:
        """This step's flags, forgotten for the next step."""
        synced, self.synced = self.synced, []
        return synced


def watch_forward_syncs(wrapper: nn.Module, optimizer: DeferredHolder) -> ForwardSyncs:
    """Record, for each forward of `wrapper` (a DDP module), whether its backward syncs."""

    def fresh() -> bool:
        return not optimizer.deferred.kept and all(p.grad is None for p in optimizer.experts.params)

    syncs = ForwardSyncs(fresh)
    wrapper.register_forward_hook(syncs.record)
    return syncs


class DeferredHolder(Protocol):
    """What `watch_forward_syncs` reads of `SonarOptimizer`: its kept operands and expert tensors."""

    deferred: DeferredGrads
    experts: ExpertSet


def refuse_unmatched_syncs(syncs: ForwardSyncs | None) -> None:
    """Refuse a step whose micro-batches DDP did not reduce as the deferred step reduces the experts:
    exactly one synced backward, the last. Called at the start of `step()`, on every rank alike (the
    flags are the loop's), so nothing has moved when it raises."""
    if syncs is None:
        raise SonarUsageError(
            "schedule='deferred' on DDP reads which micro-batches DDP synced from the DDP wrapper that "
            "sonar_fx.distributed.ddp builds: build the model with it rather than a reduction by hand."
        )
    synced = syncs.take()
    if not synced:
        return  # no forward through DDP this step: nothing was reduced, nothing is kept
    early = [i + 1 for i, s in enumerate(synced[:-1]) if s]
    if early:
        raise SonarUsageError(
            f"schedule='deferred' under DDP: micro-batch {early[0]} of {len(synced)} in this step ran with "
            "gradient sync, so DDP reduced its running gradient sum before the next micro-batch, while the "
            "deferred step sums each rank's micro-batches and reduces once (other bits). Refused at step(), "
            "before any weight moved. Run every micro-batch but the last under `with model.no_sync():` "
            "(forward and backward), as DDP's accumulation recipe does; call optimizer.zero_grad() to drop "
            "this step."
        )
    if not synced[-1]:
        raise SonarUsageError(
            f"schedule='deferred' under DDP: the last micro-batch of this step ({len(synced)}) ran under "
            "no_sync() (or require_backward_grad_sync = False), so DDP reduced no dense gradient, while "
            "the deferred step would average the experts across ranks. Refused at step(), before any "
            "weight moved. Run the last micro-batch before step() outside `model.no_sync()`; call "
            "optimizer.zero_grad() to drop this step."
        )


def mean_all_reduce(grad: Tensor, group: dist.ProcessGroup) -> Started:
    """DDP's reduction of one gradient, started: `grad * (1/world)` (the reducer's copy into its bucket),
    then an asynchronous all-reduce sum over `group`, which runs while the deferred step computes the
    next gradient; `wait()` gives the mean. `grad` is the step's own (computed at step()): scaled and
    reduced in place."""
    scaled = grad.mul_(1.0 / dist.get_world_size(group)).contiguous()
    return Started(scaled, dist.all_reduce(scaled, group=group, async_op=True))
