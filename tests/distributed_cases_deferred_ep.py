"""Expert-parallel cases of the deferred schedule's spawn (`test_distributed_deferred`) beside those of
`distributed_cases_deferred`: one expert per rank, an inf in one rank's experts only (nonfinite="skip",
and "raise" with the verdict all-reduces each step runs), and the eager step's memory.

With as many experts as ranks each rank holds (1, out, in) expert tensors; expert discovery takes them
because the experts module declares it holds one rank's share. Under nonfinite="skip", an inf in one
expert gradient of rank 1 only (kept as an operand until step(); nothing else non-finite) skips the
step on every rank: the verdict is over every rank, so no rank moves a weight, and the next steps
train bitwise as the plain engine that skips the same step (its clip's norm is not finite there).

The memory case meters one eager step of each arm (`LiveStorageMeter`: the storages alive at once, frees
on every thread) on a shape whose kept operands stay below every expert gradient, and, as the negative
control, on one where they outgrow each gradient within a micro-batch (one expert per rank at top-2: it
receives every routed slot), where the deferred step keeps the gradients whole and saves nothing.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from distributed_cases import differ
from distributed_cases_deferred import MAX_NORM, MODELS, cfg_for, data_of, deferred, exact, plain_adamw
from distributed_cases_deferred_sharded_scaler import poison_one_expert_
from distributed_cases_options import ENGINES, ep_global_clip_

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.memory_live import LiveStorageMeter
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

ONE_EXPERT_PER_RANK = ("fp32", "all", "aot_eager", 2, "ep")
"""tiny-reference with 2 experts on 2 ranks: each rank's expert tensors are (1, out, in)."""
ONE_EXPERT_PER_RANK_MODEL = {"num_experts": 2}
POISONED = (1, 1)
"""(step, rank): the expert gradient made non-finite."""


def inf_in_one_ranks_experts(rank: int, clip: str) -> dict[str, Any]:
    """nonfinite="skip", the clip over every parameter or the dense ones (`clip`), 2 micro-batches per
    step: in step 2 rank 1's first kept expert operand holds an inf (`poison_one_expert_`), the dense
    gradients are finite. The plain engine gets an inf in one expert gradient of rank 1 at the same step
    and skips the step when torchtitan's norm over every parameter is not finite (dense clip: when any
    rank's expert gradients are not). Reports the tensors each rank moved in each
    step, the skip warnings it gave, and the tensors that differ from the plain engine at the end."""
    data = data_of(rank, 2)
    torch._dynamo.reset()
    model = build_model(MODELS["ep"], dtype=torch.float32, seed=0)
    run = sd.expert_parallel(model, cfg_for(clip), nonfinite="skip", schedule="deferred")
    opt = run.sonar
    moved: list[list[str]] = []
    skips: list[str] = []
    for step, micro_batches in enumerate(data):
        backwards(run, micro_batches)
        if (step, rank) == POISONED:
            poison_one_expert_(opt)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        skips += [str(w.message) for w in caught if "step skipped" in str(w.message)]
        opt.zero_grad()
        moved.append([n for n, p in model.named_parameters() if not torch.equal(p, before[n])])
    twin = plain_skipping_the_poisoned_step(rank, data, clip)
    return {
        "differ": differ(model, twin),
        "moved": moved,
        "skip_warnings": skips,
        "skipped_steps": opt.report()["skipped_steps"],
    }


