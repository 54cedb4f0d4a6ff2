"""What each rank runs in the Muon distributed test (see `distributed_cases` for the rules).

Muon needs each matrix whole: under DDP every gradient is (experts are all-reduced before their
in-backward update, dense ones by DDP), under expert parallelism each rank's (E/world, out, in) tensor
holds whole expert matrices. Each engine's standard recipe here is `MuonTwin` (torch.optim.Muon per
matrix, fused AdamW for the rest) at the end of the step, clipping only the dense gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import STEPS, digest, outcome, train_sonar
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx.distributed as sd
from sonar_fx.config import MuonConfig
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.models import build_model
from sonar_fx.optim.matrices import matrix_params
from sonar_fx.optim.rules import end_of_step_optimizer

from helpers import batches

CFG = MuonConfig(lr=2e-2, weight_decay=0.1, max_grad_norm=0.5)


def train_standard(
    run: Callable[..., Any], model: nn.Module, rank: int, *, expert_scale: float = 1.0
) -> None:
    """Backward, (expert grads scaled), dense-only clip, the end-of-step Muon recipe."""
    layers = discover_experts(model)
    experts = [t.param for layer in layers for t in layer.tensors]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    opt = end_of_step_optimizer(
        CFG, list(model.parameters()), matrices=[*matrix_params(CFG, model, layers), *experts]
    )
    for b in batches(STEPS, seed=1 + rank):
        run(**b).loss.backward()
        for p in experts:
            p.grad.mul_(expert_scale)
        torch.nn.utils.clip_grad_norm_(dense, CFG.max_grad_norm)
        opt.step()
        opt.zero_grad()


def muon_cases(rank: int) -> dict[str, Any]:
    """DDP (eager, fp32) and expert parallelism (eager, bf16), each against its standard recipe."""
    out: dict[str, Any] = {}
    twin = build_model("tiny-olmoe", seed=0)
    train_standard(DDP(twin), twin, rank)
    model = build_model("tiny-olmoe", seed=0)
    wrapped = sd.ddp(model, CFG)
    train_sonar(wrapped, wrapped.sonar, rank)
    out["ddp/fp32"] = outcome(model, twin, wrapped.sonar)

    twin = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    sd.shard_experts_(twin)
    DDP._set_params_and_buffers_to_ignore_for_model(
        twin, [t.name for layer in discover_experts(twin) for t in layer.tensors]
    )
    train_standard(DDP(twin), twin, rank, expert_scale=1.0 / dist.get_world_size())
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    wrapped = sd.expert_parallel(model, CFG)
    train_sonar(wrapped, wrapped.sonar, rank)
    out["ep/bf16"] = outcome(model, twin, wrapped.sonar) | {
        "dense_digest": digest(model, dense_only=True),
        "matrices": len(wrapped.sonar.param_groups[2]["params"]),
    }
    return out
