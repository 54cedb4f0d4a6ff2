"""What each rank runs in the GradScaler tests of the deferred schedule on FSDP2 and FSDP2 x EP
(`test_distributed_deferred_sharded`, in the spawn of `distributed_cases_deferred_sharded`).

fp16 CPU autocast with fp32 weights and a `torch.amp.GradScaler` whose scale grows into overflow every
other step: Sonar under the ordinary scaler calls (`scaler.step(opt)`, the clip over every parameter
Sonar's) against plain FSDP2 (x EP) with `scaler.unscale_`, `clip_grad_norm_` over every parameter (or
torchtitan's on the 2-D mesh) and `scaler.step`. The scaler unscales FSDP2's dense DTensor shards in
place before `step()`; Sonar's watch for a user's own clip recognises that write (`grad_watch`), and
the cases show both sides of it: the scaler's unscale passes, a clip after it is refused. An inf in one
rank's expert gradient only (dense gradients finite) skips the step on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed_cases_deferred import SCALER, one_verdict_
from distributed_cases_deferred_sharded import (
    MAX_NORM,
    differ_full,
    mesh_of,
    plain_engine,
    sonar_on,
    titan_clip_,
)

import sonar_fx
from sonar_fx.experts.discovery import ExpertSet

from helpers import CFG, batches

SCALER_STEPS = 5


def scaled_step_data(rank: int) -> list[list[dict[str, torch.Tensor]]]:
    flat = batches(2 * SCALER_STEPS, seed=1 + rank)
    return [flat[i : i + 2] for i in range(0, len(flat), 2)]


def scaled_backwards(model: Any, scaler: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """The user's loop: fp16 CPU autocast, the scaled loss, gradient sync on the last micro-batch."""
    for i, b in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**b).loss
        scaler.scale(loss).backward()


def grad_scaler(rank: int, engine: str, mesh: tuple[int, int]) -> dict[str, Any]:
    """fp16 CPU autocast, fp32 weights, 2 micro-batches per step and the ordinary scaler calls on both
    sides (Sonar clips over every parameter at step(); the twin unscales, clips over every parameter
    with `clip_grad_norm_`, steps, updates). Overflowing steps are skipped on every rank alike (the
    dense verdict is DTensor's, the experts' taken on their reduced shards) and the scale backs off as
    in plain FSDP2. Reports the parameters that differ, each step's scale on both sides, and the norms."""
    data = scaled_step_data(rank)
    model = sonar_on(engine, torch.float32, "all", "eager", mesh)
    opt, ours = model.sonar, torch.amp.GradScaler("cpu", **SCALER)
    scales, norms = [], []
    for micro_batches in data:
        scaled_backwards(model, ours, micro_batches)
        ours.step(opt)
        ours.update()
        opt.zero_grad()
        scales.append([ours.get_scale()])
        norms.append([opt.grad_norms()["total"]])
    twin = plain_engine(engine, torch.float32, "eager", mesh)
    ids = ExpertSet.discover(twin).names_by_id()
    dense = [p for p in twin.parameters() if id(p) not in ids]
    experts = [p for p in twin.parameters() if id(p) in ids]
    hyper = dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True)
    if engine == "fsdp2":
        optimizers = [torch.optim.AdamW([dict(params=dense), dict(params=experts)], **hyper)]
    else:  # dense and expert DTensors live on different meshes
        optimizers = [torch.optim.AdamW(dense, **hyper), torch.optim.AdamW(experts, **hyper)]
    theirs = torch.amp.GradScaler("cpu", **SCALER)
    for n, micro_batches in enumerate(data):
        scaled_backwards(twin, theirs, micro_batches)
        for twin_opt in optimizers:
            theirs.unscale_(twin_opt)
        if engine == "fsdp2":
            norms[n].append(float(torch.nn.utils.clip_grad_norm_(list(twin.parameters()), MAX_NORM)))
        else:
            norms[n].append(float(titan_clip_(dense, experts, mesh_of(mesh))))
            one_verdict_(theirs, optimizers)
        for twin_opt in optimizers:
            theirs.step(twin_opt)
        theirs.update()
        for twin_opt in optimizers:
            twin_opt.zero_grad()
        scales[n].append(theirs.get_scale())
    return {"differ": differ_full(model, twin), "scales": scales, "norms": norms}


