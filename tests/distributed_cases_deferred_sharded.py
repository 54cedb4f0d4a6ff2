"""What each rank runs in the tests of the deferred schedule on FSDP2 and FSDP2 x EP
(`test_distributed_deferred_sharded`).

Each case trains one model with Sonar under schedule="deferred" and its twin in plain torch: the same
`fully_shard` layout (`fully_shard_experts`, or `shard_fsdp2_ep` on a 2-D mesh), micro-batches
accumulated with `set_requires_gradient_sync(False)` on all but the last (the user's loop keeps those
lines, on both), `clip_grad_norm_` over every parameter (or the dense ones; FSDP2 x EP over every
parameter: torchtitan's norm, the experts as DTensors over the 2-D mesh) and `AdamW(fused=True)`.
A case reports which parameters differ (`torch.equal` of `full_tensor()`), a digest of every full
parameter (ranks must agree), each step's norm as Sonar logged it and as the twin's clip returned it,
and what the deferred schedule reports. The negative control trains the twin syncing every
micro-batch (other arithmetic): it must differ. Loops FSDP2 reduces otherwise are refused at step().
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases_deferred import record_before_step
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.compiled import repeated_blocks
from sonar_fx.distributed.deferred_sharded import sharded_experts
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.log_filters import quiet_norm_over_mesh_dims
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from helpers import CFG, batches

STEPS = 3
MAX_NORM = 0.05
"""Below every step's norm on both models: the clip is active on each step (the test checks it)."""
MODELS = {"fsdp2": "tiny-olmoe", "fsdp2_ep": "tiny-reference"}
"""FSDP2: transformers' grouped_mm experts, whose GEMMs the eager capture keeps. FSDP2 x EP replaces
the experts module with its own, whose grouped GEMM is Sonar's custom op: the eager capture leaves
its gradient whole (FSDP2 reduces it in backward: exact, nothing saved); a compiled block keeps the
operands."""


def cfg_for(clip: str) -> sonar_fx.AdamWConfig:
    return replace(CFG, max_grad_norm=MAX_NORM, expert_clip="global" if clip == "all" else None)


def data_of(rank: int, accum: int) -> list[list[dict[str, torch.Tensor]]]:
    flat = batches(STEPS * accum, seed=1 + rank)
    return [flat[s * accum : (s + 1) * accum] for s in range(STEPS)]


def accumulate(
    model: Any, micro_batches: list[dict[str, torch.Tensor]], sync: str, seen: dict | None = None
) -> None:
    """The user's loop over one step's micro-batches: gradient sync on the last only ("last"), on
    every one ("every"), or on none ("never"). `seen["unsharded_expert_grad_bytes"]`: the most bytes
    of unsharded expert gradients FSDP2 held after a backward."""
    for i, b in enumerate(micro_batches):
        model.set_requires_gradient_sync(sync == "every" or (sync == "last" and i == len(micro_batches) - 1))
        model(**b).loss.backward()
        if seen is not None:
            held = unsharded_expert_grad_bytes(model)
            seen["unsharded_expert_grad_bytes"] = max(seen.get("unsharded_expert_grad_bytes", 0), held)


def unsharded_expert_grad_bytes(model: nn.Module) -> int:
    """Bytes of the unsharded expert gradients FSDP2 holds now (accumulating unsynced micro-batches)."""
    experts = sharded_experts(model, ExpertSet.discover(model).params)
    grads = [
        g
        for e in experts.values()
        for g in (getattr(e.fsdp_param, "_unsharded_param", None), e.fsdp_param.unsharded_accumulated_grad)
        if g is not None
    ]
    grads = [g.grad if isinstance(g, nn.Parameter) else g for g in grads]
    return sum(g.numel() * g.element_size() for g in grads if g is not None)


def differ_full(a: nn.Module, b: nn.Module) -> list[str]:
    """Parameters whose full values differ (every rank gathers every parameter)."""
    theirs = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p.full_tensor(), theirs[n].full_tensor())]


