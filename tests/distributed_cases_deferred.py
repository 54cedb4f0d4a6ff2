"""What each rank runs in the tests of the deferred schedule on DDP (`test_distributed_deferred`).

Each case trains one model with Sonar on DDP under schedule="deferred" and its twin in plain torch:
`DistributedDataParallel` over every parameter, micro-batches accumulated with `no_sync()` on all but
the last (the user's loop keeps those lines, on both), `clip_grad_norm_` over every parameter (or the
dense ones) and `AdamW(fused=True)` over [dense, experts]. A case reports which tensors differ on
this rank (`torch.equal`), a digest of every tensor (ranks must agree), each step's norm as Sonar
logged it and as the twin's `clip_grad_norm_` returned it, and what the deferred schedule reports.
The negative control trains the twin with a sync on every micro-batch (other arithmetic): it must
differ. Loops DDP reduces otherwise are refused at step(): the message and the tensors it moved.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import DTYPES, differ, digest, max_abs_diff
from distributed_cases_options import ENGINES, ep_global_clip_
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.distributed.reductions import LocalExperts
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.models import build_model
from sonar_fx.optim.norms import tensor_norm, total_norm
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from helpers import CFG, batches

STEPS = 3
MAX_NORM = 0.05
"""Below every step's norm on tiny-olmoe: the clip is active on each step (the test checks it)."""
MODELS = {"ddp": "tiny-olmoe", "ep": "tiny-reference"}
"""DDP: transformers' grouped_mm experts, whose GEMMs the eager capture keeps. Expert parallelism
replaces the experts module with its own, whose grouped GEMM is Sonar's custom op: the eager capture
keeps its operands, as a compiled block's graph pass does."""


def cfg_for(clip: str) -> sonar_fx.AdamWConfig:
    return replace(CFG, max_grad_norm=MAX_NORM, expert_clip="global" if clip == "all" else None)


def data_of(rank: int, accum: int) -> list[list[dict[str, torch.Tensor]]]:
    """This rank's micro-batches, `accum` per step."""
    flat = batches(STEPS * accum, seed=1 + rank)
    return [flat[s * accum : (s + 1) * accum] for s in range(STEPS)]


def accumulate(run: Any, micro_batches: list[dict[str, torch.Tensor]], sync: str) -> None:
    """The user's loop over one step's micro-batches: `no_sync()` on all but the last ("last"), on
    none ("every"), or on all ("never")."""
    for i, b in enumerate(micro_batches):
        quiet = sync == "never" or (sync == "last" and i < len(micro_batches) - 1)
        with run.no_sync() if quiet else nullcontext():
            run(**b).loss.backward()


# ----------------------------------------------------------------------------------------- the twins


def sonar_on(
    engine: str, dtype: torch.dtype, clip: str, compiler: str, ddp_kwargs: dict | None = None,
    model_kw: dict | None = None,
) -> tuple[Any, Any, nn.Module]:  # fmt: skip
    torch._dynamo.reset()
    model = build_model(MODELS[engine], dtype=dtype, seed=0, **(model_kw or {}))
    build = sd.ddp if engine == "ddp" else sd.expert_parallel
    run = build(model, cfg_for(clip), compiler=compiler, schedule="deferred", ddp_kwargs=ddp_kwargs)
    return run, run.sonar, model


def train_sonar(
    run: Any, opt: Any, data: list[list[dict]], clip: str, sync: str = "last", seen: dict | None = None
) -> list[float]:
    """The loop; `seen` gets what the last step held before `step()` (the memory claim)."""
    norms = []
    for micro_batches in data:
        accumulate(run, micro_batches, sync)
        if seen is not None:
            record_before_step(opt, seen)
        opt.step()
        opt.zero_grad()
        logged = opt.grad_norms()
        norms.append(logged["total"] if clip == "all" else logged["dense"])
    return norms


def record_before_step(opt: Any, seen: dict) -> None:
    """What the optimizer holds between the last backward and `step()` (the memory claims)."""
    experts = opt.expert_group["params"]
    seen["expert_grads_alive"] = sum(p.grad is not None for p in experts)
    held = [p for p in experts if opt.deferred.crossed_over(p) or opt.deferred.arrived_whole(p)]
    seen["held"] = len(held)  # gradients held from backward to step() (crossed over, or whole)
    seen["held_bytes"] = sum(p.numel() * p.element_size() for p in held)
    seen["kept_bytes"] = opt.deferred.live_bytes
    seen["expert_grad_bytes"] = sum(p.numel() * p.element_size() for p in experts)
    seen["biggest_expert"] = max(p.numel() * p.element_size() for p in experts)


