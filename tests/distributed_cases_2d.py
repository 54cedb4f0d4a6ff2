"""What each of 4 ranks runs in the test of the 2-D layout (FSDP2 x expert parallelism, 2 x 2).

Sonar on `sonar_fx.distributed.fsdp2_ep` against the same layout (`shard_fsdp2_ep`) trained with the
standard recipe written here in plain torch: torch's optimizer on the DTensors, the clip the option
names (under expert_clip="global", torchtitan's: the experts' norm reduced over the whole mesh as
a DTensor, combined with the dense one), torchao's for low-bit expert states, each block compiled
where the case compiles. Controls: the experts' FSDP2 groups left at FSDP2's default
divide factor (the "dp" size, not the world) must differ; and plain data parallelism (DDP, every
expert on every rank) trains the same model up to the summation order of the reductions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import differ, digest
from distributed_cases_options import (
    ADAMW,
    BASE,
    STEPS,
    WIDE,
    dense_params,
    expert_params,
    torchao_optimizer,
    train_sonar,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.models import build_model
from sonar_fx.optim.rules import rule_for

from helpers import batches


@dataclass(frozen=True)
class Case:
    cfg: Any
    rule: str
    """The twin's clip: "dense", "per_tensor" or "global"."""
    dtype: torch.dtype = torch.float32
    compiler: str = "eager"
    shape: tuple[tuple[str, Any], ...] = ()


CASES = {
    "adamw": Case(ADAMW, "dense"),
    "adam/aot_eager": Case(sonar_fx.AdamConfig(**BASE, max_grad_norm=0.5), "dense", compiler="aot_eager"),
    "sgd/per_tensor": Case(
        sonar_fx.SGDConfig(**BASE, momentum=0.9, max_grad_norm=0.05, expert_clip="per_tensor"), "per_tensor"
    ),
    "lion/global/bf16": Case(
        sonar_fx.LionConfig(lr=1e-3, max_grad_norm=0.5, expert_clip="global"), "global", dtype=torch.bfloat16
    ),
}
LOWBIT_CASES = {
    # 8 wide experts: a rank's E/ep = 4 experts sharded over dp are 2 x 64 x 64, large enough to quantize.
    "adamw8bit/global": Case(
        sonar_fx.AdamWConfig(**BASE, max_grad_norm=0.5, expert_clip="global", state_bits=8), "global",
        shape=tuple(WIDE.items()),
    ),
}  # fmt: skip


def mesh_2x2() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))


def train_standard(model: nn.Module, case: Case, rank: int, *, divide_by_world: bool = True) -> None:
    """The same layout, the standard recipe: torch's (or torchao's) optimizer, clipped as `case.rule`."""
    mesh = mesh_2x2()
    sd.shard_fsdp2_ep(model, mesh)
    if not divide_by_world:  # control: FSDP2's default, the mean over "dp" only
        for module in model.modules():
            if isinstance(module, sd.ExpertParallelExperts):
                module.set_gradient_divide_factor(float(mesh["dp"].size()))
    if case.compiler != "eager":
        for block in model.layers:
            block.compile(backend=case.compiler)
    dense, experts, cfg = dense_params(model), expert_params(model), case.cfg
    # Dense and expert DTensors live on different meshes: one optimizer for each.
    optimizers = [rule_for(cfg).torch_optimizer(dense, cfg), expert_optimizer(experts, cfg)]
    for b in batches(STEPS, seed=1 + rank):
        model(**b).loss.backward()
        if case.rule == "global":
            _global_clip_(dense, experts, cfg.max_grad_norm, mesh)
        else:
            torch.nn.utils.clip_grad_norm_(dense, cfg.max_grad_norm)
        if case.rule == "per_tensor":
            for p in experts:
                torch.nn.utils.clip_grad_norm_([p], cfg.max_grad_norm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def expert_optimizer(experts: list[nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    if getattr(cfg, "state_bits", 32) == 32:
        return rule_for(cfg).torch_optimizer(experts, cfg)
    return torchao_optimizer(experts, cfg)


def _global_clip_(dense: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float, mesh: Any) -> None:
    """torchtitan's clip: expert gradients as DTensors over the 2-D mesh (Shard(0) by expert over "ep",
    FSDP2's Shard(0) over "dp"), their norm reduced by `full_tensor()`; dense as FSDP2 holds them."""
    as_2d = [DTensor.from_local(p.grad.to_local(), mesh, [Shard(0), Shard(0)]) for p in experts]
    ep_norm = torch.nn.utils.get_total_norm(as_2d).full_tensor()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense]).full_tensor()
    total = ep_norm**2 + dense_norm**2
    total **= 1.0 / 2
    torch.nn.utils.clip_grads_with_norm_(experts, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)


def run_case(rank: int, case: Case) -> tuple[dict[str, Any], nn.Module]:
    shape = dict(case.shape)
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=case.dtype, seed=0, **shape)
    model = sd.fsdp2_ep(model, case.cfg, mesh=mesh_2x2(), compiler=case.compiler)
    train_sonar(model, model.sonar, rank)
    torch._dynamo.reset()
    twin = build_model("tiny-reference", dtype=case.dtype, seed=0, **shape)
    train_standard(twin, case, rank)
    report = model.sonar.report()
    return {
        "differ": differ(model, twin),
        "dense_digest": digest(model, dense_only=True),
        "expert_digest": _expert_digest(model),
        "by_hook": report["updates_by_hook"],
        "fallbacks": report["fallbacks"],
        "expert_rule": report["expert_rule"],
        "max_expert_norm": max(report["grad_norms"]["experts"].values()),
        "total_norm": report["grad_norms"]["total"],
        "local_experts": [list(p.to_local().shape) for p in expert_params(model)],
    }, model


