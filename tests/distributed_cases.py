"""What each rank runs in the distributed tests (see `distributed_worker.run`); results are JSON.

Every case trains the same model with the engine's standard recipe (fused AdamW, clipping only the
dense gradients) and with Sonar on that engine, on each rank's own batches, and reports which tensors
differ (`torch.equal` on this rank's tensors) and a digest of every tensor, so the test can check
that ranks agree. Ablations that must train wrong (negative controls) are built here from the same
parts: a reduction that updates from the local gradient.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.models import build_model

from helpers import CFG, batches

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = 3


# ------------------------------------------------------------------------------------------ helpers


def local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model: nn.Module, *, dense_only: bool = False) -> str:
    """sha256 of every parameter's full value (FSDP2 shards are gathered: every rank calls it)."""
    experts = _expert_ids(model)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if dense_only and id(p) in experts:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def differ(a: nn.Module, b: nn.Module) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(local(p), local(pb[n]))]


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    pb = dict(b.named_parameters())
    return max(float((local(p).float() - local(pb[n]).float()).abs().max()) for n, p in a.named_parameters())


def _expert_ids(model: nn.Module) -> set[int]:
    return {id(t.param) for layer in discover_experts(model) for t in layer.tensors}


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True
    )


def train_standard(
    run: Callable[..., Any], model: nn.Module, rank: int, *, expert_scale: float = 1.0
) -> None:
    """The engine's standard recipe: backward, (expert grads scaled), dense-only clip, fused AdamW."""
    experts = _expert_ids(model)
    dense = [p for p in model.parameters() if id(p) not in experts]
    opt = adamw(model)
    for b in batches(STEPS, seed=1 + rank):
        run(**b).loss.backward()
        if expert_scale != 1.0:
            for p in model.parameters():
                if id(p) in experts:
                    p.grad.mul_(expert_scale)
        torch.nn.utils.clip_grad_norm_(dense, CFG.max_grad_norm)
        opt.step()
        opt.zero_grad()


def train_sonar(
    run: Callable[..., Any], optimizer: sonar_fx.SonarOptimizer, rank: int, steps: int = STEPS
) -> None:
    for b in batches(STEPS, seed=1 + rank)[:steps]:
        run(**b).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def outcome(model: nn.Module, twin: nn.Module, optimizer: sonar_fx.SonarOptimizer) -> dict[str, Any]:
    report = optimizer.report()
    return {
        "differ": differ(model, twin),
        "moved": bool(differ(model, build_model(_name(model), dtype=next(model.parameters()).dtype, seed=0))),
        "digest": digest(model),
        "twin_digest": digest(twin),
        "in_graph": report["updates_in_graph"],
        "by_hook": report["updates_by_hook"],
        "graphs": report["graphs_compiled"],
        "fallbacks": report["fallbacks"],
    }


def _name(model: nn.Module) -> str:
    return "tiny-reference" if type(model).__name__ == "ReferenceMoEModel" else "tiny-olmoe"


@dataclass
class LocalOnly:
    """Ablation: update from this rank's local gradient (what plain hooks or a pass without the
    all-reduce would do under data parallelism)."""

    in_graph: Literal["update", "all_reduce", "hooks"] = "update"
    name: str = "local-only"
    group_name: str | None = None
    world_size: int = 1

    def reduce_then_update(self, name, grad, *, path, reduced, update) -> None:
        update(grad)

    def any_rank(self, local: bool) -> bool:
        return local


# ---------------------------------------------------------------------------------------------- DDP


def ddp_standard(
    rank: int, dtype: torch.dtype, compiler: str = "eager", model_name: str = "tiny-olmoe", **ddp_kwargs: Any
) -> nn.Module:
    model = build_model(model_name, dtype=dtype, seed=0)
    wrapped = DDP(model, **ddp_kwargs)
    train_standard(torch.compile(wrapped, backend=compiler) if compiler != "eager" else wrapped, model, rank)
    return model