def plain_adamw(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], torch.optim.AdamW]:
    """The plain twin's dense and expert parameters and its fused AdamW over [dense, experts], with the
    suite's hyper-parameters (`helpers.CFG`)."""
    ids = ExpertSet.discover(model).names_by_id()
    dense = [p for p in model.parameters() if id(p) not in ids]
    experts = [p for p in model.parameters() if id(p) in ids]
    opt = torch.optim.AdamW(
        [dict(params=dense), dict(params=experts)],
        lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True,
    )  # fmt: skip
    return dense, experts, opt


def train_plain(
    engine: str, dtype: torch.dtype, clip: str, compiler: str, data: list[list[dict]], sync: str = "last",
    ddp_kwargs: dict | None = None, model_kw: dict | None = None,
) -> tuple[nn.Module, list[float]]:  # fmt: skip
    """Plain DDP over every parameter (expert parallelism: the experts sharded, out of DDP, their
    gradients scaled by 1/world as data-parallel averaging implies), fused AdamW over [dense, experts],
    clip over `clip` (expert parallelism, all: torchtitan's norm, `ep_global_clip_`). `ddp_kwargs`:
    DDP's (DDP only); `model_kw`: the model's config overrides."""
    torch._dynamo.reset()
    model = build_model(MODELS[engine], dtype=dtype, seed=0, **(model_kw or {}))
    if engine == "ddp":
        wrapped = DDP(model, **(ddp_kwargs or {}))
        run = wrapped if compiler == "eager" else torch.compile(wrapped, backend=compiler)
    else:
        run = wrapped = ENGINES["ep"].standard(model, compiler)
    dense, expert_params, opt = plain_adamw(model)
    norms = []
    for micro_batches in data:
        for i, b in enumerate(micro_batches):
            quiet = sync == "last" and i < len(micro_batches) - 1
            with wrapped.no_sync() if quiet else nullcontext():
                run(**b).loss.backward()
        if engine == "ep":
            for p in expert_params:
                p.grad.mul_(ENGINES["ep"].expert_scale)
        if engine == "ep" and clip == "all":
            norms.append(float(ep_global_clip_(dense, expert_params, MAX_NORM)))
        else:
            clipped = list(model.parameters()) if clip == "all" else dense
            norms.append(float(torch.nn.utils.clip_grad_norm_(clipped, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return model, norms


# ------------------------------------------------------------------------------------------- cases


def exact(
    rank: int, dtype: str, clip: str, compiler: str, accum: int, engine: str = "ddp",
    ddp_kwargs: dict | None = None, model_kw: dict | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Sonar deferred on the engine against the plain engine with the same no_sync() loop (and the
    same `ddp_kwargs` on both DDP wrappers, the same model overrides `model_kw`)."""
    data = data_of(rank, accum)
    run, opt, model = sonar_on(engine, DTYPES[dtype], clip, compiler, ddp_kwargs, model_kw)
    seen: dict[str, Any] = {}
    norms = train_sonar(run, opt, data, clip, seen=seen)
    report = opt.report()
    twin, twin_norms = train_plain(
        engine, DTYPES[dtype], clip, compiler, data, ddp_kwargs=ddp_kwargs, model_kw=model_kw
    )
    return {
        "differ": differ(model, twin),
        "digest": digest(model),
        "dense_digest": digest(model, dense_only=True),
        "updates_kept_whole": report["updates_kept_whole"],
        "norms": norms,
        "twin_norms": twin_norms,
        "updates_deferred": report["updates_deferred"],
        "kept_whole": report["deferred"]["kept_whole"],
        "kept_operand_peak": report["deferred"]["kept_operand_peak"],
        "graphs": report["graphs_compiled"] + report["graphs_from_cache"],
        "crossed_over": report["deferred"]["crossed_over"],
        "step_grad_peak": report["expert_grad_bytes"]["measured_peak"],
        "overlapped": report["deferred"]["overlapped"],
        "sliced": report["deferred"]["sliced"],
        **seen,
        "fallbacks": report["fallbacks"],
    }


def against_sync_every_micro_batch(rank: int) -> list[str]:
    """Negative control: the twin syncs every micro-batch (DDP reduces the running sum each time)."""
    data = data_of(rank, 4)
    run, opt, model = sonar_on("ddp", torch.float32, "all", "eager")
    train_sonar(run, opt, data, "all")
    twin, _ = train_plain("ddp", torch.float32, "all", "eager", data, sync="every")
    return differ(model, twin)


SCALER = dict(init_scale=256.0, growth_factor=2.0**12, backoff_factor=2.0**-12, growth_interval=1)
"""A scale that grows into fp16 overflow every other step: steps are skipped and the scale backs off."""


def scaled_backwards(run: Any, scaler: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """The user's loop: fp16 CPU autocast, the scaled loss, no_sync() on all but the last micro-batch."""
    for i, b in enumerate(micro_batches):
        with run.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = run(**b).loss
            scaler.scale(loss).backward()


def grad_scaler(rank: int, engine: str = "ddp") -> dict[str, Any]:
    """fp16 CPU autocast, fp32 weights, 2 micro-batches under the user's no_sync() loop and the
    ordinary scaler calls on both sides; a scale that grows into overflow every other step, so steps
    are skipped (on every rank alike: the verdict is taken over every rank) and the scale backs off as
    in the plain engine. Reports the tensors that differ, each step's scale and norm on both sides."""
    data = batches(10, seed=1 + rank)
    steps = [data[i : i + 2] for i in range(0, 10, 2)]
    run, opt, model = sonar_on(engine, torch.float32, "all", "eager")
    ours = torch.amp.GradScaler("cpu", **SCALER)
    scales: list[list[float]] = []
    norms: list[list[float]] = []
    for micro_batches in steps:
        scaled_backwards(run, ours, micro_batches)
        ours.step(opt)
        ours.update()
        opt.zero_grad()
        scales.append([ours.get_scale()])
        norms.append([opt.grad_norms()["total"]])
    twin = train_plain_scaled(engine, steps, scales, norms)
    return {"differ": differ(model, twin), "scales": scales, "norms": norms}


def train_plain_scaled(
    engine: str, steps: list[list[dict]], scales: list[list[float]], norms: list[list[float]]
) -> nn.Module:
    """The plain engine with the scaler: `unscale_`, the clip over every parameter (`clip_grad_norm_`;
    expert parallelism: its experts scaled by 1/world first, torchtitan's norm, and the inf verdict
    taken over every rank, as one optimizer over every parameter has it: the rank's own experts are
    checked on that rank alone), `step`, `update`; each step's scale and norm appended to theirs."""
    torch._dynamo.reset()
    twin = build_model(MODELS[engine], dtype=torch.float32, seed=0)
    wrapped = DDP(twin) if engine == "ddp" else ENGINES["ep"].standard(twin, "eager")
    dense, expert_params, twin_opt = plain_adamw(twin)
    theirs = torch.amp.GradScaler("cpu", **SCALER)
    for n, micro_batches in enumerate(steps):
        scaled_backwards(wrapped, theirs, micro_batches)
        if engine == "ep":
            for p in expert_params:
                p.grad.mul_(ENGINES["ep"].expert_scale)
        theirs.unscale_(twin_opt)
        if engine == "ep":
            one_verdict_(theirs, [twin_opt])
            norms[n].append(float(ep_global_clip_(dense, expert_params, MAX_NORM)))
        else:
            norms[n].append(float(torch.nn.utils.clip_grad_norm_(list(twin.parameters()), MAX_NORM)))
        theirs.step(twin_opt)
        theirs.update()
        twin_opt.zero_grad()
        scales[n].append(theirs.get_scale())
    return twin


def one_verdict_(scaler: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    """One inf verdict for the whole step, as one optimizer over every parameter has on FSDP2: each
    optimizer's (dense: every rank; experts: the ranks that hold them) summed and taken over every rank."""
    states = [scaler._per_optimizer_states[id(o)]["found_inf_per_device"] for o in optimizers]
    found = sum(f for state in states for f in state.values())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    for state in states:
        for device in state:
            state[device] = found.clone()


def inf_on_one_rank(rank: int) -> dict[str, Any]:
    """nonfinite="skip": in step 2 only rank 1's loss is non-finite. DDP's mean spreads it, so every
    rank skips that step whole (no weight moves on any rank), as plain DDP skipping a step whose
    clip_grad_norm_ is not finite; the other steps train bitwise alike."""
    data = data_of(rank, 2)
    poisoned = (1, 1)  # (step, rank)

    def loss_of(run: Any, b: dict, step: int) -> torch.Tensor:
        loss = run(**b).loss
        return loss * float("inf") if (step, rank) == poisoned else loss

    torch._dynamo.reset()
    model = build_model(MODELS["ddp"], dtype=torch.float32, seed=0)
    run = sd.ddp(model, cfg_for("all"), nonfinite="skip", schedule="deferred")
    opt = run.sonar
    moved_in_skipped: list[str] = []
    for step, micro_batches in enumerate(data):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for i, b in enumerate(micro_batches):
            with run.no_sync() if i == 0 else nullcontext():
                loss_of(run, b, step).backward()
        opt.step()
        opt.zero_grad()
        if step == poisoned[0]:
            moved_in_skipped = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    torch._dynamo.reset()
    twin = build_model(MODELS["ddp"], dtype=torch.float32, seed=0)
    wrapped = DDP(twin)
    twin_opt = torch.optim.AdamW(
        list(twin.parameters()), lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay,
        fused=True,
    )  # fmt: skip
    for step, micro_batches in enumerate(data):
        for i, b in enumerate(micro_batches):
            with wrapped.no_sync() if i == 0 else nullcontext():
                loss_of(wrapped, b, step).backward()
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(list(twin.parameters()), MAX_NORM)):
            twin_opt.step()
        twin_opt.zero_grad()
    return {
        "differ": differ(model, twin),
        "moved_in_skipped": moved_in_skipped,
        "skipped_steps": opt.report()["skipped_steps"],
    }


def refused_loop(rank: int, sync: str) -> dict[str, Any]:
    """A step DDP reduced otherwise than once at its last micro-batch: refused at step(), nothing
    moved; zero_grad() drops it and the right loop then trains exactly as plain DDP does."""
    run, opt, model = sonar_on("ddp", torch.float32, "all", "eager")
    accumulate(run, batches(2, seed=100 + rank), sync)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    message = None
    try:
        opt.step()
    except sonar_fx.SonarUsageError as err:
        message = str(err)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    opt.zero_grad()
    data = data_of(rank, 2)
    train_sonar(run, opt, data, "all")
    twin, _ = train_plain("ddp", torch.float32, "all", "eager", data)
    return {"message": message, "moved": moved, "then": differ(model, twin)}


def users_clip(rank: int) -> dict[str, Any]:
    """model.sonar.clip_grad_norm_ on DDP: its expert norms would be of this rank's unreduced
    gradients, so it is refused before it clips anything; Sonar's own clip is the fix it names."""
    model = build_model(MODELS["ddp"], dtype=torch.float32, seed=0)
    run = sd.ddp(model, replace(CFG, max_grad_norm=None), schedule="deferred")
    opt = run.sonar
    accumulate(run, batches(2, seed=200 + rank), "last")
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    message = None
    try:
        opt.clip_grad_norm_(MAX_NORM)
    except sonar_fx.SonarUsageError as err:
        message = str(err)
    clipped = [n for n, p in model.named_parameters() if n in grads and not torch.equal(p.grad, grads[n])]
    return {"message": message, "clipped": clipped, "dense_grads": len(grads)}


def ep_norm_semantics(rank: int) -> dict[str, list[bool]]:
    """Expert parallelism's global norm (`LocalExperts.global_norm`) on random gradients, 8 draws, against
    torchtitan's (`ep_global_clip_`: the experts as DTensors sharded over the ranks, whose norm
    `full_tensor()` reduces, with the dense norm). The negative control: each rank's total expert norm
    reduced once over the ranks, as this norm was taken before (the same sum, other bits)."""
    gen = torch.Generator().manual_seed(rank)
    seen: dict[str, list[bool]] = {"equal": [], "per_rank_total_equal": []}
    for draw in range(8):
        experts = [nn.Parameter(torch.zeros(2, 32, 32)) for _ in range(4)]
        for p in experts:
            p.grad = torch.randn(p.shape, generator=gen)
        dense = [nn.Parameter(torch.zeros(64))]
        dense[0].grad = torch.randn(64, generator=torch.Generator().manual_seed(draw))  # alike on every rank
        grads = [p.grad for p in dense + experts]
        norms = [tensor_norm(g) for g in grads]
        ours = LocalExperts(dist.group.WORLD).global_norm(norms, [False] + [True] * len(experts))
        squares = total_norm(norms[1:]) ** 2
        dist.all_reduce(squares)
        per_rank_total = (squares + total_norm(norms[:1]) ** 2) ** (1.0 / 2)
        titan = ep_global_clip_(dense, experts, MAX_NORM)
        seen["equal"].append(torch.equal(ours, titan))
        seen["per_rank_total_equal"].append(torch.equal(per_rank_total, titan))
    return seen


EXACT = [
    ("fp32", "all", "eager", 4),
    ("bf16", "all", "eager", 3),
    ("fp32", "dense", "eager", 2),
    ("fp32", "all", "aot_eager", 2),
    ("bf16", "all", "aot_eager", 4),
    ("bf16", "dense", "aot_eager", 3),
]
"""(dtype, clip, compiler, micro-batches per step): every dtype and compiler with the clip over all
parameters, and the dense-only clip on each compiler."""


EXACT_EP = [
    ("fp32", "all", "eager", 3, "ep"),
    ("bf16", "all", "aot_eager", 2, "ep"),
    ("fp32", "dense", "aot_eager", 4, "ep"),
]
"""Expert parallelism (tiny-reference, as its other tests): the clip over all parameters eager and
compiled, the dense-only clip compiled."""


def label(dtype: str, clip: str, compiler: str, accum: int, engine: str = "ddp") -> str:
    return f"{engine}/{dtype}/{clip}/{compiler}/{accum}"


def deferred(rank: int) -> dict[str, Any]:
    """Every case, in one spawn. With 3-4 micro-batches tiny-olmoe's expert tensors cross over, as do
    tiny-reference's under expert parallelism (few experts per rank, each receiving many slots): the
    saving is lost by design, so the guard warns (its refusal has its own tests in
    test_saving_guard.py)."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    out: dict[str, Any] = {label(*case): exact(rank, *case) for case in EXACT + EXACT_EP}
    out["control/sync_every"] = against_sync_every_micro_batch(rank)
    out["grad_scaler"] = grad_scaler(rank)
    out["grad_scaler/ep"] = grad_scaler(rank, "ep")
    out["inf_on_one_rank"] = inf_on_one_rank(rank)
    out["ep_norm"] = ep_norm_semantics(rank)
    out["refused/every"] = refused_loop(rank, "every")
    out["refused/never"] = refused_loop(rank, "never")
    out["users_clip"] = users_clip(rank)
    return out


INDUCTOR = ("bf16", "all", "inductor", 2)
INDUCTOR_EP = ("bf16", "all", "inductor", 2, "ep")
"""Expert parallelism with each block compiled by inductor on both sides (the all-to-alls run between
the block's graphs), bf16, 2 micro-batches, the clip over every parameter; its own spawn (slow)."""


def deferred_inductor(rank: int, case: tuple = INDUCTOR) -> dict[str, Any]:
    """An inductor case alone (its own spawn, marked slow): bf16, the clip over all parameters."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # inductor's CPU embedding backward accumulates in parallel
    try:
        return {label(*case): exact(rank, *case)}
    finally:
        torch.use_deterministic_algorithms(deterministic)


def deferred_inductor_ep(rank: int) -> dict[str, Any]:
    return deferred_inductor(rank, INDUCTOR_EP)


FOUR_RANKS = {"ddp": ("fp32", "all", "eager", 4, "ddp"), "ep": ("fp32", "all", "eager", 4, "ep")}
"""The 4-rank cases (one spawn per engine, marked slow): the clip over all parameters, 4 micro-batches."""
ONE_TENSOR_BUCKETS = {"bucket_cap_mb_list": [0]}
"""DDP with each parameter in its own bucket, on both sides, from the first step (DDP's default puts
every parameter in one bucket for the first step and rebuilds them after it; a per-bucket cap list is
kept through the rebuild). Above 2 ranks gloo's ring sums an element in an order set by its place in
the buffer reduced, so the same values reduced alone and inside a bucket with other tensors round
otherwise (last bits): Sonar's dense buckets (experts left out) and the twin's (experts in) differ, as
do Sonar's expert all-reduce and the twin's bucket. With one tensor per bucket every reduction on both
sides is of one tensor alone; the arithmetic is then DDP's, bit for bit."""
EP_FOUR_RANKS = {"num_experts": 8}
"""Two experts per rank on 4 ranks (one expert per rank has its own 2-rank case:
`distributed_cases_deferred_ep`)."""


def deferred_four(rank: int, engine: str) -> dict[str, Any]:
    """The 4-rank case of `engine`. DDP: with one tensor per bucket (bitwise), and the negative control
    with DDP's default buckets on both sides (last bits apart, reported)."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    case = FOUR_RANKS[engine]
    if engine == "ep":  # its experts need no collective, DDP's dense buckets are the same on both sides
        return {label(*case): exact(rank, *case, model_kw=EP_FOUR_RANKS)}
    out: dict[str, Any] = {label(*case): exact(rank, *case, ddp_kwargs=ONE_TENSOR_BUCKETS)}
    data = data_of(rank, case[3])
    run, opt, model = sonar_on("ddp", torch.float32, "all", "eager")
    train_sonar(run, opt, data, "all")
    twin, _ = train_plain("ddp", torch.float32, "all", "eager", data)
    out["control/default_buckets"] = dict(differ=differ(model, twin), max_abs_diff=max_abs_diff(model, twin))
    return out


def deferred_four_ddp(rank: int) -> dict[str, Any]:
    return deferred_four(rank, "ddp")


def deferred_four_ep(rank: int) -> dict[str, Any]:
    return deferred_four(rank, "ep")
