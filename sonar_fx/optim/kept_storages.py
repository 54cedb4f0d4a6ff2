"""The bytes the deferred store keeps alive: each storage counted once, however many tensors view it.

A kept tensor keeps its whole storage alive, and the kept tensors often share storages: an eager loop
reads `split()` views of one buffer (jetmoe's attention experts: every expert's input is a view of one
buffer, and its output gradient a view of `cat()`'s gradient). Counting each view's storage once per
view counts one buffer once per expert, so a tensor's operands would seem to outgrow its gradient
(and cross over) where the real bytes are far below it. `storages_of` names each storage once per set
of tensors; `StorageLedger` counts each once while anything keeps it, kept up as things are kept and let
go: one per expert tensor (its kept operands' bytes, for its crossover rule) and one across the whole
store (its live bytes), whichever expert tensors hold a storage. Counts only: never touches a tensor's
data.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from sonar_fx.runtime.registry import storage_key

StorageId = tuple[torch.device, int]
"""A storage alive now: its device and `registry.storage_key` (an address is reused only once freed)."""


def operand_storages(param: Tensor, operands: list[Tensor]) -> tuple[list[bool], dict[StorageId, int]]:
    """For one hand-over of `param`'s operands: which of them live in `param`'s own storage (the
    weight, or a view of it: `registry.same_storage`), and the storages of the others, each once
    (`storages_of`). The same answers as those two, for one question of fakeness per hand-over
    instead of one per storage looked at (`registry.storage_key` asks each tensor, and the question
    costs more than the rest of the hand-over's bookkeeping): a hand-over's tensors come from one
    computation, so they are all fake (`sonar_fx.plan`) or all real."""
    fake = is_fake(getattr(param, "_local_tensor", param))
    own = _storage_id(param, fake)
    aliases, found = [], {}
    for t in operands:
        local = getattr(t, "_local_tensor", t)
        sid = _storage_id(local, fake)
        alias = sid == own and local.device.type != "meta"  # meta tensors have no storage to share
        aliases.append(alias)
        if not alias:
            found[sid] = local.untyped_storage().nbytes()
    return aliases, found


def _storage_id(t: Tensor, fake: bool | None = None) -> StorageId:
    local = getattr(t, "_local_tensor", t)
    return (local.device, storage_key(local, fake=fake))


def storages_of(tensors: Iterable[Tensor]) -> dict[StorageId, int]:
    """Each storage `tensors` live in, once: its identity -> its bytes (the whole storage, which a view
    keeps alive). A DTensor (an FSDP2 shard) is counted by its local tensor, the bytes it holds."""
    found: dict[StorageId, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        found[_storage_id(local)] = local.untyped_storage().nbytes()
    return found


class StorageLedger:
    """Bytes of the storages kept now, each counted once however many kept tensors live in it. Each
    kept thing is taken as it is kept and released as it is let go (`take`, `release`: the storages it
    keeps alive), so a change costs the storages that changed, never all the ledger holds: the store
    adds many contributions per tensor and step (micro-batches, an eager loop's E per tensor), and a
    recount of all of them at each add was quadratic in them."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.visited = 0
        """Storages taken or released so far: the ledger's work (its tests count it, never a timing)."""
        self._holders: dict[StorageId, int] = {}  # storage -> how many kept things keep it
        self._bytes: dict[StorageId, int] = {}  # storage -> its bytes, as counted in `live_bytes`

    def take(self, storages: dict[StorageId, int]) -> None:
        """One more kept thing keeps `storages` alive: those no other keeps are counted."""
        for storage, nbytes in storages.items():
            self.visited += 1
            self._holders[storage] = self._holders.get(storage, 0) + 1
            # Its bytes as last seen: a kept view's storage may have been resized since another took it.
            self.live_bytes += nbytes - self._bytes.get(storage, 0)
            self._bytes[storage] = nbytes

    def release(self, storages: dict[StorageId, int]) -> None:
        """A kept thing that took `storages` is let go: those nothing else keeps leave the count."""
        for storage in storages:
            self.visited += 1
            self._holders[storage] -= 1
            if self._holders[storage] == 0:
                del self._holders[storage]
                self.live_bytes -= self._bytes.pop(storage)

    def clear(self) -> None:
        """Every kept thing let go."""
        self.live_bytes = 0
        self._holders.clear()
        self._bytes.clear()
