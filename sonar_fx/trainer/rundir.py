"""The run folder (`--out`): what it holds, who may write it, and writes that never leave it torn.

For: finding whether a folder already holds a run (so a fresh run never overwrites one by accident),
a lock so two processes never train into one folder, atomic writes (temp file, fsync, `os.replace`)
and the removal of temp files a killed write left behind. Never: delete a run's files unless asked
(`replace_run`, for `--overwrite`), or leave a half-written file under a run file's name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from sonar_fx.trainer.config import ConfigError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
RUN_FILES = (CHECKPOINT, METRICS, SUMMARY)
LOCK = ".sonar-fx.lock"


def run_files(folder: Path) -> list[str]:
    """The run files present in `folder` (empty: no run there)."""
    return [name for name in RUN_FILES if (folder / name).exists()]


def replace_run(folder: Path) -> None:
    """Delete the run files of `folder` (a fresh run with --overwrite replaces that run)."""
    for name in RUN_FILES:
        (folder / name).unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` through a temp file in its folder: readers see the old file or the new one, never
    a mix, and a crash leaves the old file intact (a kill leaves only the temp file, see
    `remove_stale_temps`)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temp files of writes that a kill interrupted (`atomic_write` names them
    `.<run file>.<random>.tmp`); warns with their total size. Call it while holding the folder's lock."""
    stale = [p for name in RUN_FILES for p in folder.glob(f".{name}.*.tmp") if p.is_file()]
    if stale:
        size = sum(p.stat().st_size for p in stale)
        for p in stale:
            p.unlink(missing_ok=True)
        warnings.warn(
            f"{folder}: removed {len(stale)} temp file(s) ({size / 2**20:.1f} MiB) left by an interrupted "
            "save",
            stacklevel=2,
        )
    return stale


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` for one run; the OS drops it when the process dies, even on
    kill -9. Another process training into the same folder is refused, naming the folder."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        yield
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"--out {folder}: another sonar-fx run is writing there now; wait for it to end or pick "
                "another --out",
                flag="--out",
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def to_json(value: Any, **kwargs: Any) -> str:
    """Strict JSON (never a bare NaN or Infinity): non-finite floats become null."""
    return json.dumps(finite_or_none(value), allow_nan=False, default=str, **kwargs)
