"""Param groups with a weight decay of their own (`WeightDecayGroup`), as torch.optim param groups.

`SonarOptimizer` builds its groups by role: "dense", "experts" and, for Muon, "dense_matrices". A
config's `weight_decay_groups` name parameters that take another weight decay (transformers' Trainer:
biases and norm weights at 0.0); each such set is split off the group that holds it into a group of
its own, "<role>/weight_decay=<value>", placed after the role groups, with every other key of the group
it left (LR, betas, the torch twin's keys), so an LR scheduler drives it and `state_dict()` holds it.
Where an update runs (in backward, at `step()`) follows the role, never the group.
Never: change a weight decay the config did not name, or accept a name the model does not have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from sonar_fx.config import WeightDecayGroup
from sonar_fx.errors import SonarUsageError

Group = dict[str, Any]


def role_of(group: Mapping[str, Any]) -> str:
    """The role of a Sonar param group ("dense", "experts", "dense_matrices"), split or not."""
    return str(group.get("name", "dense")).partition("/")[0]


def expert_group_of(groups: Sequence[Group], param: Tensor) -> Group:
    """The param group of the expert tensor `param` (whose hyper-parameters its update reads)."""
    experts = [g for g in groups if role_of(g) == "experts"]
    if len(experts) == 1:
        return experts[0]
    return next(g for g in experts if any(p is param for p in g["params"]))


def split_by_weight_decay(
    groups: Sequence[Group], decay_groups: Sequence[WeightDecayGroup], names: Mapping[int, str]
) -> list[Group]:
    """`groups` (role groups, each a dict with "params" and "name") with the parameters each of
    `decay_groups` names moved into groups of their own (one per role group they come from, in the
    model's order within it). `names`: id(param) -> the model's name of every parameter in `groups`."""
    if not decay_groups:
        return list(groups)
    known = set(names.values())
    unknown = [n for g in decay_groups for n in g.params if n not in known]
    if unknown:
        raise SonarUsageError(
            f"weight_decay_groups name {len(unknown)} parameter(s) that are not trainable parameters of the "
            f"model (e.g. {', '.join(unknown[:3])}): a name there that matches nothing would silently keep "
            "the default weight decay. Use the names model.named_parameters() gives, of trainable tensors."
        )
    decay_of = {name: g.weight_decay for g in decay_groups for name in g.params}
    kept: list[Group] = []
    split: list[Group] = []
    for group in groups:
        moved: dict[float, list[Tensor]] = {}
        rest = []
        for p in group["params"]:
            wd = decay_of.get(names.get(id(p), ""))
            if wd is None:
                rest.append(p)
            else:
                moved.setdefault(wd, []).append(p)
        kept.append({**group, "params": rest})
        for wd, params in moved.items():
            split.append({**group, "params": params, "name": f"{group['name']}/weight_decay={wd}",
                          "weight_decay": wd})  # fmt: skip
    return kept + split