def digest_full(model: nn.Module, *, dense_only: bool = False) -> str:
    """sha256 of every parameter's full value (of the dense ones: `dense_only`)."""
    experts = ExpertSet.discover(model).names_by_id()
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if dense_only and id(p) in experts:
            continue
        h.update(name.encode())
        h.update(p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def mesh_of(shape: tuple[int, int]) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep"))


# ----------------------------------------------------------------------------------------- the twins


def sonar_on(
    engine: str, dtype: torch.dtype, clip: str, compiler: str, mesh: tuple[int, int],
    model_kw: dict | None = None, **kw: Any,
) -> nn.Module:  # fmt: skip
    torch._dynamo.reset()
    model = build_model(MODELS[engine], dtype=dtype, seed=0, **(model_kw or {}))
    if engine == "fsdp2":
        return sd.fsdp2(model, cfg_for(clip), compiler=compiler, schedule="deferred", **kw)
    return sd.fsdp2_ep(model, cfg_for(clip), mesh=mesh_of(mesh), compiler=compiler, schedule="deferred", **kw)


def train_sonar(model: Any, data: list[list[dict]], clip: str, seen: dict | None = None) -> list[float]:
    """The loop; `seen` gets what the last step held before `step()` (the memory claim)."""
    opt, norms = model.sonar, []
    for micro_batches in data:
        accumulate(model, micro_batches, "last", seen)
        if seen is not None:
            record_before_step(opt, seen)
        opt.step()
        opt.zero_grad()
        logged = opt.grad_norms()
        norms.append(logged["total"] if clip == "all" else logged["dense"])
    return norms


def plain_engine(
    engine: str, dtype: torch.dtype, compiler: str, mesh: tuple[int, int], model_kw: dict | None = None
) -> nn.Module:
    """The same layout, sharded by torch alone; each block compiled where the case compiles."""
    torch._dynamo.reset()
    model = build_model(MODELS[engine], dtype=dtype, seed=0, **(model_kw or {}))
    if engine == "fsdp2":
        sd.fully_shard_experts(model)
    else:
        sd.shard_fsdp2_ep(model, mesh_of(mesh))
    if compiler != "eager":
        for _, block in repeated_blocks(model, [layer.name for layer in ExpertSet.discover(model).layers]):
            block.compile(backend=compiler)
    return model


def titan_clip_(dense: list[nn.Parameter], experts: list[nn.Parameter], mesh: Any) -> torch.Tensor:
    """torchtitan's clip on FSDP2 x EP: the expert gradients as DTensors over the 2-D mesh (Shard(0) by
    expert over "ep", FSDP2's Shard(0) over "dp"), their norm reduced by `full_tensor()`, combined
    with the dense one (FSDP2 over every rank) as squares."""
    as_2d = [DTensor.from_local(p.grad.to_local(), mesh, [Shard(0), Shard(0)]) for p in experts]
    with quiet_norm_over_mesh_dims():  # DTensor's note on a 2 x 2 mesh: one all-reduce per dimension
        ep_norm = torch.nn.utils.get_total_norm(as_2d).full_tensor()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense]).full_tensor()
    total = ep_norm**2 + dense_norm**2
    total **= 1.0 / 2
    torch.nn.utils.clip_grads_with_norm_(experts, MAX_NORM, total)
    torch.nn.utils.clip_grads_with_norm_(dense, MAX_NORM, total)
    return total


def train_plain(
    engine: str, dtype: torch.dtype, clip: str, compiler: str, data: list[list[dict]], mesh: tuple[int, int],
    sync: str = "last", seen: dict | None = None, model_kw: dict | None = None,
) -> tuple[nn.Module, list[float]]:  # fmt: skip
    """Plain FSDP2 (x EP), fused AdamW over [dense, experts] (one per mesh on FSDP2 x EP), the clip
    over `clip`; `model_kw`: the model's config overrides."""
    model = plain_engine(engine, dtype, compiler, mesh, model_kw)
    ids = ExpertSet.discover(model).names_by_id()
    dense = [p for p in model.parameters() if id(p) not in ids]
    experts = [p for p in model.parameters() if id(p) in ids]
    hyper = dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True)
    if engine == "fsdp2":
        optimizers = [torch.optim.AdamW([dict(params=dense), dict(params=experts)], **hyper)]
    else:  # dense and expert DTensors live on different meshes
        optimizers = [torch.optim.AdamW(dense, **hyper), torch.optim.AdamW(experts, **hyper)]
    norms = []
    for micro_batches in data:
        accumulate(model, micro_batches, sync, seen)
        if engine == "fsdp2_ep" and clip == "all":
            norms.append(float(titan_clip_(dense, experts, mesh_of(mesh))))
        else:
            clipped = list(model.parameters()) if clip == "all" else dense
            norms.append(float(torch.nn.utils.clip_grad_norm_(clipped, MAX_NORM)))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return model, norms


