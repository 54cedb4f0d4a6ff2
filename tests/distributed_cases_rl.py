"""What each rank runs in the test of the RL example (`test_rl_example`): the GRPO loop of
`examples/rl_fsdp2.py` on Sonar (schedule="deferred", the clip over every parameter), on the example's
own plain arm, and on a twin written here in plain torch with the example's rollout and loss.

The twin is the engine as torch gives it (`DistributedDataParallel` or `fully_shard` on each experts
module, each block and the root), `AdamW(fused=True)` over every parameter, micro-batches synced only at
the last (`no_sync()` / `set_requires_gradient_sync`), `clip_grad_norm_` over every parameter (its
DTensor norm reduced by `full_tensor()`) and the step skipped on a non-finite norm. A case reports which
parameters differ from the twin (`torch.equal` on every parameter's full tensor), a digest (ranks must
agree), each step's norm on each side and what the runs measured of expert-gradient memory. The negative
control is the twin syncing every micro-batch (other arithmetic): it must differ.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
from distributed_cases import digest
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import sonar_fx
from examples import rl_fsdp2 as rl
from sonar_fx.models import build_model

CFG = rl.RLConfig(steps=3, layers=3, completion_len=6, max_grad_norm=0.05)
"""The example's defaults (3 steps, 4 micro-batches, 32 experts, a clip far below every step's norm:
checked) on 3 layers and 6-token completions, to keep the test short."""
INF_CFG = replace(CFG, steps=2, micro_batches=2, inf_at_step=1)
"""Rank 0's loss is infinite in step 1: every rank skips that step."""
ENGINES = ("ddp", "fsdp2")


def twin(cfg: rl.RLConfig, *, sync_every: bool = False) -> tuple[nn.Module, list[float]]:
    """The plain engine trained by plain torch on the example's rollouts and loss."""
    torch._dynamo.reset()
    model = build_model(
        cfg.model, dtype=cfg.torch_dtype, seed=cfg.seed, num_hidden_layers=cfg.layers, num_experts=cfg.experts
    )
    run: nn.Module = model
    if cfg.parallel == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer.mlp.experts)
            fully_shard(layer)
        fully_shard(model)
    else:
        run = DistributedDataParallel(model)
    defaults = sonar_fx.AdamWConfig()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=defaults.betas, eps=defaults.eps, weight_decay=cfg.weight_decay,
        fused=True,
    )  # fmt: skip
    reference = rl.build_reference(cfg)
    norms: list[float] = []
    for step in range(cfg.steps):
        if step % cfg.steps_per_rollout == 0:
            data = rl.rollout(run, reference, cfg, step)
        n_tokens = int(data.mask.sum())
        for i, batch in enumerate(rl.micro_batches(data, cfg.micro_batches)):
            sync = sync_every or i == cfg.micro_batches - 1
            quiet = contextlib.nullcontext()
            if cfg.parallel == "fsdp2":
                model.set_requires_gradient_sync(sync)
            elif not sync:
                quiet = run.no_sync()
            with quiet:
                loss, _ = rl.grpo_loss(rl.token_logprobs(run, batch["sequences"]), batch, cfg, n_tokens)
                if step == cfg.inf_at_step and i == 0 and torch.distributed.get_rank() == 0:
                    loss = loss * float("inf")
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
        norms.append(float(norm))
    return model, norms


def differing(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> list[str]:
    assert ours.keys() == theirs.keys()
    return [name for name in ours if not torch.equal(ours[name], theirs[name])]


def engine_case(parallel: str) -> dict[str, Any]:
    """Sonar, the example's plain arm and the twin, on one engine; then the inf step on Sonar and twin."""
    cfg = replace(CFG, parallel=parallel)
    try:
        model, ours = rl.train(cfg, log=False)
    except sonar_fx.SonarUsageError as err:  # the engine refuses the deferred schedule
        return {"refused": str(err)}
    sonar_weights, sonar_digest = rl.full_weights(model), digest(model)
    plain_model, plain = rl.train(replace(cfg, plain=True), log=False)
    plain_weights = rl.full_weights(plain_model)
    twin_model, twin_norms = twin(cfg)
    twin_weights = rl.full_weights(twin_model)
    control_model, _ = twin(cfg, sync_every=True)
    inf_cfg = replace(INF_CFG, parallel=parallel)
    inf_model, inf_run = rl.train(inf_cfg, log=False)
    inf_twin, inf_twin_norms = twin(inf_cfg)
    return {
        "differ": differing(sonar_weights, twin_weights),
        "plain_differ": differing(plain_weights, twin_weights),
        "control_differ": differing(sonar_weights, rl.full_weights(control_model)),
        "digest": sonar_digest,
        "norms": ours.norms,
        "plain_norms": plain.norms,
        "twin_norms": twin_norms,
        "skipped": ours.skipped,
        "sonar": {k: getattr(ours, k) for k in ("expert_grad_peak", "kept_operand_peak", "expert_bytes")},
        "plain": {k: getattr(plain, k) for k in ("expert_grad_peak", "expert_bytes")},
        "biggest_expert": ours.biggest_expert,
        "inf_differ": differing(rl.full_weights(inf_model), rl.full_weights(inf_twin)),
        "inf_skipped": inf_run.skipped,
        "inf_norms": [str(n) for n in inf_run.norms],
        "inf_twin_norms": [str(n) for n in inf_twin_norms],
    }


def rl_example(rank: int) -> dict[str, Any]:
    return {parallel: engine_case(parallel) for parallel in ENGINES}
