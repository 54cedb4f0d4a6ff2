"""Param-group settings Sonar does not compute, refused before any weight moves.

A torch optimizer reads its flags from each param group at every step (`amsgrad`, `maximize`,
`capturable`, `differentiable`, `fused` / `foreach`, `decoupled_weight_decay`), and a state dict carries
them; Sonar's update rules compute one arithmetic each (torch's fused AdamW, ...) and would ignore any
other value, training silently otherwise than the flag says. So a flag Sonar does not compute is refused
wherever it can arrive: in a torch state dict loaded into Sonar (`torch_state`), and in a group edited
mid-run (checked at every expert update and at `step()`). Likewise a scheduler that cycles a field a
rule never reads (OneCycleLR writes `betas` into Muon's groups, whose momentum is `momentum`).
It only checks; it never changes a group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.optim.checks import refuse_unseen_grad_hooks
from sonar_fx.optim.update_rule import UpdateRule
from sonar_fx.runtime.engine import NO_TASK

GroupRules = Iterable[tuple[dict[str, Any], UpdateRule]]
"""(param group, the rule that updates it), as `SonarOptimizer.group_rules()` gives them."""

UNCOMPUTED_FLAGS: dict[str, str] = {
    "amsgrad": "Sonar keeps no running max of the second moments (AMSGrad)",
    "maximize": "Sonar minimizes; minimize the negative of the objective instead",
    "capturable": "Sonar's updates run from Python, never inside a captured CUDA graph",
    "differentiable": "Sonar's updates run under no_grad",
}
"""Flags of torch's optimizers whose True value asks for arithmetic no Sonar rule computes."""


def refuse_uncomputed_flags(groups: GroupRules, *, where: str) -> None:
    """Raise naming the first group flag whose value asks for other arithmetic than its rule computes:
    a flag of `UNCOMPUTED_FLAGS` set, or an implementation flag (`fused`, `foreach`,
    `decoupled_weight_decay`) other than the rule's own (`UpdateRule.torch_keys`). `where` says where
    the groups come from, for the message."""
    for group, rule in groups:
        name = group.get("name", "a param group")
        for flag, why in UNCOMPUTED_FLAGS.items():
            if group.get(flag):
                _refuse(where, name, flag, group[flag], f"{why}. Set {flag}=False")
        ours = rule.torch_keys()
        for flag in ("foreach", "fused", "decoupled_weight_decay"):  # foreach=True first: fused=None too
            if flag not in ours or flag not in group:
                continue
            value = group[flag]
            # With fused=True, foreach=False or None changes nothing; foreach=True asks for torch's
            # multi-tensor loop, whose arithmetic differs from the fused kernel's in the last bits.
            differs = bool(value) if flag == "foreach" else value != ours[flag]
            if differs:
                _refuse(where, name, flag, value, _implementation_fix(flag, ours))


def _implementation_fix(flag: str, ours: dict[str, Any]) -> str:
    if flag == "decoupled_weight_decay":
        kind = "AdamWConfig" if ours[flag] else "AdamConfig"
        return (
            f"this optimizer is {kind} (decoupled_weight_decay={ours[flag]}); build Sonar with "
            "AdamWConfig for decoupled decay, AdamConfig for L2 decay"
        )
    settings = ", ".join(f"{k}={ours[k]}" for k in ("fused", "foreach"))
    return (
        f"Sonar computes torch's fused kernel only ({settings}),"
        " whose arithmetic differs from torch's foreach and for-loop kernels in the last bits; build the "
        "torch optimizer with fused=True (its state then continues bitwise)"
    )


def refuse_uncycled_momentum(groups: GroupRules) -> None:
    """A scheduler that cycles momentum (OneCycleLR / CyclicLR with cycle_momentum=True) writes one key in
    every group: `betas` when the optimizer's defaults have it (Sonar's do, for AdamW's groups). A Muon
    group reads `momentum`, so its momentum would never cycle, where torch.optim.Muon's does."""
    for group, rule in groups:
        if rule.name == "muon" and "base_momentum" in group:
            raise SonarUsageError(
                f"a scheduler cycles momentum (OneCycleLR or CyclicLR with cycle_momentum=True) through "
                f"`betas`, which Muon's group '{group.get('name')}' does not read: its `momentum` would stay "
                f"{group['momentum']} where torch.optim.Muon's cycles. Pass cycle_momentum=False (Muon's "
                "momentum then stays fixed, as MuonConfig(momentum=) sets it), or set group['momentum'] of "
                "the Muon groups yourself each step."
            )


def _refuse(where: str, group: str, flag: str, value: Any, fix: str) -> None:
    raise SonarUsageError(
        f"{where}: param group '{group}' has {flag}={value!r}, which Sonar does not compute: {fix}."
    )


def refuse_group_edits(groups: GroupRules) -> None:
    """The checks of every expert update and `step()`: a group edited mid-run (`group["maximize"] =
    True`), or a scheduler cycling a field its rule never reads."""
    groups = list(groups)
    refuse_uncomputed_flags(groups, where="a param group edit")
    refuse_uncycled_momentum(groups)


class Optimizer(Protocol):
    """What `refuse_before_update` reads of `SonarOptimizer` (which imports this module)."""

    def group_rules(self) -> list[tuple[dict[str, Any], Any]]: ...

    experts: ExpertSet
    checked_in_backward: tuple[int, str] | None
    """(graph task, path) that `refuse_before_update` last checked: once per backward is enough."""

    def expert_name(self, param: Tensor) -> str: ...


def refuse_before_update(opt: Optimizer, path: str) -> None:
    """The checks of every expert update (or hand-over of its operands, `path="deferred"`), before it
    runs: `refuse_group_edits`, and, where autograd never hands the gradient to a hook of the user's (a
    graph consumed it, or it is computed at `step()`), `checks.refuse_unseen_grad_hooks` over every
    expert tensor, so a hook anywhere is refused before the first expert of the backward moves. Once
    per backward: no loop code runs between two updates of one backward to edit a group or add a hook."""
    task = torch._C._current_graph_task_id()
    if task != NO_TASK and opt.checked_in_backward == (task, path):
        return
    refuse_group_edits(opt.group_rules())
    if path in ("graph", "deferred"):
        refuse_unseen_grad_hooks(opt.experts.params, opt.expert_name, path)
    opt.checked_in_backward = (task, path)
