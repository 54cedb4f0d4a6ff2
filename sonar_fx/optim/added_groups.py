"""`add_param_group` mid-run: tensors unfrozen later (a head, an adapter) join as a dense group.

torch's `Optimizer.add_param_group` fills a group's missing hyper-parameters from the defaults and steps
it from then on; so does Sonar, at `step()`, with the config's dense rule (for MuonConfig the recipe's
AdamW, `cfg.adamw`, as for the embeddings and the head), clipped with the other dense gradients. Beyond
torch's bookkeeping Sonar needs the new tensors in its own indexes (the model order the dense norm sums
in, the names its messages use) and gives the group its rule's torch keys (`fused=True`, ...), so the
state dict still loads into the torch twin. Refused at the call, before anything changes: expert tensors
(the experts group updates them in backward), a step in progress (its experts already moved), a
distributed engine (built without the tensor) and Muon's own keys (hidden matrices are chosen at
prepare). Never steps anything itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor, nn

from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.muon import HYPER as MUON_HYPER
from sonar_fx.optim.step_tracker import StepTracker
from sonar_fx.optim.untracked import UntrackedGradients
from sonar_fx.optim.update_rule import UpdateRule


class Optimizer(Protocol):
    """What this module reads and writes of `SonarOptimizer` (which imports this module)."""

    param_groups: list[dict[str, Any]]
    rule: UpdateRule
    matrix_rule: UpdateRule | None
    distributed: Any
    tracker: StepTracker
    deferred: DeferredGrads
    untracked: UntrackedGradients | None
    _norm_rank: list[int]
    _labels: list[str | None]

    experts: ExpertSet

    def _index_params(self) -> None: ...


def add_param_group(
    opt: Optimizer, param_group: dict[str, Any], torch_add: Callable[[dict[str, Any]], None]
) -> None:
    """Add `param_group` to `opt` as torch's `add_param_group` (`torch_add`) does, or refuse it."""
    params = param_group["params"]
    tensors = [params] if isinstance(params, Tensor) else list(params)
    _refuse(opt, tensors, param_group)
    group = {**opt.rule.torch_keys(), "name": f"group{len(opt.param_groups)}", **param_group}
    before = len(opt._norm_rank)
    torch_add(group)  # torch's own checks first (a tensor already in a group, a non-leaf, ...)
    added = [p for p in opt.param_groups[-1]["params"]]
    _rank(opt, before, added)


def _refuse(opt: Optimizer, tensors: list[Tensor], group: dict[str, Any]) -> None:
    experts = {id(p) for p in opt.experts.params}  # weight-decay splits included
    if any(id(p) in experts for p in tensors):
        raise SonarUsageError(
            "add_param_group got an expert tensor: Sonar's experts group already holds every expert tensor "
            "and updates it in backward. Unfreeze it (requires_grad_(True)) instead; it trains from the "
            "next backward."
        )
    if opt.tracker.updated or opt.deferred.kept:
        raise SonarUsageError(
            "add_param_group between backward and step(): this step's experts were already updated (or "
            "their gradients kept) without the new tensors in the clip's norm. Add the group after step() "
            "and before the next forward."
        )
    if opt.distributed is not None:
        raise SonarUsageError(
            "add_param_group on a distributed Sonar optimizer: the engine (DDP's buckets, FSDP2's "
            "shards) was built without the new tensors, so their gradients would not be reduced as the "
            "others'. Unfreeze them before wrapping the model and preparing it."
        )
    muon_keys = sorted(set(group) & (set(MUON_HYPER) - {"lr", "weight_decay", "eps"}))
    if opt.matrix_rule is not None and muon_keys:
        raise SonarUsageError(
            f"add_param_group with Muon's {', '.join(muon_keys)}: a group added later is updated by the "
            "recipe's AdamW (as the embeddings and the head are); the matrices Muon updates are chosen at "
            "prepare. Unfreeze hidden matrices before sonar_fx.compile / prepare, or drop those keys."
        )


def _rank(opt: Optimizer, before: int, added: list[Tensor]) -> None:
    """Give the new tensors their place in the model's order (the order the dense norm sums in) and
    their names: from the prepared model when Sonar watches one, else after every tensor held."""
    watched = opt.untracked.model() if opt.untracked is not None else None
    model: nn.Module = watched if watched is not None else nn.Module()
    position = {id(p): i for i, p in enumerate(model.parameters())}
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for g in opt.param_groups for p in g["params"]]
    ranks = opt._norm_rank + list(range(before, before + len(added)))
    order = sorted(range(len(flat)), key=lambda i: (position.get(id(flat[i]), math.inf), ranks[i]))
    new_rank = [0] * len(flat)
    for rank, i in enumerate(order):
        new_rank[i] = rank
    opt._norm_rank = new_rank
    opt._labels = opt._labels + [names.get(id(p)) for p in added]
    opt._index_params()
