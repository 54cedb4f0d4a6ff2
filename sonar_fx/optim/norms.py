"""Gradient norms and clipping, computed inside the updates with torch's own arithmetic.

For: each expert tensor's gradient norm (taken in its update, while the gradient is alive), the
dense and global norms at `step()`, the clipping modes of `expert_clip` ("per_tensor", "global") and
the bookkeeping of the global mode's two backward passes (a norm pass that only records norms, then
an update pass). Every number is computed with the calls `torch.nn.utils.clip_grad_norm_` makes
(`_foreach_norm` per tensor, `vector_norm` of their stack in parameter order, `max / (norm + 1e-6)`
clamped at 1), so Sonar's clipping is bitwise the same as standard training's.
Never: read a norm on the host (no sync) except where a caller asks for floats, or update a weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from sonar_fx.config import ExpertClip

Pass = Literal["norm", "update"] | None


def tensor_norm(grad: Tensor) -> Tensor:
    """The 2-norm of one gradient, as `clip_grad_norm_` computes each tensor's (0-d, grad's dtype)."""
    return torch._foreach_norm([grad], 2.0)[0]


def plain(norm: Tensor) -> Tensor:
    """A norm as a plain tensor: an FSDP2 shard's norm is a DTensor (partial over ranks: the whole
    tensor's norm is one scalar all-reduce, which every rank runs at the same point)."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def total_norm(norms: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of per-tensor norms listed in parameter order, as `torch.nn.utils.get_total_norm`
    stacks them: grouped by (device, dtype) with torch's own grouping, in the order ITS dict gives
    (not the order of first appearance: [fp32, bf16, fp32] puts the bf16 group first), stable within a
    group, each moved to the first norm's device. A norm has its gradient's device and dtype, so the
    norms group exactly as the gradients do."""
    if not norms:
        return torch.tensor(0.0)
    if any(is_dtensor(n) for n in norms):  # an FSDP2 shard's partial norm: torch groups plain tensors
        return _total_norm_in_first_appearance(norms, norm_type)
    grouped = _group_tensors_by_device_and_dtype([list(norms)])
    first = norms[0].device
    ordered = [n.to(first) for (group,), _ in grouped.values() for n in group if n is not None]
    return torch.linalg.vector_norm(torch.stack(ordered), norm_type)


def is_dtensor(t: Tensor) -> bool:
    """A DTensor (an FSDP2 shard's parameter or gradient): its local values are this rank's part."""
    return getattr(t, "full_tensor", None) is not None


def _total_norm_in_first_appearance(norms: Sequence[Tensor], norm_type: float) -> Tensor:
    keys: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for n in norms:
        keys.setdefault((n.device, n.dtype), []).append(n)
    first = norms[0].device
    ordered = [n.to(first) for group in keys.values() for n in group]
    return torch.linalg.vector_norm(torch.stack(ordered), norm_type)


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """`min(max_norm / (norm + 1e-6), 1)` as a 0-d tensor: no branch, so no sync."""
    return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)


def scaled(grad: Tensor, owned: bool, coef: Tensor) -> Tensor:
    """`grad * coef`, in place when the caller owns `grad` (a copy it made), else into a new tensor:
    a gradient a compiled graph handed over is not ours to write (the op does not declare it mutated)."""
    coef = coef.to(grad.device)
    return grad.mul_(coef) if owned else grad * coef


@dataclass
class StepNorms:
    """The gradient norms of one step: 0-d device tensors until someone asks for floats."""

    experts: dict[str, Tensor] = field(default_factory=dict)
    """Expert tensor name -> its gradient's norm (before clipping)."""
    partial: dict[str, Tensor] = field(default_factory=dict)
    """Expert tensor name -> its norm as torch's clipping computes it from a shard (an FSDP2 DTensor,
    partial over ranks), where that differs from the whole tensor's norm in `experts`: clipping
    combines these, as `clip_grad_norm_` does, so that it rounds the same way."""
    dense: Tensor | None = None
    """Global norm of the dense gradients (before clipping)."""
    total: Tensor | None = None
    """Global norm over dense and expert gradients (expert_clip="global" only)."""

    def as_floats(self) -> dict[str, object]:
        """Plain numbers (one host sync for all of them)."""
        names = list(self.experts)
        values = [*self.experts.values(), *(t for t in (self.dense, self.total) if t is not None)]
        floats = torch.stack([v.detach().float().cpu() for v in values]).tolist() if values else []
        experts = dict(zip(names, floats[: len(names)], strict=True))
        rest = iter(floats[len(names) :])
        dense = next(rest) if self.dense is not None else None
        total = next(rest) if self.total is not None else None
        return {"dense": dense, "total": total, "experts": experts}


@dataclass
class ExpertClipper:
    """Clips expert gradients in their update and keeps the step's norms (one per `SonarOptimizer`)."""

    mode: ExpertClip
    max_norm: float | None
    current: StepNorms = field(default_factory=StepNorms)
    last: StepNorms = field(default_factory=StepNorms)
    """The norms of the last completed step (what `report()` and the metrics show)."""
    backward_pass: Pass = None
    """Which pass of the global mode is running (None: none, or another mode)."""
    coef: Tensor | None = None
    """The global clip coefficient, known between the two passes of the global mode."""
    skip_step: bool = False
    """The global mode's norm pass found a non-finite norm under nonfinite="skip": `step()` skips."""
    track_norms: bool = True
    """Take each expert gradient's norm when no clipping needs it (False: an ablation that measures
    what logging the norms costs; clipping modes always take them)."""

    def norm_of(self, name: str, grad: Tensor) -> Tensor | None:
        """`grad`'s norm, taken now and recorded (the global mode's update pass: the one its norm pass
        recorded from the same gradient); None when nothing needs it (norms off, no clipping)."""
        if self.backward_pass == "update":
            return self.current.experts[name]
        if self.mode is None and not self.track_norms:
            return None
        raw = tensor_norm(grad)
        norm = self.current.experts[name] = plain(raw)
        if norm is not raw:
            self.current.partial[name] = raw
        return norm

    def clip_norm(self, name: str) -> Tensor:
        """The norm a clip of `name`'s gradient computes with: its shard's (partial) norm, if any."""
        return self.current.partial.get(name, self.current.experts[name])

    def clip(self, name: str, grad: Tensor, owned: bool) -> Tensor:
        """`grad` clipped as the mode says, by the norm `norm_of` recorded (a new tensor unless
        `owned`)."""
        if self.backward_pass == "update":
            assert self.coef is not None
            return scaled(grad, owned, self.coef)
        if self.mode == "per_tensor" and self.max_norm is not None and name in self.current.experts:
            # clip_grad_norm_([p]): the "global" norm of one tensor is the norm of its norm (a shard's
            # partial norm is reduced over ranks after that step, as DTensor's clip reduces it).
            norm = plain(total_norm([self.clip_norm(name)]))
            return scaled(grad, owned, clip_coefficient(norm, self.max_norm))
        return grad

    def end_step(self) -> None:
        self.last, self.current = self.current, StepNorms()
        self.backward_pass, self.coef, self.skip_step = None, None, False

    def abandon(self) -> None:
        self.current = StepNorms()
        self.backward_pass, self.coef, self.skip_step = None, None, False