def fsdp2_ep_cases(rank: int) -> dict[str, Any]:
    """Every case of `CASES`, the divide-by-dp control, plain DDP, and the memory rows."""
    out: dict[str, Any] = {}
    for label, case in CASES.items():
        out[label], model = run_case(rank, case)
        if label == "adamw":
            control = build_model("tiny-reference", seed=0)
            train_standard(control, case, rank, divide_by_world=False)
            out["control/divide_by_dp"] = differ(model, control)
            out["vs_ddp"] = _against_ddp(rank, model)
    out["memory"] = _memory_rows()
    return out


def fsdp2_ep_lowbit(rank: int) -> dict[str, Any]:
    """Low-bit expert states on the 2-D layout, against torchao's optimizer on the same layout."""
    return {label: run_case(rank, case)[0] for label, case in LOWBIT_CASES.items()}


def _memory_rows() -> list[dict[str, Any]]:
    """The 2-D table of `benchmarks.distributed` (quick config) as this rank counts it."""
    from dataclasses import asdict

    from benchmarks.distributed import QUICK, measure_2d

    return [asdict(row) for row in measure_2d(QUICK)]


def _against_ddp(rank: int, model: nn.Module) -> float:
    """Plain data parallelism (every expert on every rank, DDP): the same training up to the order of
    the reductions' sums; the largest difference of any weight (this rank's expert rows)."""
    ddp_model = build_model("tiny-reference", seed=0)
    wrapped = DDP(ddp_model)
    opt = rule_for(ADAMW).torch_optimizer(list(ddp_model.parameters()), ADAMW)
    for b in batches(STEPS, seed=1 + rank):
        wrapped(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(dense_params(ddp_model), ADAMW.max_grad_norm)
        opt.step()
        opt.zero_grad()
    full = dict(ddp_model.named_parameters())
    ep_rank = dist.get_rank() % 2
    worst = 0.0
    for name, p in model.named_parameters():
        mine = p.full_tensor()  # every rank of the "dp" column holds the same experts
        ref = full[name]
        if mine.shape != ref.shape:  # this row position's experts
            ref = ref[ep_rank * mine.shape[0] : (ep_rank + 1) * mine.shape[0]]
        worst = max(worst, float((mine - ref).abs().max()))
    return worst


def _expert_digest(model: nn.Module) -> str:
    """sha256 of this rank's E/ep experts, gathered over its "dp" column (the same on the column)."""
    h = hashlib.sha256()
    for p in expert_params(model):
        h.update(p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
