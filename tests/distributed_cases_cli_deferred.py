"""What each rank runs in `test_distributed_trainer_deferred`: the command line's accumulation on the
engines, `sonar_fx.cli.main` on every rank as torchrun would run it (see `distributed_cases_cli`), and
`TrainingMethod.train_step` against the plain engine's loop written here.

`--grad-accum 2 --clip-scope all` trains sonar as `sonar_deferred`; its twin is `--method standard`
with the same flags. Both run every micro-batch but the last under the engine's `no_sync()`: the
run's saved weights must be `torch.equal`, on every rank. The clip is active on every step
(`--max-grad-norm 0.05`, below each step's norm: the metrics show it)."""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from distributed_cases_cli import _finetune, _folder, _same, _weights
from torch.nn.parallel import DistributedDataParallel as DDP

from sonar_fx.engines import ENGINES
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from helpers import CFG, batches

ACCUM = ["--grad-accum", "2", "--clip-scope", "all", "--max-grad-norm", "0.05", "--steps", "3",
         "--held-out", "0", "--save-every", "0", "--model", "tiny-olmoe"]  # fmt: skip
ENGINES_RUN = ("ddp", "ep")


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


def train_step_syncs_the_last_micro_batch(rank: int) -> dict[str, Any]:
    """`build_method("standard")` on DDP, two steps of 2 micro-batches, against plain DDP over every
    parameter accumulating under `no_sync()` on the first (equal), and syncing both (must differ)."""
    cfg = replace(CFG, max_grad_norm=0.05)  # below each step's norm: the clip acts on every step
    data = batches(4, seed=1 + rank)
    steps = [data[0:2], data[2:4]]
    method = build_method("standard", build_model("tiny-olmoe", seed=0), cfg, engine=ENGINES["ddp"])
    for micro in steps:
        method.train_step(micro)
    got = dict(method.model.module.named_parameters())
    seen: dict[str, Any] = {}
    for sync in ("last", "every"):
        model = build_model("tiny-olmoe", seed=0)
        run = DDP(model)
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            fused=True,
        )  # fmt: skip
        for micro in steps:
            for i, b in enumerate(micro):
                quiet = sync == "last" and i < len(micro) - 1
                with run.no_sync() if quiet else nullcontext():
                    (run(**b).loss / len(micro)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen[sync] = [n for n, p in model.named_parameters() if not torch.equal(p, got[n])]
    seen["count"] = len(got)
    return seen


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
        "hf": sonar_trainer_equals_the_plain_trainer(rank),
    }