# ------------------------------------------------------------------------------------------- cases


def exact(
    rank: int, engine: str, dtype: str, clip: str, compiler: str, accum: int, mesh: tuple[int, int] = (1, 2),
    model_kw: dict | None = None,
) -> tuple[dict[str, Any], nn.Module]:  # fmt: skip
    """Sonar deferred on the engine against the plain engine with the same loop (the same model
    overrides `model_kw` on both)."""
    data = data_of(rank, accum)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = sonar_on(engine, torch_dtype, clip, compiler, mesh, model_kw)
    seen: dict[str, Any] = {}
    norms = train_sonar(model, data, clip, seen)
    report = model.sonar.report()
    twin_seen: dict[str, Any] = {}
    twin, twin_norms = train_plain(
        engine, torch_dtype, clip, compiler, data, mesh, seen=twin_seen, model_kw=model_kw
    )
    return {
        "differ": differ_full(model, twin),
        "digest": digest_full(model),
        "dense_digest": digest_full(model, dense_only=True),
        "norms": norms,
        "twin_norms": twin_norms,
        "updates_deferred": report["updates_deferred"],
        "updates_kept_whole": report["updates_kept_whole"],
        "kept_whole": report["deferred"]["kept_whole"],
        "kept_operand_peak": report["deferred"]["kept_operand_peak"],
        "crossed_over": report["deferred"]["crossed_over"],
        "sliced": report["deferred"]["sliced"],
        "graphs": report["graphs_compiled"] + report["graphs_from_cache"],
        "fallbacks": report["fallbacks"],
        "twin_unsharded_expert_grad_bytes": twin_seen["unsharded_expert_grad_bytes"],
        "experts_per_tensor": sorted({p.shape[0] for p in model.sonar.expert_group["params"]}),
        **seen,
    }, model


def refused_loop(rank: int, sync: str) -> dict[str, Any]:
    """A step FSDP2 reduced otherwise than once at its last micro-batch: refused at step(), nothing
    moved. Then, as each message says: syncing every micro-batch, zero_grad() drops the step and the
    right loop trains as plain FSDP2 does; syncing none, a last synced micro-batch and step() again
    complete the step as plain FSDP2 completes it (FSDP2 keeps its unsynced gradients either way)."""
    model = sonar_on("fsdp2", torch.float32, "all", "eager", (1, 2))
    first, last = batches(3, seed=100 + rank)[:2], batches(3, seed=100 + rank)[2:]
    accumulate(model, first, sync)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    message = None
    try:
        model.sonar.step()
    except sonar_fx.SonarUsageError as err:
        message = str(err)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    if sync == "every":
        model.sonar.zero_grad()
        data = data_of(rank, 2)[:1]
        train_sonar(model, data, "all")
    else:
        accumulate(model, last, "last")
        model.sonar.step()
        model.sonar.zero_grad()
        data = [first + last]
    twin, _ = train_plain("fsdp2", torch.float32, "all", "eager", data, (1, 2))
    return {"message": message, "moved": moved, "then": differ_full(model, twin)}


