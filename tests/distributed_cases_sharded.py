"""What each rank runs in the FSDP2 and expert-parallel tests (see `distributed_cases` for the rules)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import (
    DTYPES,
    STEPS,
    differ,
    digest,
    max_abs_diff,
    outcome,
    train_sonar,
    train_standard,
)
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx.distributed as sd
from sonar_fx.experts.grouped import grouped_mm
from sonar_fx.models import build_model

from helpers import CFG, batches

# -------------------------------------------------------------------------------------------- FSDP2


def fsdp_standard(rank: int, dtype: torch.dtype, compiler: str = "eager") -> nn.Module:
    model = sd.fully_shard_experts(build_model("tiny-olmoe", dtype=dtype, seed=0))
    if compiler != "eager":
        for block in model.model.layers:
            block.compile(backend=compiler)
    train_standard(model, model, rank)
    return model


def fsdp_sonar(rank: int, dtype: torch.dtype, compiler: str = "eager", steps: int = STEPS) -> nn.Module:
    model = sd.fsdp2(build_model("tiny-olmoe", dtype=dtype, seed=0), CFG, compiler=compiler)
    train_sonar(model, model.sonar, rank, steps)
    return model


def fsdp2_cases(rank: int) -> dict[str, Any]:
    """FSDP2 eager (fp32, bf16) and per-block compiled (aot_eager, bf16); DCP resume; shared groups."""
    out: dict[str, Any] = {}
    for key, dtype in DTYPES.items():
        model = fsdp_sonar(rank, dtype)
        out[f"eager/{key}"] = outcome(model, fsdp_standard(rank, dtype), model.sonar)
        if dtype == torch.float32:
            uninterrupted = model  # what the resume below must end equal to
    torch._dynamo.reset()
    twin = fsdp_standard(rank, torch.bfloat16, "aot_eager")
    torch._dynamo.reset()
    model = fsdp_sonar(rank, torch.bfloat16, "aot_eager")
    out["per_block/bf16"] = outcome(model, twin, model.sonar)
    out["resume"] = _dcp_resume(rank, uninterrupted)
    out["shared_group_warning"] = _shared_group_warning()
    return out


def _dcp_resume(rank: int, uninterrupted: nn.Module) -> dict[str, Any]:
    """2 steps, save with torch.distributed.checkpoint, load into a fresh model, 1 more step: equal to
    `uninterrupted` (the same fp32 Sonar run, all `STEPS` at once)."""
    first = fsdp_sonar(rank, torch.float32, steps=2)
    folder = [tempfile.mkdtemp(prefix="sonar-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    sd.save_state(folder[0], first, first.sonar)
    resumed = sd.fsdp2(build_model("tiny-olmoe", seed=0), CFG)
    sd.load_state(folder[0], resumed, resumed.sonar)
    restored_equal = not differ(resumed, first)
    b = batches(STEPS, seed=1 + rank)[2]
    resumed(**b).loss.backward()
    resumed.sonar.step()
    return {"restored_equal": restored_equal, "differ": differ(resumed, uninterrupted)}


def _shared_group_warning() -> list[str]:
    model = build_model("tiny-olmoe", seed=0)
    for block in model.model.layers:
        fully_shard(block)  # experts share the block's group with attention
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd.fsdp2(model, CFG)
    return [str(w.message) for w in caught if "sonar_fx.distributed.fsdp2" in str(w.message)]


# ------------------------------------------------------------------------------- expert parallelism


def ep_standard(rank: int, model_name: str, dtype: torch.dtype, *, scale: bool = True) -> nn.Module:
    """The same expert-parallel model, standard: DDP on dense, expert grads scaled by 1/world."""
    model = build_model(model_name, dtype=dtype, seed=0)
    sd.shard_experts_(model)
    experts = [n for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
    scale_by = 1.0 / dist.get_world_size() if scale else 1.0
    train_standard(DDP(model), model, rank, expert_scale=scale_by)
    return model


def ep_cases(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, dtype in DTYPES.items():
        model = build_model("tiny-olmoe", dtype=dtype, seed=0)
        wrapped = sd.expert_parallel(model, CFG)
        train_sonar(wrapped, wrapped.sonar, rank)
        twin = ep_standard(rank, "tiny-olmoe", dtype)
        out[f"eager/{key}"] = outcome(model, twin, wrapped.sonar) | {
            "dense_digest": digest(model, dense_only=True),
            "local_experts": int(model.model.layers[0].mlp.experts.gate_up_proj.shape[0]),
        }
    out["vs_data_parallel"] = _ep_against_data_parallel(rank)
    out["titan"] = _titan_recipe(rank)
    return out


def _ep_against_data_parallel(rank: int) -> dict[str, float]:
    """EP standard vs plain DDP (experts replicated) on the reference model: the same training up to
    fp32 rounding; without the 1/world scale, clearly not."""
    ddp_model = build_model("tiny-reference", seed=0)
    train_standard(DDP(ddp_model), ddp_model, rank)
    full = {n: p for n, p in ddp_model.named_parameters()}
    diffs = {}
    for label, scale in (("scaled", True), ("unscaled", False)):
        ep_model = ep_standard(rank, "tiny-reference", torch.float32, scale=scale)
        worst = 0.0
        for n, p in ep_model.named_parameters():
            q = full[n]
            if p.shape != q.shape:  # this rank's experts are rows [rank*El, (rank+1)*El) of the full tensor
                q = q[rank * p.shape[0] : (rank + 1) * p.shape[0]]
            worst = max(worst, float((p - q).abs().max()))
        diffs[label] = worst
    return diffs


class TitanExperts(sd.ExpertParallelExperts):
    """torchtitan's layout: w1 (El, h, d) gate, w3 (El, h, d) up, w2 (El, d, h) down, local to the rank."""

    def __init__(self, w1: Tensor, w2: Tensor, w3: Tensor, *, num_experts: int) -> None:
        nn.Module.__init__(self)
        self.w1, self.w2, self.w3 = nn.Parameter(w1), nn.Parameter(w2), nn.Parameter(w3)
        self.global_experts, self.num_experts, self.group = num_experts, w1.shape[0], dist.group.WORLD

    def local_experts(self, x_Rd: Tensor, offs_El: Tensor) -> Tensor:
        h_Rh = torch.nn.functional.silu(grouped_mm(x_Rd, self.w1, offs_El)) * grouped_mm(
            x_Rd, self.w3, offs_El
        )
        return grouped_mm(h_Rh, self.w2, offs_El)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.w1.dtype


