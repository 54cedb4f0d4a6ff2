"""Training checkpoints: written atomically, checksummed, read back only into the run that wrote them.

For: saving everything a fine-tuning run needs to continue bitwise (model weights, the state of
every optimizer - `SonarOptimizer` expert and dense groups, or torch AdamW -, LR schedulers, the step,
the data stream position and the RNG states) with a sha256 of every tensor and of the rest, and
refusing to resume a checkpoint that is corrupted (naming the file and the tensor) or was written by
another model or configuration (naming what differs).
Never: leave a half-written checkpoint under the final name (`rundir.atomic_write`), unpickle
arbitrary objects (`torch.load(weights_only=True)`), or load a state that does not match tensor for
tensor.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx.trainer.config import flag_of
from sonar_fx.trainer.rundir import CHECKPOINT, atomic_write

FORMAT = 2  # 2: with checksums
FILENAME = CHECKPOINT


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
    """Write the full training state at a step boundary to `path`, atomically, with checksums."""
    payload: dict[str, Any] = {
        "format": FORMAT,
        "identity": dict(identity),
        "step": step,
        "model": model.state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "stream": dict(stream_state),
        "rng": rng_state(),
    }
    payload["checksums"] = checksums(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (tensors land on the CPU) and verify it."""
    if path.is_dir() or not path.exists():
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
        found = ckpt.get("format") if isinstance(ckpt, dict) else None
        raise CheckpointError(
            f"--resume {path}: not a sonar-fx checkpoint of format {FORMAT} (found format {found!r}); "
            "start a fresh --out instead"
        )
    verify(path, ckpt)
    return ckpt


def checksums(payload: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each tensor (dtype, shape and bytes) by its path in `payload` ("/model/<name>"), and
    of the other values of each top-level entry together ("<values>/stream"); the "checksums" entry
    itself is left out."""
    sums: dict[str, str] = {}
    for key, value in payload.items():
        if key == "checksums":
            continue
        values = hashlib.sha256()
        for where, leaf in _leaves(value, f"/{key}"):
            if isinstance(leaf, torch.Tensor):
                sums[where] = _tensor_digest(leaf)
            else:
                values.update(f"{where}={type(leaf).__name__}:{leaf!r};".encode())
        sums[f"<values>/{key}"] = values.hexdigest()
    return sums


def verify(path: Path, ckpt: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose content differs from the checksums it was saved with."""
    saved = ckpt.get("checksums")
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume {path}: the checkpoint has no checksums; start a fresh --out")
    now = checksums(ckpt)
    bad = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if bad:
        shown = ", ".join(k.replace("<values>", "the values of ") for k in bad[:3])
        raise CheckpointError(
            f"--resume {path}: the file is corrupted: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
            f"({shown}) no longer match the checksums it was saved with; resume from another checkpoint "
            "or start a fresh --out"
        )


def _leaves(obj: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{where}/{k}")
    elif isinstance(obj, (list, tuple)):  # a tuple may come back as a list: both hash alike
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def _tensor_digest(t: torch.Tensor) -> str:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    h = hashlib.sha256(f"{flat.dtype}:{tuple(t.shape)};".encode())
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().data)  # the tensor's own bytes, zero-copy
    return h.hexdigest()


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


def _flag(key: str) -> str:
    return "--data/--tokenizer (the data hash)" if key == "data" else flag_of(key)


def _normal(value: Any) -> Any:
    """Tuples and lists compare equal (a checkpoint may hand back either)."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value
