"""What each rank runs in the `--parallel` command-line tests: `sonar_fx.cli.main` on every rank, as
torchrun would run it (RANK / WORLD_SIZE set; the process group already exists), several runs in one
spawn so the processes start once."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sonar_fx.cli import main

ARGS = ["--model", "tiny-reference", "--compiler", "eager", "--train-size", "16", "--held-out", "4",
        "--steps", "4", "--save-every", "2", "--no-progress", "--lr", "1e-2"]  # fmt: skip


def _folder() -> Path:
    """One fresh folder, the same on every rank."""
    name = [tempfile.mkdtemp(prefix="sonar-cli-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(str(name[0]))


def _finetune(out: Path, *extra: str) -> int:
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    return main(["finetune", *ARGS, "--out", str(out), *extra])


def _weights(out: Path, rank: int, sharded: bool) -> dict[str, torch.Tensor]:
    name = "checkpoint.pt" if rank == 0 or not sharded else f"checkpoint.rank{rank}.pt"
    return torch.load(out / name, weights_only=True)["model"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


CLIPS = {
    "ddp": [],
    "fsdp2": ["--expert-clip", "per_tensor", "--max-grad-norm", "0.05"],
    "ep": ["--expert-clip", "global", "--max-grad-norm", "0.05"],
    "fsdp2_ep": ["--max-grad-norm", "0.05"],
}
"""Each engine also runs an expert clip mode: its twin is the baseline that clips the same way (FSDP2 x
EP: the dense-only clip, active on every step; its clip over all is test_distributed_trainer_deferred's)."""


def resume_is_exact(rank: int) -> dict[str, Any]:
    """Per engine: 4 steps straight vs 2 steps (--stop-after) then --resume; bitwise equal weights; and
    Sonar equals the baseline that clips as it does, built on the same engine, through the whole trainer."""
    root = _folder()
    seen: dict[str, Any] = {}
    for engine, clip in CLIPS.items():
        sharded = engine != "ddp"
        straight, resumed = root / f"{engine}-straight", root / f"{engine}-resumed"
        codes = [
            _finetune(straight, "--parallel", engine, *clip),
            _finetune(resumed, "--parallel", engine, *clip, "--stop-after", "2"),
        ]
        at_2 = _weights(resumed, rank, sharded)
        codes.append(_finetune(resumed, "--parallel", engine, *clip, "--resume"))
        final = _weights(resumed, rank, sharded)
        seen[engine] = {
            "codes": codes,
            "differ": _same(_weights(straight, rank, sharded), final),
            "moved_after_resume": bool(_same(at_2, final)),
            "files": sorted(p.name for p in straight.iterdir() if not p.name.startswith(".")),
        }
        baseline = root / f"{engine}-baseline"
        twin = "standard" if "global" in clip else "standard_no_expert_clip"
        seen[engine]["baseline_code"] = _finetune(baseline, "--parallel", engine, *clip, "--method", twin)
        seen[engine]["vs_baseline"] = _same(
            _weights(straight, rank, sharded), _weights(baseline, rank, sharded)
        )
    return seen
