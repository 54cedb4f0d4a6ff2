"""Training checkpoints: written atomically, read back only into the run that wrote them.

For: saving everything a fine-tuning run needs to continue bitwise (model weights, the state of
every optimizer - `SonarOptimizer` expert and dense groups, or torch AdamW -, LR schedulers, the step,
the data stream position and the RNG states), and refusing to resume a checkpoint written by another
model or configuration, naming what differs.
Never: leave a half-written checkpoint under the final name (temp file, fsync, then `os.replace`),
unpickle arbitrary objects (`torch.load(weights_only=True)`), or load a state that does not match
tensor for tensor.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = 1
FILENAME = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed; the message names the file, what differs and the fix."""


def resolve_path(spec: str | Path) -> Path:
    """A checkpoint file, or a run folder holding `checkpoint.pt`."""
    path = Path(spec)
    return path / FILENAME if path.is_dir() else path


def save_checkpoint(
    path: Path,
    *,
    identity: Mapping[str, Any],
    step: int,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
    stream_state: Mapping[str, int],
) -> None:
    """Write the full training state at a step boundary to `path`, atomically."""
    payload = {
        "format": FORMAT,
        "identity": dict(identity),
        "step": step,
        "model": model.state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "stream": dict(stream_state),
        "rng": rng_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a mix
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (tensors land on the CPU)."""
    if not path.is_file():
        raise CheckpointError(
            f"--resume {path}: no such checkpoint; pass a {FILENAME} file or the --out folder of the run"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # re-raised with the path and the fix; the cause stays chained
        raise CheckpointError(
            f"--resume {path}: not a readable sonar-fx checkpoint ({type(exc).__name__}: {exc}); it may be "
            "truncated or from another program: resume from another checkpoint or start a fresh --out"
        ) from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"--resume {path}: not a sonar-fx checkpoint of format {FORMAT}; start a fresh --out instead"
        )
    return ckpt


def check_identity(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose run identity (model, method, data, hyper-parameters) differs."""
    keys = sorted(set(saved) | set(current))
    diffs = [
        f"{_flag(k)}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in keys
        if _normal(saved.get(k)) != _normal(current.get(k))
    ]
    if diffs:
        raise CheckpointError(
            f"--resume {path}: the checkpoint is from another model or config, so training would not "
            "continue the same run:\n  " + "\n  ".join(diffs) + "\nRerun with the checkpoint's settings, "
            "or start a fresh run in another --out folder."
        )


def check_model_state(path: Path, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights whose tensor names, shapes or dtypes differ from `model`'s."""
    mine = model.state_dict()
    missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    bad = [
        f"{k}: checkpoint {tuple(state[k].shape)} {state[k].dtype}, model {tuple(v.shape)} {v.dtype}"
        for k, v in mine.items()
        if k in state and (state[k].shape != v.shape or state[k].dtype != v.dtype)
    ]
    if missing or extra or bad:
        details = [*(f"missing {k}" for k in missing[:3]), *(f"unexpected {k}" for k in extra[:3]), *bad[:3]]
        raise CheckpointError(
            f"--resume {path}: its weights do not fit this model ({'; '.join(details)}); resume with the "
            "--model, --model-override and --dtype of the run that wrote it"
        )


def restore(
    ckpt: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
) -> None:
    """Load weights, optimizer and scheduler states and RNG states into a freshly built run."""
    with torch.no_grad():
        model.load_state_dict(ckpt["model"], strict=True)
    if len(ckpt["optimizers"]) != len(optimizers) or len(ckpt["schedulers"]) != len(schedulers):
        raise CheckpointError(
            f"the checkpoint holds {len(ckpt['optimizers'])} optimizer states but this run has "
            f"{len(optimizers)} optimizers; resume with the --method of the run that wrote it"
        )
    # Optimizers first: their param groups carry the LR the schedulers then take over.
    for opt, state in zip(optimizers, ckpt["optimizers"], strict=True):
        opt.load_state_dict(state)
    for sched, state in zip(schedulers, ckpt["schedulers"], strict=True):
        sched.load_state_dict(state)
    set_rng_state(ckpt["rng"])


def rng_state() -> dict[str, Any]:
    """The RNG states a training step may draw from (torch CPU and CUDA, Python's `random`)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_FLAGS = {"model_overrides": "--model-override", "data": "--data/--tokenizer (the data hash)"}


def _flag(key: str) -> str:
    return _FLAGS.get(key, "--" + key.replace("_", "-"))


def _normal(value: Any) -> Any:
    """Tuples and lists compare equal (a checkpoint may hand back either)."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value
