"""Trainable tensors that no param group holds: they have a gradient, and nothing ever applies it.

A tensor that becomes trainable after `sonar_fx.compile` / `prepare` (PEFT adapters added later, a
layer unfrozen) is in no param group of `model.sonar`: it never trains and its `.grad` grows at every
backward, with no error. Sonar owns `step()`, so it can see every trainable tensor with a gradient;
this finds those it does not hold and warns once, naming them. It never trains or frees anything.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable

from torch import Tensor, nn


class UntrackedGradients:
    """Watches one model (weakly) for trainable tensors with a gradient outside the param groups."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.warned = False

    def check(self, held: Iterable[Tensor]) -> list[str]:
        """Warn once if the model has such tensors; returns their names (empty once warned)."""
        model = self.model()
        if self.warned or model is None:
            return []
        held_ids = {id(p) for p in held}
        if all(id(p) in held_ids or p.grad is None or not p.requires_grad for p in model.parameters()):
            return []
        names = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None and id(p) not in held_ids
        ]
        self.warned = True
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(
            f"sonar: {len(names)} trainable tensor(s) have a gradient but are in no param group of "
            f"model.sonar ({shown}): they never train, and their .grad grows at every backward. They were "
            "added or unfrozen after sonar_fx.compile / prepare (PEFT adapters, for one). Add them with "
            "model.sonar.add_param_group({'params': [...]}), set requires_grad before sonar_fx.compile, or "
            "freeze them (requires_grad_(False)).",
            stacklevel=3,
        )
        return names
