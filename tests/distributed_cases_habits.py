"""What each rank runs in the tests of training-loop habits on the engines (`test_distributed_habits`).

Each case drives Sonar on one engine (DDP, FSDP2, expert parallelism, FSDP2 x EP on a 1 x 2 mesh;
eager, and DDP under aot_eager) the way a user's loop would, and reports the message Sonar refused
with (None: not refused), the tensors the refused call moved on this rank (`torch.equal` against a
copy taken just before it), and, where the loop goes on after `abandon_step()`, which tensors differ
from the same engine trained by plain torch on the same batches (`distributed_cases_options`'
standard recipe: fused AdamW, the dense gradients clipped after the engine's reduction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import differ
from distributed_cases_options import ADAMW, ENGINES, clip_, expert_params, torch_optimizers, train_standard
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.tensor import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.models import build_model

from helpers import batches

STEPS = 2


def build(engine: str, cfg: Any = ADAMW, compiler: str = "eager") -> tuple[Any, Any, nn.Module]:
    """(what to call with a batch, its optimizer, the model) for Sonar on `engine`."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", seed=0)
    if engine == "ddp":
        run = sd.ddp(model, cfg, compiler=compiler)
    elif engine == "ep":
        run = sd.expert_parallel(model, cfg, compiler=compiler)
    elif engine == "fsdp2":
        run = sd.fsdp2(model, cfg, compiler=compiler)
    else:
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "ep"))
        run = sd.fsdp2_ep(model, cfg, mesh=mesh, compiler=compiler)
    return run, run.sonar, model


