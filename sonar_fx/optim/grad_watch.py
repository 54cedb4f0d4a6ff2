"""Which dense gradients changed since a moment of the step: the end of backward, or the last `step()`.

Sonar's `step()` assumes the dense gradients are exactly what backward left (it clips them itself) and
that each backward feeds one step (the experts' gradients are gone once updated). Two loop habits break
that silently: the user's own `clip_grad_norm_` after backward (the dense gradients are clipped twice)
and a second `step()` after one backward (the dense tensors step twice, the experts once). A gradient
written in place bumps its version counter, and a new `.grad` is a new tensor, so a snapshot of
(tensor, version) tells both apart from a fresh gradient. Snapshots hold weak references: a gradient
the user frees is not kept alive. It only looks; it never changes a gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from torch import Tensor

Snapshot = dict[int, tuple["weakref.ref[Tensor]", int]]
"""id(param) -> (weak reference to its .grad, that gradient's version counter)."""


def snapshot(params: Sequence[Tensor]) -> Snapshot:
    """The current gradient of every param that has one."""
    return {id(p): (weakref.ref(p.grad), p.grad._version) for p in params if p.grad is not None}


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

    def backward_finished(self, params: Sequence[Tensor]) -> None:
        self.after_backward = snapshot(params)

    def step_finished(self, params: Sequence[Tensor]) -> None:
        self.after_step, self.after_backward = snapshot(params), None

    def changed_since_backward(self, params: Sequence[Tensor]) -> list[Tensor]:
        """Dense tensors whose gradient was written or replaced after the last backward ended (none
        when no backward was seen ending: nothing to compare with)."""
        shot = self.after_backward
        if shot is None:
            return []
        return [p for p in params if p.grad is not None and not same(p, shot)]

    def stale(self, params: Sequence[Tensor]) -> bool:
        """Every dense gradient present is the one the last `step()` already applied (and at least one
        is present): no gradient arrived since."""
        present = [p for p in params if p.grad is not None]
        return bool(present) and all(same(p, self.after_step) for p in present)
