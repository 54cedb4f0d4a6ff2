"""Process-wide registry: expert parameter -> (optimizer, slot id) for code that cannot hold references.

The compiled graph names an expert tensor by an integer slot baked into its update node; the dynamo
backend finds slots by the IDENTITY of the parameter objects it receives as example inputs. Entries
are weak, so a dropped model or optimizer leaves nothing behind.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from sonar_fx.optim.optimizer import SonarOptimizer


@dataclass(frozen=True)
class Slot:
    slot_id: int
    param_ref: weakref.ref[Tensor]
    optimizer_ref: weakref.ref[SonarOptimizer]


_counter = itertools.count()
_by_id: dict[int, Slot] = {}
# Keyed by id(): tensors compare element-wise, so they cannot be dictionary keys by value. A stale id
# (its tensor gone, the id reused) is caught by checking the slot's weak reference.
_by_param_id: dict[int, Slot] = {}


def register(optimizer: SonarOptimizer, param: Tensor) -> int:
    """Give `param` a slot owned by `optimizer` (re-registering moves it to the new optimizer)."""
    slot = Slot(next(_counter), weakref.ref(param), weakref.ref(optimizer))
    _by_id[slot.slot_id] = slot
    _by_param_id[id(param)] = slot
    return slot.slot_id


def slot_of(param: object) -> int | None:
    """The slot of an expert parameter, or None for any other object."""
    slot = _by_param_id.get(id(param)) if isinstance(param, Tensor) else None
    return None if slot is None or slot.param_ref() is not param else slot.slot_id


def update_from_slot(slot_id: int, grad: Tensor, *, path: str) -> None:
    """Apply the owning optimizer's expert update to the parameter in `slot_id`."""
    slot = _by_id.get(slot_id)
    param = slot.param_ref() if slot else None
    optimizer = slot.optimizer_ref() if slot else None
    if param is None or optimizer is None or _by_param_id.get(id(param)) is not slot:
        raise RuntimeError(
            f"Sonar update slot {slot_id} is stale: its parameter or optimizer is gone, or the model was "
            "prepared again. Recompile the model after sonar_fx.prepare / sonar_fx.compile."
        )
    optimizer.update_expert_(param, grad, path=path)


def optimizer_of(slot_id: int) -> SonarOptimizer | None:
    """The optimizer owning `slot_id`, if it is still alive."""
    slot = _by_id.get(slot_id)
    return slot.optimizer_ref() if slot else None
