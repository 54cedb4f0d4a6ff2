"""A hash of the first batches of a stream: proof that two runs trained on the same data.

Never: depend on process state (only shapes and int64 bytes are hashed).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable

import torch


def data_hash(batches: Iterable[dict[str, torch.Tensor]], n: int = 4) -> str:
    """sha256 hex of the first ``n`` batches' input_ids and labels (values, shapes, order).

    Stable across processes and runs: only shapes and int64 bytes (native order: little-endian on
    every platform torch ships for) are hashed. It consumes
    up to ``n`` batches from ``batches``: pass a fresh ``BatchStream`` (or a copy restored from a state
    dict), not the one a training loop is reading. Fewer than ``n`` batches are hashed as they are.
    """
    h = hashlib.sha256()
    # islice, not enumerate+break: an endless stream must not lose batch n+1 to the check.
    for i, batch in enumerate(itertools.islice(batches, n)):
        for key in ("input_ids", "labels"):
            t = batch[key].detach().to(device="cpu", dtype=torch.int64).clone()  # clone: compact storage
            h.update(f"{i}:{key}:{tuple(t.shape)};".encode())
            h.update(bytes(t.untyped_storage()))
    return h.hexdigest()