def backwards(run: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """The user's loop: DDP's no_sync() on all but the last micro-batch."""
    for i, b in enumerate(micro_batches):
        with run.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            run(**b).loss.backward()


def plain_skipping_the_poisoned_step(rank: int, data: list[list[dict]], clip: str) -> torch.nn.Module:
    """The plain EP engine: experts scaled by 1/world, torchtitan's norm over every parameter (all
    ranks) or torch's over the dense ones, the step taken only where the norm is finite and (dense clip)
    no rank's expert gradient holds an inf or NaN; rank 1's first expert gradient gets an inf in the
    poisoned step."""
    torch._dynamo.reset()
    twin = build_model(MODELS["ep"], dtype=torch.float32, seed=0)
    wrapped = ENGINES["ep"].standard(twin, "eager")
    dense, experts, twin_opt = plain_adamw(twin)
    for step, micro_batches in enumerate(data):
        backwards(wrapped, micro_batches)
        for p in experts:
            p.grad.mul_(ENGINES["ep"].expert_scale)
        if (step, rank) == POISONED:
            experts[0].grad[0, 0, 0] = float("inf")
        if clip == "all":
            finite = bool(torch.isfinite(ep_global_clip_(dense, experts, MAX_NORM)))
        else:
            torch.nn.utils.clip_grad_norm_(dense, MAX_NORM)
            bad = torch.tensor([float(not all(bool(torch.isfinite(p.grad).all()) for p in experts))])
            dist.all_reduce(bad)
            finite = bad.item() == 0
        if finite:
            twin_opt.step()
        twin_opt.zero_grad()
    return twin


def raise_on_one_ranks_inf(rank: int, where: str) -> dict[str, Any]:
    """nonfinite="raise" (the default), the dense clip, 2 micro-batches per step: in step 2 rank 1 alone
    gets an inf, in a dense gradient before DDP averages it (`where="dense"`: a hook on its first dense
    tensor) or in its first kept expert operand (`where="experts"`). Each rank abandons the step it
    raised in and trains on. Reports, per step, the all-reduces `step()` ran (the verdicts: the
    plain engine's step runs none), the error it raised ("" for none) and the tensors it moved."""
    data = data_of(rank, 2)
    torch._dynamo.reset()
    model = build_model(MODELS["ep"], dtype=torch.float32, seed=0)
    run = sd.expert_parallel(model, cfg_for("dense"), schedule="deferred")
    opt = run.sonar
    dense_name, dense = next((n, p) for n, p in model.named_parameters() if ".experts." not in n)
    seen: dict[str, Any] = {"dense_name": dense_name, "all_reduces": [], "raised": [], "moved": []}
    for step, micro_batches in enumerate(data):
        poisoned = (step, rank) == POISONED
        hook = dense.register_hook(lambda g: g + float("inf")) if poisoned and where == "dense" else None
        backwards(run, micro_batches)
        if hook is not None:
            hook.remove()
        if poisoned and where == "experts":
            poison_one_expert_(opt)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        raised = ""
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
            try:
                opt.step()
            except sonar_fx.NonFiniteGradientError as err:
                raised = str(err)
                opt.abandon_step()
        opt.zero_grad()
        seen["all_reduces"].append(all_reduce.call_count)
        seen["raised"].append(raised)
        seen["moved"].append([n for n, p in model.named_parameters() if not torch.equal(p, before[n])])
    return seen


SAVING_MODEL = {"num_experts": 32, "hidden_size": 64, "intermediate_size": 64, "num_layers": 4}
"""16 experts per rank: 2 micro-batches' operands (about 64 routed slots per rank each) stay below every
expert tensor's gradient, so none crosses over and the step holds two expert tensors at most."""
CROSSING_MODEL = {**SAVING_MODEL, "num_experts": 2}
"""One expert per rank at top-2: each micro-batch's operands outgrow its gradient (the crossover)."""


def eager_memory(rank: int, model_kw: dict[str, Any]) -> dict[str, Any]:
    """fp32, eager, the clip over every parameter, 2 micro-batches per step, 3 steps of each arm, the
    last one metered: the deferred schedule and the plain engine (`plain_skipping_the_poisoned_step`'s
    recipe). Reports both peaks and the bytes alive as each step began, what the deferred step kept,
    the crossover warnings and the tensors that differ."""
    data = data_of(rank, 2)
    run, opt, model = deferred_ep(model_kw)

    def deferred_step(micro_batches: list[dict[str, torch.Tensor]]) -> None:
        backwards(run, micro_batches)
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deferred_meter = metered_last_step(deferred_step, data, model, opt)
    report = opt.report()["deferred"]
    torch._dynamo.reset()
    twin = build_model(MODELS["ep"], dtype=torch.float32, seed=0, **model_kw)
    wrapped = ENGINES["ep"].standard(twin, "eager")
    dense, experts, twin_opt = plain_adamw(twin)

    def plain_step(micro_batches: list[dict[str, torch.Tensor]]) -> None:
        backwards(wrapped, micro_batches)
        for p in experts:
            p.grad.mul_(ENGINES["ep"].expert_scale)
        ep_global_clip_(dense, experts, MAX_NORM)
        twin_opt.step()
        twin_opt.zero_grad()

    plain_meter = metered_last_step(plain_step, data, twin, twin_opt)
    sizes = [p.numel() * p.element_size() for p in experts]
    return {
        "differ": differ(model, twin),
        "plain_peak": plain_meter.peak_bytes,
        "deferred_peak": deferred_meter.peak_bytes,
        "plain_start": plain_meter.start_bytes,
        "deferred_start": deferred_meter.start_bytes,
        "expert_bytes": sum(sizes),
        "biggest_expert": max(sizes),
        "expert_tensors": len(sizes),
        "kept_bytes": opt.deferred.last_peak_bytes,
        "crossed_over": sorted(report["crossed_over"]),
        "kept_whole": report["kept_whole"],
        "crossover_warnings": [str(w.message) for w in caught if "outgrew" in str(w.message)],
    }


def deferred_ep(model_kw: dict[str, Any]) -> tuple[Any, Any, torch.nn.Module]:
    torch._dynamo.reset()
    model = build_model(MODELS["ep"], dtype=torch.float32, seed=0, **model_kw)
    run = sd.expert_parallel(model, cfg_for("all"), schedule="deferred")
    return run, run.sonar, model


def metered_last_step(
    step: Any, data: list[list[dict[str, torch.Tensor]]], model: torch.nn.Module, opt: Any
) -> LiveStorageMeter:
    """`step` over every step of `data`, the last under a meter that counts, from its start, the
    weights, the optimizer's states, the buffers and the batch (no gradient is alive between steps)."""
    for micro_batches in data[:-1]:
        step(micro_batches)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    batch = [t for b in data[-1] for t in b.values()]
    meter = LiveStorageMeter([*model.parameters(), *states, *model.buffers(), *batch])
    with meter:
        step(data[-1])
    return meter


def ep_cases(rank: int) -> dict[str, Any]:
    """These cases; at 2 experts each expert gets most tokens, so its kept operands outgrow its
    gradient (the crossover: no saving on this tiny shape, said by a warning, as `deferred` has it)."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    return {
        "ep/one_expert_per_rank": exact(rank, *ONE_EXPERT_PER_RANK, model_kw=ONE_EXPERT_PER_RANK_MODEL),
        "ep/inf_in_one_ranks_experts": inf_in_one_ranks_experts(rank, "all"),
        "ep/inf_in_one_ranks_experts/dense": inf_in_one_ranks_experts(rank, "dense"),
        "ep/raise/dense_inf": raise_on_one_ranks_inf(rank, "dense"),
        "ep/raise/expert_inf": raise_on_one_ranks_inf(rank, "experts"),
        "ep/eager_memory": eager_memory(rank, SAVING_MODEL),
        "ep/eager_memory/crossed_over": eager_memory(rank, CROSSING_MODEL),
    }


def deferred_and_ep_cases(rank: int) -> dict[str, Any]:
    """Every case of `distributed_cases_deferred.deferred` and these, in one spawn."""
    return deferred(rank) | ep_cases(rank)
