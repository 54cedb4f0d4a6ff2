"""Which dense gradients changed since a moment of the step: the end of backward, or the last `step()`.

Sonar's `step()` assumes the dense gradients are exactly what backward left (it clips them itself) and
that each backward feeds one step (the experts' gradients are gone once updated). Two loop habits break
that silently: the user's own `clip_grad_norm_` after backward (the dense gradients are clipped twice)
and a second `step()` after one backward (the dense tensors step twice, the experts once). A gradient
written in place bumps its version counter, and a new `.grad` is a new tensor, so a snapshot of
(tensor, version) tells both apart from a fresh gradient. Snapshots hold weak references: a gradient
the user frees is not kept alive. A DTensor gradient (FSDP2's shards) is the exception: its in-place ops
run below autograd on its local tensor and bump no version counter, so its snapshot also keeps the
norm of its local shard (one norm pass over this rank's dense shards per backward), and a gradient
whose shard norm differs at `step()` was written (a write that changes no value, e.g. a clip by 1.0,
changes no training either). A GradScaler's unscale writes those shards too (its kernel bumps no
version counter either), and a deferred step it calls must tell that write from a clip: the snapshot
also keeps each shard's largest magnitude, which the unscale maps exactly (`x * inv_scale` rounded is
monotone in |x|), while a clip (a factor below 1) shrinks it (`accept_unscale`). It only looks; it
never changes a gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from sonar_fx.optim.norms import is_dtensor

Snapshot = dict[int, tuple["weakref.ref[Tensor]", int]]
"""id(param) -> (weak reference to its .grad, that gradient's version counter)."""
ShardNorms = dict[int, Tensor]
"""id(param) -> the norm of its DTensor gradient's local shard."""


def snapshot(params: Sequence[Tensor]) -> Snapshot:
    """The current gradient of every param that has one."""
    return {id(p): (weakref.ref(p.grad), p.grad._version) for p in params if p.grad is not None}


def shard_norms(params: Sequence[Tensor]) -> ShardNorms:
    """The local shard norm of every DTensor gradient (none: no DTensor gradient)."""
    sharded = [p for p in params if p.grad is not None and hasattr(p.grad, "_local_tensor")]
    if not sharded:
        return {}
    norms = torch._foreach_norm([p.grad._local_tensor for p in sharded])  # type: ignore[union-attr]
    return dict(zip(map(id, sharded), norms, strict=True))


def shard_peaks(params: Sequence[Tensor]) -> ShardNorms:
    """The largest magnitude in each DTensor gradient's local shard (its inf-norm, exact in any dtype;
    an empty shard, which FSDP2's padding can leave a rank, has none and nothing to write)."""
    sharded = [
        p for p in params
        if p.grad is not None and hasattr(p.grad, "_local_tensor") and p.grad._local_tensor.numel()
    ]  # fmt: skip
    if not sharded:
        return {}
    peaks = torch._foreach_norm([p.grad._local_tensor for p in sharded], float("inf"))  # type: ignore[union-attr]
    return dict(zip(map(id, sharded), peaks, strict=True))


def unscaled_peak(peak: Tensor, inv_scale: Tensor) -> Tensor:
    """What GradScaler's unscale kernel makes of a shard's largest magnitude: its own arithmetic on
    that element (`val * inv_scale` in fp32, cast back; an inv_scale of 1 leaves it), and rounding
    preserves the order of magnitudes, so it is the largest magnitude of the unscaled shard."""
    inv = inv_scale.to(device=peak.device, dtype=torch.float32)
    return peak if bool(inv == 1) else (peak.float() * inv).to(peak.dtype)


def rewritten(params: Sequence[Tensor], before: ShardNorms) -> list[Tensor]:
    """Params whose DTensor gradient's shard norm is not the one in `before` (one comparison)."""
    now = shard_norms(params)
    common = [p for p in params if id(p) in now and id(p) in before]
    if not common:
        return []
    a, b = torch.stack([now[id(p)] for p in common]), torch.stack([before[id(p)] for p in common])
    differs = ~((a == b) | (a.isnan() & b.isnan()))  # a NaN gradient unwritten is not "changed"
    return [p for p, d in zip(common, differs.tolist(), strict=True) if d]


def same(param: Tensor, shot: Snapshot) -> bool:
    """`param.grad` is the very tensor of `shot`, unwritten since (False if it had none then or now)."""
    seen = shot.get(id(param))
    return (
        seen is not None
        and param.grad is not None
        and seen[0]() is param.grad
        and param.grad._version == seen[1]
    )


class DenseGradWatch:
    """Snapshots of the dense gradients at the end of the last backward and of the last `step()`."""

    def __init__(self) -> None:
        self.after_backward: Snapshot | None = None
        self.after_step: Snapshot = {}
        self.shards_after_backward: ShardNorms = {}
        self.peaks_after_backward: ShardNorms = {}

    def backward_finished(self, params: Sequence[Tensor]) -> None:
        self.after_backward = snapshot(params)
        self.shards_after_backward = shard_norms(params)
        self.peaks_after_backward = shard_peaks(params)

    def step_finished(self, params: Sequence[Tensor]) -> None:
        self.after_step, self.after_backward, self.shards_after_backward = snapshot(params), None, {}
        self.peaks_after_backward = {}

    def accept_unscale(self, params: Sequence[Tensor], inv_scale: Tensor) -> bool:
        """A GradScaler unscaled the dense gradients by `inv_scale` since the last backward (its `step()`
        calls ours): where every DTensor shard's largest magnitude is exactly what that unscale makes of
        the one at backward's end, take the shards as they are now for the baseline (the unscale is not
        the user's clip) and return True. Otherwise change nothing and return False: a clip after the
        unscale shrank a shard's peak, and `changed_since_backward` still names it."""
        if self.after_backward is None:
            return False
        before, now = self.peaks_after_backward, shard_peaks(params)
        common = [pid for pid in now if pid in before]
        if common:
            expected = torch.stack([unscaled_peak(before[pid], inv_scale).float() for pid in common])
            seen = torch.stack([now[pid].float() for pid in common])  # (exact: fp16/bf16 fit in fp32)
            if not bool(((seen == expected) | (seen.isnan() & expected.isnan())).all()):
                return False
        self.shards_after_backward = shard_norms(params)
        self.peaks_after_backward = now
        return True

    def changed_since_backward(self, params: Sequence[Tensor]) -> list[Tensor]:
        """Dense tensors whose gradient was written or replaced after the last backward ended (none
        when no backward was seen ending: nothing to compare with)."""
        shot = self.after_backward
        if shot is None:
            return []
        replaced = [p for p in params if p.grad is not None and not same(p, shot)]
        gone = set(map(id, replaced))
        # `zero_grad(set_to_none=False)` writes zeros, which no clip makes of a gradient (its factor is
        # > 0) and whose step plain torch takes: a zeroing, not the user's clip. Plain tensors only: a
        # DTensor's `any()` would be a collective, and its ranks could answer apart.
        replaced = [p for p in replaced if p.grad is not None and (is_dtensor(p.grad) or bool(p.grad.any()))]
        kept = [p for p in params if id(p) not in gone]
        return replaced + rewritten(kept, self.shards_after_backward)

    def stale(self, params: Sequence[Tensor]) -> bool:
        """Every dense gradient present is the one the last `step()` already applied (and at least one
        is present): no gradient arrived since."""
        present = [p for p in params if p.grad is not None]
        return bool(present) and all(same(p, self.after_step) for p in present)