def _titanize(model: nn.Module, rank: int, world: int) -> list[str]:
    """Replace the reference model's experts by w1/w2/w3 local shards; returns their names."""
    names = []
    for i, layer in enumerate(model.layers):
        old = layer.mlp.experts
        e = old.gate_up_proj.shape[0]
        rows = slice(rank * e // world, (rank + 1) * e // world)
        gate, up = old.gate_up_proj.detach()[rows].chunk(2, dim=1)
        layer.mlp.experts = TitanExperts(
            gate.clone(), old.down_proj.detach()[rows].clone(), up.clone(), num_experts=e
        )
        names += [f"layers.{i}.mlp.experts.{w}" for w in ("w1", "w2", "w3")]
    return names


def _titan_recipe(rank: int) -> dict[str, Any]:
    """Experts sharded by other code, named with `experts=`, `shard=False`; vs its own standard."""
    world = dist.get_world_size()
    sonar_model = build_model("tiny-reference", seed=0)
    names = _titanize(sonar_model, rank, world)
    wrapped = sd.expert_parallel(sonar_model, CFG, shard=False, experts=names)
    train_sonar(wrapped, wrapped.sonar, rank)
    twin = build_model("tiny-reference", seed=0)
    _titanize(twin, rank, world)
    DDP._set_params_and_buffers_to_ignore_for_model(twin, names)
    experts = {id(p) for n, p in twin.named_parameters() if n in names}
    dense = [p for p in twin.parameters() if id(p) not in experts]
    opt = torch.optim.AdamW(twin.parameters(), lr=CFG.lr, betas=CFG.betas, eps=CFG.eps,
                            weight_decay=CFG.weight_decay, fused=True)  # fmt: skip
    wrapped_twin = DDP(twin)
    for b in batches(STEPS, seed=1 + rank):
        wrapped_twin(**b).loss.backward()
        for p in twin.parameters():
            if id(p) in experts:
                p.grad.mul_(1.0 / world)
        torch.nn.utils.clip_grad_norm_(dense, CFG.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return {"differ": differ(sonar_model, twin), "by_hook": wrapped.sonar.report()["updates_by_hook"],
            "max_abs_diff": max_abs_diff(sonar_model, twin)}  # fmt: skip
