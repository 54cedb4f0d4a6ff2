"""Peak memory of one training step, measured honestly on CPU and on CUDA.

CPU: the profiler's allocator events (every allocation and free with its byte count) are summed in
time order; the peak of that running sum is the most tensor bytes allocated ABOVE the start of the
measured region, i.e. transient step memory. CUDA: `max_memory_allocated` / `max_memory_reserved`
after `reset_peak_memory_stats`. Also: the bytes a set of tensors holds (`storage_bytes`, and
`state_bytes` between steps: the one definition), what Sonar should save (`ExpertGradBytes`, the one
place the prediction is written) and the process's resident memory (for endurance runs). This module
measures; it never changes what it measures.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from sonar_fx.experts.discovery import ExpertLayer


@dataclass(frozen=True)
class PeakMemory:
    """Peaks of one measured region, in bytes."""

    peak_bytes: int
    """Peak tensor bytes above the region's start (CPU: allocator events; CUDA: max allocated - start)."""
    allocated_bytes: int | None = None
    """CUDA only: `torch.cuda.max_memory_allocated()` (absolute)."""
    reserved_bytes: int | None = None
    """CUDA only: `torch.cuda.max_memory_reserved()` (absolute)."""
    sized_peak_bytes: int | None = None
    """CPU, when `measure_peak` was given `sizes`: the peak of the bytes alive in blocks of exactly one
    of those sizes (e.g. the expert gradients', `ExpertGradBytes.tensor_sizes`), replayed from the same
    allocator events: what such tensors held at once, seen by the allocator rather than told."""

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


def measure_peak(
    fn: Callable[[], Any], device: torch.device | str = "cpu", *, sizes: Collection[int] = ()
) -> tuple[Any, PeakMemory]:
    """Run `fn()` once and return its result with the peak memory it needed (CPU, with `sizes`: also
    the peak of the blocks of those sizes alone, `PeakMemory.sized_peak_bytes`)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device)
        return result, PeakMemory(allocated - start, allocated, torch.cuda.max_memory_reserved(device))
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with native_stderr_silenced():  # kineto prints a line on start and stop; keep progress bars clean
        prof.start()
    try:
        with _native_stderr_without(_UNKNOWN_BLOCK):
            result = fn()
    finally:
        with native_stderr_silenced():
            prof.stop()
    sized = peak_live_bytes(prof, sizes=sizes) if sizes else None
    return result, PeakMemory(peak_live_bytes(prof), sized_peak_bytes=sized)


_UNKNOWN_BLOCK = "Memory block of unknown size was allocated before the profiling started"
"""c10 logs this (once) when a tensor made before the profiler started is freed under it: expected in
every measured step (last step's tensors), and the allocator-event sum accounts for it (frees of
untracked blocks carry no size, so the peak counts only what the step allocated)."""


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the duration (only around profiler start/stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def _native_stderr_without(line: str) -> Iterator[None]:
    """Capture file descriptor 2 for the duration, then pass on everything but the lines holding `line`
    (C++ writes to the descriptor directly, past Python's warning filters)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [raw for raw in captured.read().splitlines(keepends=True) if line.encode() not in raw]
            if kept:
                os.write(2, b"".join(kept))


def peak_live_bytes(prof: profile, *, sizes: Collection[int] = ()) -> int:
    """Peak of the running sum of CPU allocator events recorded by `prof`, in bytes (>= 0); with
    `sizes`, of the events of blocks of exactly those sizes only (an allocation's event carries its
    size, a free's the size negated)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    events = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    if sizes:
        events = [e for e in events if abs(e.nbytes()) in sizes]  # type: ignore[union-attr]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # type: ignore[union-attr]
        peak = max(peak, live)
    return peak


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: the memory they hold. A tensor that wraps others
    (a DTensor, torchao's low-bit states) counts its inner tensors (the local shard; codes and scales),
    since its own size is the logical one, not what is allocated."""
    found: dict[int, int] = {}
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            # Only the inner tensors hold memory (a DTensor also lists its device mesh here).
            stack.extend(inner for name in names if isinstance(inner := getattr(t, name), Tensor))
            continue
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return sum(found.values())


def state_bytes(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes alive between steps: parameters, gradients still held, optimizer state tensors.

    Counted by storage (`storage_bytes`), the one definition the demo, the trainer and the benchmarks
    share: what the allocator holds. Counting tensors instead would count a view twice (DDP's
    gradient_as_bucket_view, FSDP2 gradients viewing one reduce-scatter output), miss the rest of a
    storage a view exposes only part of, and take a wrapper's logical size for its bytes (a DTensor
    reports the global shape, a low-bit state its fp32 one). Added to a step's transient peak it
    compares with absolute peaks (the paper's)."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return storage_bytes(tensors)


def high_water_mib(device: str) -> dict[str, float]:
    """The process's memory high-water mark so far, in MiB (CUDA: allocated; CPU: resident set)."""
    if device.startswith("cuda"):
        return {"cuda_max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"peak_rss_mib": process_peak_rss_bytes() / 2**20}


def process_rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:
        return process_peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, kw_only=True)
class ExpertGradBytes:
    """Bytes of a model's expert gradients: what standard training holds at once, and what Sonar saves."""

    total: int
    """Every layer's expert gradients: all alive at once at standard training's optimizer step."""
    one_layer: int
    """The largest layer's: the most Sonar keeps alive at a time (a layer's are freed after its update)."""
    tensor_sizes: frozenset[int] = frozenset()
    """The byte sizes of the expert tensors' gradients (for `measure_peak(sizes=...)`)."""

    @classmethod
    def of(cls, layers: Sequence[ExpertLayer]) -> ExpertGradBytes:
        if not layers:
            raise ValueError("ExpertGradBytes.of needs the model's expert layers (discover_experts)")
        grads = [layer.grad_bytes() for layer in layers]
        sizes = frozenset(t.param.numel() * t.param.element_size() for layer in layers for t in layer.tensors)
        return cls(total=sum(grads), one_layer=max(grads), tensor_sizes=sizes)

    @property
    def predicted_saving(self) -> int:
        """Bytes Sonar should take off a step's peak: all expert gradients but the one layer alive."""
        return self.total - self.one_layer
