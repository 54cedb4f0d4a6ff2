"""The bytes the deferred store keeps alive: each storage counted once, however many tensors view it.

A kept tensor keeps its whole storage alive, and the kept tensors often share storages: an eager loop
reads `split()` views of one buffer (jetmoe's attention experts: every expert's input is a view of one
buffer, and its output gradient a view of `cat()`'s gradient). Counting each view's storage once per
view counts one buffer once per expert, so a tensor's operands would seem to outgrow its gradient
(and cross over) where the real bytes are far below it. `storages_of` names each storage once per set
of tensors (for one expert tensor's crossover rule); `StorageLedger` counts each once across the whole
store (its live bytes), whichever expert tensors hold it. Counts only: never touches a tensor's data.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from sonar_fx.runtime.registry import storage_key

StorageId = tuple[torch.device, int]
"""A storage alive now: its device and `registry.storage_key` (an address is reused only once freed)."""


def storages_of(tensors: Iterable[Tensor]) -> dict[StorageId, int]:
    """Each storage `tensors` live in, once: its identity -> its bytes (the whole storage, which a view
    keeps alive). A DTensor (an FSDP2 shard) is counted by its local tensor, the bytes it holds."""
    found: dict[StorageId, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        found[(local.device, storage_key(local))] = local.untyped_storage().nbytes()
    return found


class StorageLedger:
    """Bytes of the storages any holder keeps now, each storage counted once; a holder (one expert
    tensor's kept contributions) reports all it holds after each change (`hold`)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self._held: dict[object, dict[StorageId, int]] = {}  # holder -> its storages, as last held
        self._holders: dict[StorageId, int] = {}  # storage -> how many holders keep it
        self._bytes: dict[StorageId, int] = {}  # storage -> its bytes, as counted in `live_bytes`

    def hold(self, holder: object, storages: dict[StorageId, int]) -> None:
        """`holder` keeps `storages` now (empty: nothing): those it dropped are released first, those
        new counted if no other holder keeps them already."""
        before = self._held.pop(holder, {})
        for storage in before.keys() - storages.keys():
            self._holders[storage] -= 1
            if self._holders[storage] == 0:
                del self._holders[storage]
                self.live_bytes -= self._bytes.pop(storage)
        for storage, nbytes in storages.items():
            if storage not in before:
                self._holders[storage] = self._holders.get(storage, 0) + 1
            # A storage freed while its holder changed, its address taken by a new one: the new bytes.
            self.live_bytes += nbytes - self._bytes.get(storage, 0)
            self._bytes[storage] = nbytes
        if storages:
            self._held[holder] = dict(storages)

    def clear(self) -> None:
        """Every holder dropped."""
        self.live_bytes = 0
        self._held.clear()
        self._holders.clear()
        self._bytes.clear()
