"""Peak of the tensor bytes alive in a region, counted from the storages themselves, frees on every thread.

For: measuring a step whose collectives free tensors on other threads. The CPU profiler records an
allocator event only on a thread where profiling is on: a gradient whose last reference a gloo worker
drops (an asynchronous all-reduce's work finishing after the step let go of it) is never recorded as
freed, so `sonar_fx.memory.measure_peak` runs high on such a step, by a different amount on each rank
and run (torch 2.13: `profile_all_threads` records no memory event at all). `LiveStorageMeter` is a
dispatch mode that learns of each storage an op allocates (an output its schema does not alias to an
input, on the thread it measures) and of its free through a weak reference, whose callback runs on
whichever thread frees it; a counted storage resized in place (FSDP2's unsharded parameters) is
re-read whenever an op sees it. Its peak is the most storage bytes
alive at once, sampled after every op, absolute: the tensors alive at the start are counted too; the
caller may name what the region is doing (`phase`), and `peak_phase` is the name it had at the peak.
Not seen: a kernel's scratch inside one op (the profiler's events hold it), memory a collective's own
thread allocates, and a tensor an op's own Python body makes and keeps without returning it (a custom
op's body runs below the mode: the deferred store's sum, folded inside a compiled graph's kept op),
unless the caller hands the holder's tensors in (`held`: re-read after every op).
Never: change what it measures (it only reads tensors and holds weak references).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveStorageMeter(TorchDispatchMode):
    """`with LiveStorageMeter(alive) as meter: step()`, then `meter.peak_bytes` (absolute)."""

    def __init__(
        self,
        alive: Iterable[Tensor] = (),
        *,
        constant_bytes: int = 0,
        resizable: Iterable[Tensor] = (),
        held: Callable[[], Iterable[Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.constant_bytes = constant_bytes
        """Bytes alive for the whole region that no tensor here exposes (DDP's bucket buffers)."""
        self.resizable = list(resizable)
        """Tensors whose storage is resized in place, outside any op (FSDP2's all-gather outputs: freed by
        a resize to 0 bytes): re-read after every op, so such a free is seen when it happens."""
        self.held = held
        """The tensors something holds now, read after every op: a storage first seen there counts as
        allocated (made where the mode could not see it, inside another op's body)."""
        self._bytes: dict[int, int] = {}  # storage (its C++ object's address) -> bytes counted
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._lock = threading.Lock()  # a free's callback may run on a collective's thread
        self.now = constant_bytes
        self.peak_bytes = constant_bytes
        self.frees_elsewhere = 0
        """Frees seen on a thread other than the one measured (the ones the profiler misses)."""
        self.phase = ""
        """What the region is doing now, as its caller names it ("backward", "step")."""
        self.peak_phase = ""
        """`phase` when the peak was reached (the start's peak: "")."""
        self._thread = threading.get_ident()
        for t in [*alive, *self.resizable]:
            self._see(t)
        self.start_bytes = self.now

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile traces, on while its compiled code runs: a measured step runs the
        graphs it compiled before (an active mode otherwise makes dynamo run every frame eagerly)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        read = {_key(t) for t in inputs}
        returns = func._schema.returns
        outs = [out] if len(returns) == 1 else list(out or ())  # (an op may return nothing)
        for ret, value in zip(returns, outs, strict=True):
            for t in tree_leaves(value):
                # Fresh unless the schema says it aliases an input or it is an input's storage: c10d's
                # in-place collectives (allreduce_ of DDP's bucket) return their inputs unannotated.
                if isinstance(t, Tensor):
                    self._see(t, allocated=ret.alias_info is None and _key(t) not in read)
        for t in [*inputs, *self.resizable]:
            self._see(t, allocated=False)
        for t in self.held() if self.held is not None else ():
            self._see(t)
        if self.now > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.now, self.phase
        return out

    def _see(self, t: Tensor, *, allocated: bool = True) -> None:
        """Count `t`'s storage if it is new here and `allocated` (an op's fresh output, or alive at the
        start), or re-read its size if counted already (resized in place). A storage an op merely
        reads or writes (DDP's bucket, passed to the reducer's copies) was never allocated in the
        region: counting it would count it twice (`constant_bytes`)."""
        if is_traceable_wrapper_subclass(t):  # a DTensor holds memory only in its local shard
            names, _ = t.__tensor_flatten__()
            for name in names:
                if isinstance(inner := getattr(t, name), Tensor):
                    self._see(inner, allocated=allocated)
            return
        if t.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            counted = self._bytes.get(key)
            if counted == nbytes or (counted is None and not allocated):
                return
            self.now += nbytes - (counted or 0)
            self._bytes[key] = nbytes
            if counted is None:
                self._refs[key] = weakref.ref(storage, partial(self._freed, key))

    def _freed(self, key: int, _: object = None) -> None:
        with self._lock:
            self.now -= self._bytes.pop(key, 0)
            self._refs.pop(key, None)
            if threading.get_ident() != self._thread:
                self.frees_elsewhere += 1


def _key(t: Tensor) -> int | None:
    """A plain tensor's storage (its C++ object's address); None for what holds no storage of its own."""
    if is_traceable_wrapper_subclass(t) or t.device.type == "meta":
        return None
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return None
    return t.untyped_storage()._cdata
