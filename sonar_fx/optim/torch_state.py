"""Moving optimizer state between `SonarOptimizer` and plain `torch.optim.AdamW(fused=True)`, bitwise.

Sonar's state dict is torch's format already (same state tensors, a "dense" then an "experts" group,
each with torch's group keys, fused=True included), so a torch AdamW built over the same two groups
loads it as is. A torch AdamW over ONE group (`AdamW(params)`, params in the model's order) numbers
its tensors in that order: `to_torch_state_dict(opt, single_group=True)` renumbers Sonar's state into
it, and `load_torch_state_dict` takes either layout back. Only Adam(W) has a plain torch twin (SGD,
Lion, Muon and low-bit states are refused). Never changes a tensor: state tensors are shared, not copied.
"""

from __future__ import annotations

from typing import Any

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.group_checks import refuse_uncomputed_flags
from sonar_fx.optim.optimizer import SonarOptimizer

_SONAR_ONLY = ("name",)
"""Group keys torch's optimizers do not have."""


def to_torch_state_dict(opt: SonarOptimizer, *, single_group: bool = False) -> dict[str, Any]:
    """`opt`'s state as `torch.optim.AdamW(fused=True)` (Adam for AdamConfig) loads it: over the groups
    `[opt.dense_group["params"], opt.expert_group["params"]]` (default), or over one group of every
    trainable parameter in the model's order (`single_group=True`, e.g. `AdamW(trainable, fused=True)`
    with `trainable = [p for p in model.parameters() if p.requires_grad]`)."""
    _refuse_no_twin(opt)
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k not in _SONAR_ONLY} for g in sd["param_groups"]]
    if not single_group:
        return {"state": sd["state"], "param_groups": groups}
    rank = _model_ranks(opt)
    hyper = _shared_hyper(groups)
    state = {rank[i]: s for i, s in sd["state"].items()}
    return {"state": state, "param_groups": [{**hyper, "params": list(range(len(rank)))}]}


def load_torch_state_dict(opt: SonarOptimizer, state_dict: dict[str, Any]) -> None:
    """Load the state dict of a torch Adam(W) into `opt`: one over Sonar's groups (dense, experts), or
    one over a single group in the model's order (see `to_torch_state_dict`). Group hyper-parameters
    (the LR a scheduler left, ...) come from `state_dict`, as torch's loader takes them; a flag whose
    arithmetic Sonar does not compute (amsgrad, maximize, capturable, differentiable, a kernel other than
    the fused one, another weight decay) is refused before anything loads (`group_checks`)."""
    _refuse_no_twin(opt)
    groups = state_dict["param_groups"]
    ours = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if len(groups) == len(ours):
        merged = [{**mine, **theirs} for mine, theirs in zip(ours, groups, strict=True)]
        _load(opt, state_dict["state"], merged)
        return
    if len(groups) != 1:
        raise SonarUsageError(
            f"the state dict has {len(groups)} param groups; Sonar loads a torch optimizer's state over "
            f"its own {len(ours)} groups ({', '.join(g['name'] for g in ours)}) or over one group of every "
            "trainable parameter in the model's order."
        )
    rank = _model_ranks(opt)
    if len(groups[0]["params"]) != len(rank):
        raise SonarUsageError(
            f"the single param group holds {len(groups[0]['params'])} tensors but the model has "
            f"{len(rank)} trainable ones: build the torch optimizer over "
            "[p for p in model.parameters() if p.requires_grad]."
        )
    theirs = {k: v for k, v in groups[0].items() if k != "params"}
    flat_of = {r: i for i, r in enumerate(rank)}
    state = {flat_of[r]: s for r, s in state_dict["state"].items()}
    merged, start = [], 0
    for mine, group in zip(ours, opt.param_groups, strict=True):
        n = len(group["params"])
        merged.append({**mine, **theirs, "params": list(range(start, start + n))})
        start += n
    _load(opt, state, merged)


def _load(opt: SonarOptimizer, state: dict[Any, Any], groups: list[dict[str, Any]]) -> None:
    """Load, unless a group's flag asks for arithmetic Sonar does not compute (refused before loading)."""
    rules = [rule for _, rule in opt.group_rules()]
    refuse_uncomputed_flags(zip(groups, rules, strict=True), where="load_torch_state_dict")
    opt.load_state_dict({"state": state, "param_groups": groups})


def _refuse_no_twin(opt: SonarOptimizer) -> None:
    rules = {opt.rule.name, opt.expert_rule.name}
    if len(rules) != 1 or not rules <= {"adamw", "adam"} or opt.matrix_rule is not None:
        raise SonarUsageError(
            f"{opt.cfg.name} (dense rule {opt.rule.name}, expert rule {opt.expert_rule.name}) has no plain "
            "torch optimizer twin to convert its state for: only AdamWConfig and AdamConfig with 32-bit "
            "states do. Use opt.state_dict() / opt.load_state_dict() between Sonar optimizers."
        )


def _model_ranks(opt: SonarOptimizer) -> list[int]:
    """Each of `opt`'s tensors (in Sonar's group order): its position among the model's trainable ones."""
    order = opt.model_order()
    rank = [order[id(p)] for g in opt.param_groups for p in g["params"]]
    if sorted(rank) != list(range(len(rank))):
        raise SonarUsageError(
            "this optimizer was built without the model's parameter order: use single_group=False."
        )
    return rank


def _shared_hyper(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The one set of group settings every group shares; refused when they differ (a single torch group
    cannot hold two LRs)."""
    first = {k: v for k, v in groups[0].items() if k != "params"}
    for g in groups[1:]:
        diff = sorted(k for k in first.keys() | g.keys() if k != "params" and first.get(k) != g.get(k))
        if diff:
            raise SonarUsageError(
                f"Sonar's param groups differ in {', '.join(diff)}, which one torch param group cannot hold: "
                "use single_group=False and a torch optimizer over [dense params, expert params]."
            )
    return first