def refused(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except sonar_fx.SonarUsageError as err:
        return str(err)
    return None


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def moved(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(_local(p), before[n])]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def loss_of(run: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return run(**batch).loss


def train_on(run: Any, optimizer: Any, rank: int) -> None:
    """The standard loop on this rank's `STEPS` batches (the twin's: `distributed_cases_options`)."""
    for b in batches(STEPS, seed=1 + rank):
        loss_of(run, b).backward()
        optimizer.step()
        optimizer.zero_grad()


def vs_standard(engine: str, model: nn.Module, rank: int, compiler: str = "eager") -> list[str]:
    """Tensors of `model` that differ from `engine`'s plain-torch twin trained on the same batches."""
    torch._dynamo.reset()
    twin = build_model("tiny-reference", seed=0)
    train_standard(ENGINES[engine], twin, ADAMW, rank, "dense", compiler)
    return differ(model, twin)


def unrelated_batch(rank: int) -> dict[str, torch.Tensor]:
    return batches(1, seed=100 + rank)[0]


# ------------------------------------------------------------------------------ 1. the user's clip


def own_clip(engine: str, rank: int, compiler: str = "eager") -> dict[str, Any]:
    """`clip_grad_norm_(model.parameters())` between backward and step() while Sonar clips: refused at
    step(), no dense tensor moved by it; abandon_step() and the loop goes on. The clip is active (a
    threshold far below the norm): an FSDP2 gradient is seen written by its values (see `grad_watch`)."""
    run, opt, model = build(engine, compiler=compiler)
    loss_of(run, unrelated_batch(rank)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = snapshot(model)
    out: dict[str, Any] = {"message": refused(opt.step), "moved": moved(model, before)}
    out["abandoned"] = opt.abandon_step()
    train_on(run, opt, rank)
    return out


def own_clip_with_sonar_clip_off(engine: str, rank: int) -> list[str]:
    """The fix the refusal names: max_grad_norm=None and the user's clip over model.parameters() (the
    experts' .grad stays None, so it clips the dense gradients): exact against the engine's standard."""
    run, opt, model = build(engine, replace(ADAMW, max_grad_norm=None))
    for b in batches(STEPS, seed=1 + rank):
        loss_of(run, b).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ADAMW.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return vs_standard(engine, model, rank)


# --------------------------------------------------------------------------------- 2. a comm hook


def comm_hook_on_ddp() -> dict[str, str | None]:
    """DDP: plain DDP's hook would reach every gradient, Sonar's experts bypass the buckets: refused."""
    run, _, _ = build("ddp")
    return {
        "python": refused(lambda: run.register_comm_hook(None, fp16_compress_hook)),
        "builtin": refused(lambda: run._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)),
    }


def comm_hook_on_ep(rank: int) -> dict[str, list[str]]:
    """Expert parallelism: the plain engine keeps the experts out of DDP too, so the hook reaches the
    dense gradients alone in both: exact against the plain engine with the hook, and (the control)
    other than the plain engine without it."""
    run, opt, model = build("ep")
    run.register_comm_hook(None, fp16_compress_hook)
    train_on(run, opt, rank)
    twin = build_model("tiny-reference", seed=0)
    sd.shard_experts_(twin)
    DDP._set_params_and_buffers_to_ignore_for_model(twin, ExpertSet.discover(twin).names)
    twin_run = DDP(twin)
    twin_run.register_comm_hook(None, fp16_compress_hook)
    twin_opt = torch_optimizers(twin, ADAMW)[0]
    for b in batches(STEPS, seed=1 + rank):
        loss_of(twin_run, b).backward()
        for p in expert_params(twin):
            p.grad.mul_(ENGINES["ep"].expert_scale)
        clip_("dense", twin, ENGINES["ep"], ADAMW.max_grad_norm)
        twin_opt.step()
        twin_opt.zero_grad()
    return {"differ": differ(model, twin), "without_hook": vs_standard("ep", model, rank)}


# ---------------------------------------------------------------- 3, 4. no_sync() and its flag


def unsynced_then_go_on(engine: str, rank: int, how: str, compiler: str = "eager") -> dict[str, Any]:
    """A backward DDP does not reduce (`how`: "no_sync" around forward and backward, or the flag
    `require_backward_grad_sync = False`): refused before any tensor moved; after `abandon_step()` the
    loop trains exactly as the engine's standard on the same batches."""
    run, opt, model = build(engine, compiler=compiler)
    before = snapshot(model)

    def first_micro_batch() -> None:
        if how == "no_sync":
            with run.no_sync():
                loss_of(run, unrelated_batch(rank)).backward()
            return
        run.require_backward_grad_sync = False
        try:
            loss_of(run, unrelated_batch(rank)).backward()
        finally:
            run.require_backward_grad_sync = True

    out: dict[str, Any] = {"message": refused(first_micro_batch), "moved": moved(model, before)}
    opt.abandon_step()
    train_on(run, opt, rank)
    out["differ"] = vs_standard(engine, model, rank, compiler)
    return out


def fsdp2_accumulation(rank: int) -> dict[str, Any]:
    """FSDP2's own accumulation: the first micro-batch with `set_requires_gradient_sync(False)`, the
    last with True. FSDP2 calls no hook until the synced backward, whose reduce-scatter holds both
    micro-batches, so Sonar updates each expert once: exact against plain FSDP2's same loop."""
    run, opt, model = build("fsdp2")
    _accumulate(run, [opt], model, rank, twin=False)
    twin = build_model("tiny-reference", seed=0)
    sd.fully_shard_experts(twin)
    _accumulate(twin, torch_optimizers(twin, ADAMW), twin, rank, twin=True)
    return {"differ": differ(model, twin), "by_hook": opt.report()["updates_by_hook"]}


def _accumulate(run: Any, optimizers: list[Any], model: Any, rank: int, *, twin: bool) -> None:
    micro = batches(2 * STEPS, seed=1 + rank)
    for step in range(STEPS):
        for i, b in enumerate(micro[2 * step : 2 * step + 2]):
            model.set_requires_gradient_sync(i == 1)
            loss_of(run, b).backward()
        if twin:
            clip_("dense", model, ENGINES["fsdp2"], ADAMW.max_grad_norm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


# ------------------------------------------------------------------- 5. the LR set after backward


def lr_after_backward(engine: str, rank: int) -> dict[str, Any]:
    run, opt, model = build(engine)
    loss_of(run, unrelated_batch(rank)).backward()
    for group in opt.param_groups:
        group["lr"] = ADAMW.lr / 2
    before = snapshot(model)
    out: dict[str, Any] = {"message": refused(opt.step), "moved": moved(model, before)}
    out["abandoned"] = opt.abandon_step()
    for group in opt.param_groups:
        group["lr"] = ADAMW.lr
    train_on(run, opt, rank)
    return out


# ------------------------------------------------------------------------------------ 6. join()


def join(engine: str, rank: int) -> dict[str, str | None]:
    """Uneven inputs (rank 0: 3 batches, rank 1: 2) under DDP's join: refused before any rank joins."""
    run, opt, _ = build(engine)
    uneven = batches(3 - rank, seed=1 + rank)

    def loop() -> None:
        for b in uneven:
            loss_of(run, b).backward()
            opt.step()
            opt.zero_grad()

    def with_join() -> None:
        with run.join():
            loop()

    def with_join_context() -> None:
        with Join([run]):
            loop()

    return {"join": refused(with_join), "Join": refused(with_join_context)}


# ---------------------------------------------------------------------------- 7. engine builders


def builders() -> dict[str, str | None]:
    """Each builder given a model in a state it cannot take."""
    cfg = ADAMW

    def fresh() -> nn.Module:
        return build_model("tiny-reference", seed=0)

    def sharded_below_root() -> nn.Module:  # the user's own fully_shard of experts and blocks
        from torch.distributed.fsdp import fully_shard

        model = fresh()
        for layer in model.layers:
            fully_shard(layer.mlp.experts)
            fully_shard(layer)
        return model

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "ep"))
    cases: dict[str, Callable[[], Any]] = {
        "fsdp2/sharded_below_root": lambda: sd.fsdp2(sharded_below_root(), cfg),
        "ddp/sharded": lambda: sd.ddp(sd.fully_shard_experts(fresh()), cfg),
        "expert_parallel/sharded": lambda: sd.expert_parallel(sd.fully_shard_experts(fresh()), cfg),
        "fsdp2/ddp_wrapped": lambda: sd.fsdp2(DDP(fresh()), cfg),
        "fsdp2_ep/ddp_wrapped": lambda: sd.fsdp2_ep(DDP(fresh()), cfg, mesh=mesh),
        "expert_parallel/ddp_wrapped": lambda: sd.expert_parallel(DDP(fresh()), cfg),
        "ddp/expert_parallel": lambda: sd.ddp(_shard_experts(fresh()), cfg),
        "expert_parallel/expert_parallel": lambda: sd.expert_parallel(_shard_experts(fresh()), cfg),
        "fsdp2/meta": lambda: sd.fsdp2(fresh().to("meta"), cfg),
        "ddp/meta": lambda: sd.ddp(fresh().to("meta"), cfg),
    }
    return {label: refused(case) for label, case in cases.items()}


def _shard_experts(model: nn.Module) -> nn.Module:
    sd.shard_experts_(model)
    return model


# -------------------------------------------------------------------------------------- the spawn


def habits(rank: int) -> dict[str, Any]:
    """Every case of `test_distributed_habits`, in one spawn."""
    out: dict[str, Any] = {}
    for engine in ("ddp", "fsdp2", "ep", "fsdp2_ep"):
        out[f"own_clip/{engine}"] = own_clip(engine, rank)
    out["own_clip/ddp/aot_eager"] = own_clip("ddp", rank, compiler="aot_eager")
    for engine in ("ddp", "fsdp2", "ep"):
        out[f"own_clip_sonar_off/{engine}"] = own_clip_with_sonar_clip_off(engine, rank)
    out["comm_hook/ddp"] = comm_hook_on_ddp()
    out["comm_hook/ep"] = comm_hook_on_ep(rank)
    for engine in ("ddp", "ep"):
        out[f"no_sync/{engine}"] = unsynced_then_go_on(engine, rank, "no_sync")
        out[f"join/{engine}"] = join(engine, rank)
    out["flag/ddp"] = unsynced_then_go_on("ddp", rank, "flag")
    out["accumulation/fsdp2"] = fsdp2_accumulation(rank)
    out["no_sync/ddp/aot_eager"] = unsynced_then_go_on("ddp", rank, "no_sync", compiler="aot_eager")
    for engine in ("ddp", "fsdp2"):
        out[f"lr/{engine}"] = lr_after_backward(engine, rank)
    out["builders"] = builders()
    return out
