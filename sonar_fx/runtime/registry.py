"""Which optimizer owns an expert parameter, found at run time from any tensor that aliases it.

Entries are weak both ways (the parameter and its owner), so a dropped model or optimizer leaves
nothing behind and nothing here keeps one alive. Keyed by `id()`: tensors compare element-wise, so
they cannot be dictionary keys by value; a stale id (tensor gone, id reused) fails the weak check.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from sonar_fx.runtime.engine import GradientFate
from sonar_fx.runtime.meter import ExpertGradMeter


class ExpertOwner(Protocol):
    """What the runtime calls: the owner applies its update to `param` with `grad`, now, and counts
    its expert gradients' lifetimes on `meter`."""

    meter: ExpertGradMeter

    def update_expert_(self, param: Tensor, grad: Tensor, *, path: str, reduced: str = "") -> None: ...

    def defer_expert_(self, param: Tensor, recipe: str, operands: list[Tensor]) -> None: ...

    def not_accumulated(self, param: Tensor, fate: GradientFate) -> None:
        """The running backward does not add to `param`'s `.grad` (`engine.GradientFate`): record that
        its update was left out, or refuse the backward."""

    def keep_whole_(self, param: Tensor) -> None: ...


class UnboundExpertError(RuntimeError):
    """A gradient reached an in-backward update for a tensor that no live Sonar optimizer owns."""


@dataclass(frozen=True)
class _Binding:
    param: weakref.ref[Tensor]
    owner: weakref.ref[ExpertOwner]


_bindings: dict[int, _Binding] = {}


def bind(param: Tensor, owner: ExpertOwner) -> None:
    """Make `owner` the one that updates `param` (re-binding moves it to the new owner)."""
    key = id(param)

    def forget(_: object) -> None:
        if (b := _bindings.get(key)) is not None and b.param() is None:
            del _bindings[key]

    _bindings[key] = _Binding(weakref.ref(param, forget), weakref.ref(owner))


def owner_of(param: Tensor) -> ExpertOwner | None:
    """The live owner of the expert parameter `param` (the object itself, not a view), or None."""
    binding = _bindings.get(id(param))
    if binding is None or binding.param() is not param:
        return None
    return binding.owner()


def bound() -> list[tuple[Tensor, ExpertOwner]]:
    """Every live (parameter, owner) binding in this process."""
    pairs = ((b.param(), b.owner()) for b in list(_bindings.values()))
    return [(p, o) for p, o in pairs if p is not None and o is not None]


def resolve(alias: Tensor) -> tuple[Tensor, ExpertOwner]:
    """The expert parameter behind `alias` (itself, a view of it, or a tensor on its storage) and its
    owner. Raises `UnboundExpertError` when none is bound: the update must never go elsewhere."""
    root = alias._base if alias._base is not None else alias
    owner = owner_of(root)
    if owner is not None:
        return root, owner
    for binding in list(_bindings.values()):  # a saved alias that is not a view object of the param
        param, owner = binding.param(), binding.owner()
        if param is not None and owner is not None and same_storage(param, alias):
            return param, owner
    raise UnboundExpertError(
        f"a compiled backward graph produced the gradient of an expert tensor {tuple(alias.shape)} "
        f"{alias.dtype} that no live SonarOptimizer owns. The graph was compiled by Sonar and reused for "
        "a module that is not prepared (another model or copy of the same class), or the optimizer was "
        "deleted. Prepare every model you train with sonar_fx.prepare / sonar_fx.compile and keep its "
        "optimizer (model.sonar) alive."
    )


def same_storage(a: Tensor, b: Tensor) -> bool:
    """`a` and `b` live in one storage (never for meta tensors, which have none). A DTensor (an FSDP2
    shard) has no storage of its own: its local tensor's counts."""
    a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
    if a.device != b.device or a.device.type == "meta":
        return False
    return storage_key(a) == storage_key(b)


def storage_key(t: Tensor, *, fake: bool | None = None) -> int:
    """Which storage `t` lives in: its address, or for a fake tensor (`sonar_fx.plan` runs the deferred
    step on them, and every fake storage's address is 0) the storage object's identity. `fake`: whether
    `t` is one, where the caller knows already (the question costs more than the rest)."""
    storage = t.untyped_storage()
    return int(storage._cdata) if (is_fake(t) if fake is None else fake) else storage.data_ptr()


def bound_count() -> int:
    """Live bindings in this process (for tests of lifetimes)."""
    return sum(1 for b in _bindings.values() if b.param() is not None and b.owner() is not None)