def ddp_sonar(
    rank: int, dtype: torch.dtype, model_name: str = "tiny-olmoe", **kwargs: Any
) -> tuple[nn.Module, sonar_fx.SonarOptimizer]:
    model = build_model(model_name, dtype=dtype, seed=0)
    wrapped = sd.ddp(model, CFG, **kwargs)
    train_sonar(wrapped, wrapped.sonar, rank)
    return model, wrapped.sonar


def ddp_eager(rank: int) -> dict[str, Any]:
    """DDP eager, sync and async, fp32 and bf16; plain hooks on a DDP model as the negative control."""
    out: dict[str, Any] = {}
    for key, dtype in DTYPES.items():
        twin = ddp_standard(rank, dtype)
        for mode in ("sync", "async"):
            model, opt = ddp_sonar(rank, dtype, async_reduce=mode == "async")
            out[f"{mode}/{key}"] = outcome(model, twin, opt) | {"reduced_here": opt.distributed.reduced_here}
    # Negative control: experts left in DDP, hooks that update from what they see (the local gradient).
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    opt = sonar_fx.prepare(model, CFG, distributed=LocalOnly())
    train_sonar(DDP(model), opt, rank)
    out["plain_hooks"] = outcome(model, ddp_standard(rank, torch.bfloat16), opt)
    return out


SPLIT_BYTES = 8 * 1024
"""DDP bucket size that makes DDP's optimizer split tiny-reference's graph into a few subgraphs."""


def _ddp_compiled(rank: int, compiler: str, runs: list[tuple[str, str, str, bool]]) -> dict[str, Any]:
    """(label, model, dtype key, split by DDP's optimizer) per run; splits use small buckets."""
    out: dict[str, Any] = {}
    counters = torch._dynamo.utils.counters
    for label, name, key, split in runs:
        ddp_kwargs = {"bucket_cap_mb": SPLIT_BYTES / 2**20} if split else {}
        with torch._dynamo.config.patch(optimize_ddp=split), _first_bucket(SPLIT_BYTES if split else None):
            torch._dynamo.reset()
            twin = ddp_standard(rank, DTYPES[key], compiler, name, **ddp_kwargs)
            torch._dynamo.reset()
            counters.clear()
            # Graph caches off for Sonar: a cached graph skips the pass, and the pass's counters are
            # what this checks (the twin, plain DDP, may come from the cache). Compiled kernels stay
            # cached, so the second rank loads what the first compiled.
            with (
                torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False),
            ):
                model, opt = ddp_sonar(rank, DTYPES[key], name, compiler=compiler, ddp_kwargs=ddp_kwargs)
        out[label] = outcome(model, twin, opt) | {
            "all_reduces": counters["sonar"]["all_reduces"],
            "reduced_here": opt.distributed.reduced_here,
        }
    return out


class _first_bucket:
    """DDP's optimizer needs its first bucket no larger than the others: shrink it for small models."""

    def __init__(self, nbytes: int | None) -> None:
        self.nbytes = nbytes

    def __enter__(self) -> None:
        self.saved = dist._DEFAULT_FIRST_BUCKET_BYTES
        if self.nbytes is not None:
            dist._DEFAULT_FIRST_BUCKET_BYTES = self.nbytes

    def __exit__(self, *exc: object) -> None:
        dist._DEFAULT_FIRST_BUCKET_BYTES = self.saved


def ddp_aot_eager(rank: int) -> dict[str, Any]:
    runs = [("one_graph/fp32", "tiny-olmoe", "fp32", False), ("split/bf16", "tiny-reference", "bf16", True)]
    out = _ddp_compiled(rank, "aot_eager", runs)
    # Negative control: the pass without the all-reduce (the graph updates from local gradients).
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0)
    compiled = sonar_fx.compile(model, CFG, compiler="aot_eager", distributed=LocalOnly())
    DDP._set_params_and_buffers_to_ignore_for_model(model, sd.expert_names(compiled.sonar))
    sd.broadcast_experts_(compiled.sonar, dist.group.WORLD)
    with torch._dynamo.config.patch(optimize_ddp=False):
        train_sonar(DDP(model), compiled.sonar, rank)
        torch._dynamo.reset()
        twin = ddp_standard(rank, torch.bfloat16, "aot_eager", "tiny-reference")
        out["no_all_reduce"] = outcome(model, twin, compiled.sonar)
        out["pass_fails"] = _pass_fails(rank, twin)
    return out


