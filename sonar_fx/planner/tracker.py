"""Accounting one training step's memory: torch's `MemTracker`, fitted to a planned step.

torch's `torch.distributed._tools.mem_tracker.MemTracker` (a dispatch mode) sees every tensor the step
creates, learns of every free through a weak reference to its storage, and files each byte under
parameters, buffers, gradients, activations, temporaries or optimizer states. `StepTracker` keeps that
accounting and changes six things for a step planned on fake CPU tensors:
- the device's allocator: each storage is counted as `round_bytes` says the target's allocator hands
  it out (`device.cuda_block_bytes`: CUDA's caching allocator's blocks; exact bytes for a CPU plan);
- kernel scratch: a fake op allocates only its outputs; what a real kernel allocates and frees inside
  the op (`scratch.cpu_kernel_scratch`: oneDNN's, on AVX-512 hosts, for a CPU plan; `kernels.op_scratch`:
  the buffers of sonic-moe's op bodies) is counted as temporaries for the op's duration, on top of
  what is alive then;
- the peak: only the whole step's peak snapshot is kept (torch's per-module peaks cost a scan of
  every module per op: a real-size model's step took 4x longer and the plan uses none of them);
- categories: optimizer states exist before the step (they are tracked at its start), so what
  `optimizer.step()` newly allocates is the step's scratch (temporaries, not states), as is what is
  allocated outside forward and backward (gradient clipping's norms);
- a second forward of the model in one step (expert_clip="global" runs forward and backward twice) is
  part of the same step, not a new iteration (torch's tracker refuses it);
- the graph's lifetime: torch's module tracker (`ModTracker`) hooks each module's inputs with a
  multi-grad hook that holds their autograd nodes and is stored on those nodes: a reference cycle, so
  the step's graph outlives its backward (until garbage collections, which free it in part or not at
  all), and with it every tensor a hook on it holds. The deferred schedule's capture holds the GEMM
  input and offsets it keeps in such a hook: a real step frees them as `step()` consumes them, the
  tracked step kept them to its end (one layer's worth above the real peak, tiny OLMoE with 4
  micro-batches). Each such hook is removed when the backward it fired in ends
  (`_graph_hooks_released`), and reference counting frees the graph as in a real step.
MemTracker is private to torch; these overrides follow torch 2.13's and are tested by the planner's
tests. Never: change what the step allocates or frees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType
from torch.utils.hooks import RemovableHandle

CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "temporaries")
"""How a plan splits bytes, in table order."""
_CATEGORY_OF: dict[Any, str] = {
    _MemRefType.PARAM: "weights",
    _MemRefType.BUFFER: "weights",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_states",
    _MemRefType.ACT: "activations",
    _MemRefType.OTH: "activations",  # the batch (tracked as an external tensor): forward's input
    _MemRefType.TEMP: "temporaries",
}


class StepTracker(MemTracker):
    """`MemTracker` for one planned step (see the module docstring)."""

    def __init__(
        self,
        *,
        round_bytes: Callable[[int], int] | None = None,
        scratch: Callable[[Any, Any, dict[str, Any]], int] | None = None,
    ) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        """Bytes the target's allocator hands out for a request (None: the bytes asked for)."""
        self.scratch = scratch
        """Bytes an op's kernel allocates inside the op beyond its outputs (None: none are counted)."""
        self._released = contextlib.ExitStack()

    def __enter__(self) -> StepTracker:
        self._released.enter_context(_graph_hooks_released())
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._released.close()

    def track_step_start(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], *tensors: Any
    ) -> None:
        """Track what is alive when the step starts: weights, optimizer states, the batch."""
        self.track_external(model, *optimizers, *tensors)

    def bytes_now(self) -> int:
        return sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())

    def peak_bytes(self) -> int:
        return sum(self._peak_mem.values())

    def peak_by_category(self) -> dict[str, int]:
        """Bytes alive at the step's peak, by category (`CATEGORIES`)."""
        split = dict.fromkeys(CATEGORIES, 0)
        for snap in self._peak_mem_snap.values():
            for kind, nbytes in snap.items():
                if kind != _TOTAL_KEY:
                    split[_CATEGORY_OF[kind]] += nbytes
        return split

    # ---------------------------------------------------------------- overrides of MemTracker's hooks

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        res = super().__torch_dispatch__(func, types, args, kwargs)
        nbytes = (
            0 if self.scratch is None or res is NotImplemented else self.scratch(func, args, kwargs or {})
        )
        if nbytes:  # alive with the op's outputs, freed before the op returns
            snap = self._curr_mem_snap.setdefault(torch.device("cpu"), dict.fromkeys(self._ref_class, 0))
            snap.setdefault(_TOTAL_KEY, 0)
            for key in (_MemRefType.TEMP, _TOTAL_KEY):
                snap[key] += nbytes
            self._update_peak_stats(None)
            for key in (_MemRefType.TEMP, _TOTAL_KEY):
                snap[key] -= nbytes
        return res

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)

    def _update_snap(
        self, u_type: Any, winfo: Any, old_mem_consumed: Any = None, old_reftype: Any = None
    ) -> None:
        if self.round_bytes is not None and u_type in (_UpdateType.ADD, _UpdateType.SIZE):
            # Counted as the allocator hands it out; a resize re-rounds the new size.
            winfo.mem_consumed = self.round_bytes(winfo.size * winfo.element_size)
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if reftype == _MemRefType.OPT:
            reftype = _MemRefType.TEMP  # states predate the step: a new tensor in step() is scratch
        elif reftype == _MemRefType.ACT and not self._mod_tracker.is_bw and self._outside_modules():
            reftype = _MemRefType.TEMP
        super()._track(reftype, t)

    def _outside_modules(self) -> bool:
        return set(self._mod_tracker.parents) <= {"Global"}

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        root = set(self._mod_tracker.parents) - {name} == {"Global"}
        if module in self.memory_tracking and root and not self._mod_tracker.is_bw:
            self.memory_tracking.clear()  # the step's second forward; per-module stats are not used
        super()._pre_fw_hook(module, inputs)


@contextlib.contextmanager
def _graph_hooks_released() -> Iterator[None]:
    """`ModTracker`'s multi-grad hooks, each removed when the backward it fired in ends (and any left
    when the tracker exits): removed, a hook no longer holds its nodes, so the graph is freed when the
    step lets go of it, as in a real step. A hook fires once per backward of its graph; the module
    tracker registers none in backward, so none is removed before it has done its work."""
    register = mod_tracker.register_multi_grad_hook
    handles: list[RemovableHandle] = []

    def released(tensors: Any, fn: Callable[..., None], **kwargs: Any) -> RemovableHandle:
        def fired(*args: Any) -> None:
            fn(*args)
            torch.autograd.Variable._execution_engine.queue_callback(handle.remove)

        handle = register(tensors, fired, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = released
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()
