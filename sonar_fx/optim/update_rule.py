"""The interface of an update rule: how one optimizer updates tensors, each from its own gradient.

A rule is small and stateless: the hyper-parameters its param groups carry, the state a tensor needs,
the fused multi-tensor update, the per-expert ablation, and the end-of-step torch optimizer it must
equal (its "twin"). The rules themselves live in `rules` (fp32 states; Muon's math in `muon`) and
`lowbit` (torchao states).
Never: decide WHEN an update runs, or clip.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sonar_fx.config import OptimizerConfig
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.optim.adamw import grad_like_param

State = dict[str, Any]
"""One tensor's optimizer state, as `torch.optim.Optimizer.state[param]` holds it."""


class UpdateRule(ABC):
    """Base class: see the module docstring. Subclasses set `name` and implement the abstract methods."""

    name = ""

    @abstractmethod
    def defaults(self, cfg: OptimizerConfig) -> dict[str, Any]:
        """The hyper-parameters each param group carries (LR schedulers and `state_dict` see them)."""

    def torch_keys(self) -> dict[str, Any]:
        """The keys beyond the hyper-parameters that the group of this rule's torch twin carries (fused,
        foreach, ...), with the twin's values: a twin that loads Sonar's state dict keeps its settings
        (torch's loader takes every group key from the state dict). None by default."""
        return {}

    def init_state(self, param: Tensor, state: State) -> None:
        """Fill the empty `state` of `param` before its first update (may leave it empty)."""
        return  # default: no state before the first update (SGD creates its momentum there)

    @abstractmethod
    def update_(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[State],
        group: dict[str, Any],
        *,
        found_inf: Tensor | None = None,
    ) -> None:
        """Update every tensor of `params` with its gradient, in place; `found_inf` (0-d float32,
        1.0 = skip) leaves them all untouched without a host sync."""

    def check_experts(self, layers: Sequence[ExpertLayer]) -> None:
        """Refuse expert tensors this rule cannot update in backward, naming the fix (default: none)."""
        return

    def update_slices_(
        self, param: Tensor, grad: Tensor, state: State, group: dict[str, Any], *, found_inf: Tensor | None
    ) -> int:
        """The per-expert ablation: one update call per expert slice `param[e]`; returns the calls."""
        grad = grad_like_param(param, grad)
        for e in range(param.shape[0]):
            sliced = {k: v[e] if isinstance(v, Tensor) and v.dim() else v for k, v in state.items()}
            self.update_([param[e]], [grad[e]], [sliced], group, found_inf=found_inf)
        return param.shape[0]

    @abstractmethod
    def torch_optimizer(self, params: Sequence[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        """The end-of-step optimizer over `params` that this rule's updates equal bitwise."""