def _pass_fails(rank: int, twin: nn.Module) -> dict[str, Any]:
    """A compiler failure in a DDP graph: it runs eagerly and the all-reducing hooks update, exactly."""
    from unittest import mock

    from sonar_fx import compiled
    from sonar_fx.backend import make_sonar_backend

    from ablations import failing_pass

    def fails_with_reduce(bw_gm, example_inputs=None, *, fw_gm, expert_inputs, reduce):
        return failing_pass(bw_gm, example_inputs, fw_gm=fw_gm, expert_inputs=expert_inputs)

    torch._dynamo.reset()
    failing = make_sonar_backend("aot_eager", bw_pass=fails_with_reduce)
    with warnings.catch_warnings(), mock.patch.object(compiled, "sonar_backend", lambda *a, **k: failing):
        warnings.simplefilter("ignore")
        model, opt = ddp_sonar(rank, torch.bfloat16, "tiny-reference", compiler="aot_eager")
    return {**outcome(model, twin, opt), "reduced_here": opt.distributed.reduced_here}


def ddp_inductor_split(rank: int) -> dict[str, Any]:
    """DDP's optimizer subgraphs under inductor, bf16, on the reference model: its graphs compile in a
    fraction of a transformers model's time and hold the same expert layout."""
    torch.use_deterministic_algorithms(True)
    return _ddp_compiled(rank, "inductor", [("split/bf16", "tiny-reference", "bf16", True)])


def ddp_world4(rank: int) -> dict[str, Any]:
    """World size 4: per-tensor all-reduce vs DDP's bucketed one round differently in the last bits."""
    twin = ddp_standard(rank, torch.float32, model_name="tiny-reference")
    model, opt = ddp_sonar(rank, torch.float32, "tiny-reference")
    return outcome(model, twin, opt) | {"max_abs_diff": max_abs_diff(model, twin)}


def ep_nonfinite(rank: int) -> dict[str, Any]:
    """One rank's expert gradient is inf: every rank raises (none hangs), then both abandon the step."""
    model = build_model("tiny-reference", seed=0)
    wrapped = sd.expert_parallel(model, CFG)
    if rank == 1:
        model.layers[0].mlp.experts.down_proj.register_hook(lambda g: g * float("inf"))
    seen: dict[str, Any] = {}
    try:
        wrapped(**batches(1, seed=1 + rank)[0]).loss.backward()
    except sonar_fx.NonFiniteGradientError as err:
        seen["raised"] = str(err)
    seen["abandoned"] = wrapped.sonar.abandon_step()
    return seen


def mixed_up_graphs(rank: int) -> dict[str, Any]:
    """A graph compiled with the all-reduce, then reused by a model with no distributed setup (the
    reference model: the refusal does not depend on the architecture, and it traces fastest)."""
    seen: dict[str, Any] = {}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp=False):
        wrapped = sd.ddp(build_model("tiny-reference", seed=0), CFG, compiler="aot_eager")
        train_sonar(wrapped, wrapped.sonar, rank, steps=1)
        plain = sonar_fx.compile(build_model("tiny-reference", seed=0), CFG, compiler="aot_eager")
        try:
            plain(**batches(1, seed=1 + rank)[0]).loss.backward()
        except sonar_fx.SonarUsageError as err:
            seen["plain_reusing_ddp_graph"] = str(err)
    return seen


def memory_rows(rank: int) -> list[dict[str, Any]]:
    """The memory table of `benchmarks.distributed` (quick config) as this rank counts it."""
    from dataclasses import asdict

    from benchmarks.distributed import QUICK, measure

    return [asdict(row) | {"all_grad_bytes": _all_grad_bytes()} for row in measure(QUICK)]


def _all_grad_bytes() -> int:
    model = build_model("tiny-olmoe", seed=0)
    return sum(p.numel() * p.element_size() for p in model.parameters())
