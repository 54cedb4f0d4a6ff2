"""What each rank runs in `test_distributed_trainer_deferred`: the command line's accumulation on the
engines, `sonar_fx.cli.main` on every rank as torchrun would run it (see `distributed_cases_cli`), and
`TrainingMethod.train_step` against the plain engine's loop written here.

`--grad-accum 2 --clip-scope all` trains sonar as `sonar_deferred`; its twin is `--method standard`
with the same flags. Both run every micro-batch but the last under the engine's `no_sync()`: the
run's saved weights must be `torch.equal`, on every rank. The clip is active on every step
(`--max-grad-norm 0.05`, below each step's norm: the metrics show it). FSDP2 x EP runs on its default
mesh, 1 x 2 (each rank half the experts), with torchtitan's clip."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from distributed_cases_cli import _finetune, _folder, _same, _weights
from distributed_cases_deferred_sharded import MAX_NORM, mesh_of, titan_clip_
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from sonar_fx.config import MuonConfig
from sonar_fx.distributed import fully_shard_experts, shard_fsdp2_ep
from sonar_fx.engines import ENGINES
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from helpers import CFG, batches

ACCUM = ["--grad-accum", "2", "--clip-scope", "all", "--max-grad-norm", "0.05", "--steps", "3",
         "--held-out", "0", "--save-every", "0", "--model", "tiny-olmoe"]  # fmt: skip
ENGINES_RUN = ("ddp", "ep", "fsdp2", "fsdp2_ep")


def _metrics(out: Path, key: str) -> list[Any]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [line.get(key) for line in lines]


def cli_accumulation_is_exact(rank: int) -> dict[str, Any]:
    """Per engine: sonar (deferred, by the flags) vs --method standard, same flags: codes, the tensors
    that differ, the resolved method, the logged norms (each above the clip) and operand peaks."""
    root = _folder()
    seen: dict[str, Any] = {}
    for engine in ENGINES_RUN:
        sonar, standard = root / f"{engine}-sonar", root / f"{engine}-standard"
        sharded = engine != "ddp"  # ddp: rank 0's file holds the replicated weights
        codes = [
            _finetune(sonar, "--parallel", engine, *ACCUM),
            _finetune(standard, "--parallel", engine, *ACCUM, "--method", "standard"),
        ]
        if codes != [0, 0]:
            seen[engine] = {"codes": codes}
            continue
        summary = json.loads((sonar / "summary.json").read_text()) if rank == 0 else None
        seen[engine] = {
            "codes": codes,
            "differ": _same(_weights(sonar, rank, sharded), _weights(standard, rank, sharded)),
            "method": summary["config"]["method"] if summary else None,
            "norms": _metrics(sonar, "grad_norm_total") if rank == 0 else None,
            "kept_operand_peaks": _metrics(sonar, "kept_operand_peak_bytes") if rank == 0 else None,
        }
    return seen


def uneven_experts_refused(rank: int) -> dict[str, Any]:
    """--parallel fsdp2_ep on its default 1 x 2 mesh, and --parallel ep over 2 ranks, with 3 experts per
    layer: refused as the model is laid out, before any step: exit 2 naming --ep-size (fsdp2_ep) or
    --parallel (ep), no checkpoint written."""
    seen = {}
    for engine in ("fsdp2_ep", "ep"):
        out = _folder() / f"uneven-{engine}"
        err = io.StringIO()
        with redirect_stderr(err):
            code = _finetune(out, "--parallel", engine, *ACCUM, "--model-override", "num_experts=3")
        checkpoints = sorted(p.name for p in out.glob("*.pt"))
        seen[engine] = {"code": code, "err": err.getvalue(), "checkpoints": checkpoints}
    return seen


def train_step_syncs_the_last_micro_batch(rank: int) -> dict[str, Any]:
    """`build_method("standard")` on DDP, FSDP2 and FSDP2 x EP (its default 1 x 2 mesh), two steps of 2
    micro-batches, against the plain engine over every parameter written here, accumulating with
    gradient sync off on the first micro-batch (equal) and on none (must differ)."""
    cfg = replace(CFG, max_grad_norm=MAX_NORM)  # below each step's norm: the clip acts on every step
    data = batches(4, seed=1 + rank)
    steps = [data[0:2], data[2:4]]
    seen: dict[str, Any] = {}
    for engine in ("ddp", "fsdp2", "fsdp2_ep"):
        method = build_method("standard", build_model("tiny-olmoe", seed=0), cfg, engine=ENGINES[engine])
        for micro in steps:
            method.train_step(micro)
        inner = method.model.module if engine == "ddp" else method.model
        got = {n: _full(p) for n, p in inner.named_parameters()}
        seen[engine] = {"count": len(got)}
        for sync in ("last", "every"):
            model = _plain_train(engine, cfg, steps, sync)
            seen[engine][sync] = [n for n, p in model.named_parameters() if not torch.equal(_full(p), got[n])]
    return seen


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _plain_train(engine: str, cfg: Any, steps: list[list[dict]], sync: str) -> torch.nn.Module:
    """Plain DDP, FSDP2 (the experts modules their own groups, as the baseline shards them) or FSDP2 x EP
    on a 1 x 2 mesh (torchtitan's clip, one fused AdamW per mesh), with torch's clip over every parameter
    and fused AdamW: the user's accumulation loop."""
    model = build_model("tiny-olmoe", seed=0)
    if engine == "ddp":
        run = DDP(model)
        quiet_context: Any = run.no_sync
    elif engine == "fsdp2":
        run = fully_shard_experts(model)
        quiet_context = lambda: _fsdp2_quiet(run)  # noqa: E731
    else:
        run = shard_fsdp2_ep(model, mesh_of((1, 2)))
        quiet_context = lambda: _fsdp2_quiet(run)  # noqa: E731
    expert_ids = ExpertSet.discover(model).names_by_id() if engine == "fsdp2_ep" else {}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
    optimizers = [torch.optim.AdamW(group, **hyper) for group in (dense, experts) if group]
    for micro in steps:
        for i, b in enumerate(micro):
            quiet = sync == "last" and i < len(micro) - 1
            with quiet_context() if quiet else nullcontext():
                (run(**b).loss / len(micro)).backward()
        if engine == "fsdp2_ep":
            titan_clip_(dense, experts, mesh_of((1, 2)))
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


@contextmanager
def _fsdp2_quiet(root: Any) -> Iterator[None]:
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def every_case(rank: int) -> dict[str, Any]:
    """The cases of `test_distributed_trainer_deferred`, in one spawn (the processes start once). Expert
    parallelism's own experts module is kept whole by the eager capture, and on the tiny model a step's
    operands outgrow its expert tensors (the crossover): the saving is lost by design here, so the
    saving guard warns instead of refusing (the suite's "raise"). The saving on the engines is
    tested by test_distributed_deferred; these cases test the arithmetic of the entry points."""
    from distributed_cases_hf import sonar_trainer_equals_the_plain_trainer

    os.environ[ON_SAVING_LOST_ENV] = "warn"

    return {
        "train_step": train_step_syncs_the_last_micro_batch(rank),
        "cli": cli_accumulation_is_exact(rank),
        "uneven_experts": uneven_experts_refused(rank),
        "hf": sonar_trainer_equals_the_plain_trainer(rank),
        "routes": deferred_by_other_routes(rank),
    }


def deferred_by_other_routes(rank: int) -> dict[str, Any]:
    """The deferred schedule reached around the engines' setup, refused before any weight moves:
    `prepare` of a model already sharded by `fully_shard` (naming `sonar_fx.distributed.fsdp2`, or the
    one rule's reason where it refuses the config there: Muon), and a model prepared for one process
    then wrapped in DDP by hand (refused at step())."""
    import sonar_fx
    from sonar_fx.errors import SonarUsageError

    cfg = replace(CFG, max_grad_norm=0.05, expert_clip="global")
    seen: dict[str, Any] = {}
    for name, config in (("fsdp2_prepare", cfg), ("fsdp2_prepare_muon", MuonConfig(lr=1e-2))):
        model = fully_shard(build_model("tiny-olmoe", seed=0))
        try:
            sonar_fx.prepare(model, config, schedule="deferred")
            seen[name] = None
        except SonarUsageError as exc:
            seen[name] = str(exc)
    model = build_model("tiny-olmoe", seed=0)
    sonar_fx.prepare(model, cfg, schedule="deferred")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = DDP(model)
    for b in batches(2, seed=1 + rank):
        run(**b).loss.backward()
    try:
        model.sonar.step()
        seen["ddp_after_prepare"] = None
    except SonarUsageError as exc:
        seen["ddp_after_prepare"] = str(exc)
    seen["moved"] = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    return seen
