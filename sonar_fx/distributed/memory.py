"""Gradient memory of a distributed step, counted from the tensors themselves (deterministic).

The CPU profiler misses frees that happen on gloo's threads, so its peaks differ between ranks and
runs. `GradStorageCounter` instead samples, at every parameter's gradient completion (its hook runs
before Sonar's, so the gradient just produced is still alive) and at the end of backward, the bytes
of the distinct storages that hold gradients: each parameter's `.grad` (an FSDP2 shard counts its
whole storage, which is its group's reduce-scatter output), DDP's bucket buffers (allocated once and
alive for the whole run), and the expert gradients a reduction holds between its all-reduce and its
update. Peak of those samples = the step's gradient peak. Not counted: activations, gradients
inside autograd before they reach a parameter, FSDP2's unsharded gradients (transient, the same
for Sonar and standard training). It only reads tensors; it never changes one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from sonar_fx.memory import storage_bytes


def ddp_bucket_bytes(model: DistributedDataParallel) -> int:
    """Bytes of DDP's gradient buckets (the reducer allocates them at construction, for the run)."""
    buffers = [b.buffer() for b in model.reducer._get_zeros_like_grad_buckets()]
    return sum(t.numel() * t.element_size() for t in buffers)


@dataclass
class GradStorageCounter:
    """Samples gradient storage bytes during backward; create it BEFORE Sonar hooks its tensors."""

    params: list[nn.Parameter]
    constant_bytes: int = 0
    """Gradient memory alive for the whole run (DDP's buckets)."""
    held: Callable[[], Iterable[Tensor]] = list
    """Gradients held outside `.grad` (a reduction's in-flight expert gradients)."""
    skip: set[int] = field(default_factory=set)
    """ids of parameters whose `.grad` lives inside `constant_bytes` (DDP's gradient_as_bucket_view)."""
    peak: int = 0
    samples: int = 0
    _callback_task: int | None = None

    @classmethod
    def hook(cls, model: nn.Module) -> GradStorageCounter:
        counter = cls([p for p in model.parameters() if p.requires_grad])
        for p in counter.params:
            p.register_post_accumulate_grad_hook(counter._on_grad)
        return counter

    def add_ddp(self, model: DistributedDataParallel) -> None:
        """Count `model`'s buckets (and, with gradient_as_bucket_view, not its grads twice)."""
        self.constant_bytes += ddp_bucket_bytes(model)
        if model.gradient_as_bucket_view:
            ignored = model.parameters_to_ignore
            self.skip |= {id(p) for n, p in model.module.named_parameters() if n not in ignored}

    def live_bytes(self) -> int:
        grads = [p.grad for p in self.params if p.grad is not None and id(p) not in self.skip]
        return self.constant_bytes + storage_bytes([*grads, *self.held()])

    def sample(self) -> int:
        live = self.live_bytes()
        self.peak = max(self.peak, live)
        self.samples += 1
        return live

    def reset(self) -> None:
        self.peak, self.samples = 0, 0

    def _on_grad(self, _: Tensor) -> None:
        self.sample()
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.sample()