def inf_on_one_rank(rank: int) -> dict[str, Any]:
    """nonfinite="skip": in step 2 only rank 1's loss is non-finite. FSDP2's reduce-scatter spreads it,
    so every rank skips that step whole (no weight moves on any rank), as plain FSDP2 skipping a step
    whose clip_grad_norm_ is not finite; the other steps train bitwise alike."""
    data, poisoned = data_of(rank, 2), (1, 1)  # (step, rank)

    def run(model: Any, step_fn: Any) -> list[str]:
        moved: list[str] = []
        for step, micro_batches in enumerate(data):
            before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            for i, b in enumerate(micro_batches):
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
                loss = model(**b).loss
                (loss * float("inf") if (step, rank) == poisoned else loss).backward()
            step_fn()
            if step == poisoned[0]:
                moved = [
                    n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])
                ]
        return moved

    model = sonar_on("fsdp2", torch.float32, "all", "eager", (1, 2), nonfinite="skip")
    moved = run(model, lambda: (model.sonar.step(), model.sonar.zero_grad()))
    twin = plain_engine("fsdp2", torch.float32, "eager", (1, 2))
    hyper = dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True)
    twin_opt = torch.optim.AdamW(list(twin.parameters()), **hyper)

    def twin_step() -> None:
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(list(twin.parameters()), MAX_NORM)):
            twin_opt.step()
        twin_opt.zero_grad()

    run(twin, twin_step)
    return {
        "differ": differ_full(model, twin),
        "moved_in_skipped": moved,
        "skipped_steps": model.sonar.report()["skipped_steps"],
    }