def poison_one_expert_(opt: Any) -> None:
    """An inf in one expert gradient of this rank only, where the deferred step keeps it: the first
    kept operand (or the whole gradient kept) of the first expert tensor."""
    pending = next(iter(opt.deferred.kept.values()))
    entry = pending.groups()[0][0]
    tensors = (
        [o for o in entry.operands if isinstance(o, torch.Tensor)] if hasattr(entry, "operands") else [entry]
    )
    local = getattr(tensors[0], "_local_tensor", tensors[0])
    local[(0,) * local.dim()] = float("inf")


def expert_inf_on_one_rank(rank: int, engine: str, mesh: tuple[int, int]) -> dict[str, Any]:
    """Under the scaler, step 2 has an inf in one expert gradient of rank 1 only (the dense gradients
    finite: the scaler calls step()). Every rank skips that step whole (no weight moves on any rank)
    and the scale backs off on every rank alike; the next step trains."""
    data = scaled_step_data(rank)[:3]
    model = sonar_on(engine, torch.float32, "all", "eager", mesh)
    opt, scaler = model.sonar, torch.amp.GradScaler("cpu")  # a scale that overflows no step by itself
    moved, scales = [], []
    for step, micro_batches in enumerate(data):
        scaled_backwards(model, scaler, micro_batches)
        if step == 1 and rank == 1:
            poison_one_expert_(opt)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved.append([n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])])
        scales.append(scaler.get_scale())
    return {"moved": moved, "scales": scales}


def user_clip_under_scaler(rank: int) -> dict[str, Any]:
    """The plain recipe carried over: `scaler.unscale_`, the user's own `clip_grad_norm_` (dense
    shards only: the experts' gradients do not exist before step()), `scaler.step`. The scaler's
    unscale is Sonar's to recognise, the clip after it is not: refused at step(), nothing moved."""
    model = sonar_on("fsdp2", torch.float32, "all", "eager", (1, 2))
    scaler = torch.amp.GradScaler("cpu")
    scaled_backwards(model, scaler, batches(2, seed=100 + rank))
    scaler.unscale_(model.sonar)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e-3)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    message = None
    try:
        scaler.step(model.sonar)
    except sonar_fx.SonarUsageError as err:
        message = str(err)
    now = dict(model.named_parameters())
    return {
        "message": message,
        "moved": [n for n in before if not torch.equal(now[n].full_tensor(), before[n])],
    }


def watch_under_scaler(rank: int) -> dict[str, Any]:
    """The dense watch on FSDP2's shards, asked directly: the scaler's unscale is a write it sees (so,
    unrecognised, it would refuse the step), `accept_unscale` recognises it, and not once a clip
    (by a factor below 1) followed it."""
    model = sonar_on("fsdp2", torch.float32, "all", "eager", (1, 2))
    opt, scaler = model.sonar, torch.amp.GradScaler("cpu")
    dense = opt.dense_params()
    out = {}
    for clip in (False, True):
        scaled_backwards(model, scaler, batches(2, seed=100 + rank))
        scaler.unscale_(opt)
        out[f"seen/{clip}"] = len(opt.grad_watch.changed_since_backward(dense))
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in dense if p.grad is not None], 1e-3)
        inv_scale = scaler._scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        out[f"accepted/{clip}"] = opt.grad_watch.accept_unscale(dense, inv_scale)
        out[f"left/{clip}"] = len(opt.grad_watch.changed_since_backward(dense))
        opt.zero_grad()
        scaler = torch.amp.GradScaler("cpu")
    return out


def grad_scaler_cases(rank: int) -> dict[str, Any]:
    return {
        "grad_scaler/fsdp2": grad_scaler(rank, "fsdp2", (1, 2)),
        "grad_scaler/ep21": grad_scaler(rank, "fsdp2_ep", (2, 1)),
        "grad_scaler/ep12": grad_scaler(rank, "fsdp2_ep", (1, 2)),
        "expert_inf/fsdp2": expert_inf_on_one_rank(rank, "fsdp2", (1, 2)),
        "expert_inf/ep12": expert_inf_on_one_rank(rank, "fsdp2_ep", (1, 2)),
        "user_clip_under_scaler": user_clip_under_scaler(rank),
        "watch_under_scaler": watch_under_scaler(rank),
    }
