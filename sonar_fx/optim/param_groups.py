"""`SonarOptimizer`'s param groups, built by role: "dense", "experts" and, for a config with a matrix
rule (Muon), "dense_matrices"; then the config's `weight_decay_groups` split off (`weight_decay`).
Each group carries its rule's torch keys (fused=True, ...), which a torch twin loading the state dict
keeps. Also each parameter's place in the model's order (the order the norms sum in) and its name, per
parameter in param-group order, as plain ints and strings so that copies and pickles keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from sonar_fx.config import OptimizerConfig
from sonar_fx.optim.update_rule import UpdateRule
from sonar_fx.optim.weight_decay import split_by_weight_decay


def build_param_groups(
    cfg: OptimizerConfig,
    rules: tuple[UpdateRule, UpdateRule, UpdateRule | None],
    dense_params: Sequence[nn.Parameter],
    experts: Sequence[nn.Parameter],
    expert_names: dict[int, str],
    *,
    matrices: Sequence[nn.Parameter],
    dense_names: Sequence[str] | None,
    param_order: Sequence[nn.Parameter] | None,
) -> tuple[list[dict[str, Any]], list[int], list[str | None]]:
    """(param groups, each parameter's rank in the model's order, each dense parameter's name) for
    `rules` = (dense rule, expert rule, matrix rule or None)."""
    rule, expert_rule, matrix_rule = rules
    split = {id(p) for p in matrices} if matrix_rule is not None else set()
    groups = [
        dict(params=[p for p in dense_params if id(p) not in split], name="dense", **rule.torch_keys()),
        dict(params=list(experts), name="experts", **expert_rule.defaults(cfg), **expert_rule.torch_keys()),
    ]
    if matrix_rule is not None:
        hidden = [p for p in dense_params if id(p) in split]
        groups.append(dict(params=hidden, name="dense_matrices", **matrix_rule.defaults(cfg),
                           **matrix_rule.torch_keys()))  # fmt: skip
    labels = dict(zip(map(id, dense_params), dense_names or (), strict=False))
    groups = split_by_weight_decay(groups, cfg.weight_decay_groups, {**labels, **expert_names})
    order = list(param_order) if param_order is not None else [*dense_params, *experts]
    rank = {id(p): i for i, p in enumerate(order)}
    flat = [p for g in groups for p in g["params"]]
    return groups, [rank[id(p)] for p in flat], [labels.get(id(p)) for p in flat]