def shard_verdicts(rank: int) -> dict[str, Any]:
    """The non-finite flag of an FSDP2 shard's gradient (a Shard(0) DTensor over 2 ranks), given the
    whole tensor's norm as `ExpertClipper.norm_of` records it: an inf in rank 1's shard only, a NaN in
    rank 0's only, and finite values, per dtype (float16: a finite shard whose whole norm, reduced as
    a sum of squares in float16, overflows). Each: the flag, the collectives the flag itself ran, and
    the shard's own local verdict (the rank-local answer the whole tensor's must not be)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from sonar_fx.optim.adamw import nonfinite_flag
    from sonar_fx.optim.nonfinite import NonFinitePolicy
    from sonar_fx.optim.norms import plain, tensor_norm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = {"inf_in_rank_1": (1, float("inf")), "nan_in_rank_0": (0, float("nan")), "finite": (None, 0.0)}
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case, (where, value) in cases.items():
            local = torch.full((2, 3), 0.5, dtype=dtype)
            if where == rank:
                local[1, 2] = value
            if case == "finite" and dtype == torch.float16:
                local.fill_(200.0)  # whole norm ~693 > 256: its square overflows float16 in the reduction
            grad = DTensor.from_local(local, mesh, [Shard(0)])
            norm = plain(tensor_norm(grad))
            with CommDebugMode() as comms:
                flag = NonFinitePolicy("raise").flag("w", grad, norm)
            assert flag is not None
            value_of = flag.full_tensor() if isinstance(flag, DTensor) else flag
            out[f"{case}/{str(dtype).removeprefix('torch.')}"] = {
                "flag": float(value_of),
                "collectives": comms.get_total_counts(),
                "local": float(nonfinite_flag(local)),
                "norm_finite": bool(torch.isfinite(norm)),
            }
    return out


EXACT = [
    ("fsdp2", "fp32", "all", "eager", 4),
    ("fsdp2", "bf16", "dense", "eager", 2),
    ("fsdp2_ep", "fp32", "all", "eager", 4, (1, 2)),
    ("fsdp2_ep", "bf16", "all", "aot_eager", 4, (2, 1)),
    ("fsdp2_ep", "bf16", "dense", "aot_eager", 2, (1, 2)),
]
"""(engine, dtype, clip, compiler, micro-batches per step[, 2-D mesh]): each engine eager with the clip
over all parameters, FSDP2 x EP compiled too, and the dense-only clip. Compiled cases run bf16
(transformers' compiled fp32 grouped_mm path is a known library failure). FSDP2 x EP on 2 ranks:
(1, 2) exchanges tokens across ranks (dp of one), (2, 1) reduce-scatters the experts across ranks
(ep of one)."""
ONE_EXPERT_PER_RANK = ("fsdp2_ep", "fp32", "all", "eager", 4, (1, 2))
"""FSDP2 x EP with as many experts as the ep size (`ONE_EXPERT_PER_RANK_MODEL`: 2 over ep 2): each
rank's expert tensors are (1, out, in), every token's top-2 reaches both ranks."""
ONE_EXPERT_PER_RANK_MODEL = {"num_experts": 2}
COMPILED = ("fsdp2", "bf16", "all", "aot_eager", 2)
"""FSDP2 with each block of transformers' OLMoE compiled: ~45 s per model on 2 shared cores, so its
own spawn (marked slow)."""


def label(
    engine: str, dtype: str, clip: str, compiler: str, accum: int, mesh: tuple[int, int] = (1, 2)
) -> str:
    grid = f"/{mesh[0]}x{mesh[1]}" if engine == "fsdp2_ep" else ""
    return f"{engine}/{dtype}/{clip}/{compiler}/{accum}{grid}"


def deferred_sharded(rank: int) -> dict[str, Any]:
    """Every 2-rank case, in one spawn (the GradScaler's from `distributed_cases_deferred_sharded_scaler`).
    With 4 micro-batches the tiny models' expert tensors cross over (their operands outgrow the
    gradient), and the eager FSDP2 x EP experts are kept whole: the saving is lost by design there, so
    the guard warns (its refusal has its own tests)."""
    from distributed_cases_deferred_sharded_scaler import grad_scaler_cases  # it imports this module

    os.environ[ON_SAVING_LOST_ENV] = "warn"
    out: dict[str, Any] = {}
    for case in EXACT:
        out[label(*case)], model = exact(rank, *case)
        if case == EXACT[0]:  # negative control: the twin syncing every micro-batch
            twin, _ = train_plain(
                "fsdp2", torch.float32, "all", "eager", data_of(rank, 4), (1, 2), sync="every"
            )
            out["control/sync_every"] = differ_full(model, twin)
    out["fsdp2_ep/one_expert_per_rank"] = exact(rank, *ONE_EXPERT_PER_RANK, ONE_EXPERT_PER_RANK_MODEL)[0]
    out["inf_on_one_rank"] = inf_on_one_rank(rank)
    out["shard_verdicts"] = shard_verdicts(rank)
    out.update(grad_scaler_cases(rank))
    out["refused/every"] = refused_loop(rank, "every")
    out["refused/never"] = refused_loop(rank, "never")
    out["world"] = dist.get_world_size()
    return out


def deferred_sharded_compiled(rank: int) -> dict[str, Any]:
    """FSDP2 with its blocks compiled (aot_eager), alone in its spawn (marked slow)."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    return {label(*COMPILED): exact(rank, *COMPILED)[0]}


FOUR_RANKS = ("fsdp2", "fp32", "all", "eager", 4)
FOUR_RANKS_2D = ("fsdp2_ep", "fp32", "all", "eager", 4, (2, 2))
"""FSDP2 x EP on a 2 x 2 mesh: tokens exchanged within each "ep" row, each expert reduce-scattered
over its "dp" column; torchtitan's norm over both mesh dimensions."""


def deferred_sharded_four(rank: int) -> dict[str, Any]:
    """The 4-rank cases (one spawn, marked slow): FSDP2 and FSDP2 x EP on a 2 x 2 mesh, fp32, the clip
    over all parameters, 4 micro-batches."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    return {label(*case): exact(rank, *case)[0] for case in (FOUR_RANKS, FOUR_RANKS_2D)}


INDUCTOR = ("fsdp2", "bf16", "all", "inductor", 4)
"""FSDP2 with each block compiled by inductor (bf16: transformers' compiled fp32 grouped_mm path is a
known library failure), 4 micro-batches, the clip over every parameter; its own spawn (marked slow)."""


def deferred_sharded_inductor(rank: int) -> dict[str, Any]:
    """The inductor case alone, with deterministic kernels on both sides (inductor's CPU embedding
    backward accumulates in parallel otherwise)."""
    os.environ[ON_SAVING_LOST_ENV] = "warn"
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return {label(*INDUCTOR): exact(rank, *INDUCTOR)[0]}
    finally:
        torch.use_deterministic_algorithms(deterministic)
