"""Param groups with their own weight decay (`WeightDecayGroup`) in a plain loop, against plain torch:
`torch.optim.AdamW(fused=True)` over the same groups, each with its `weight_decay`, as written here.

Every comparison is `torch.equal` on every parameter after 2 steps (fp32 tiny OLMoE), with one expert
tensor in a group of its own (the rule holds for dense and expert tensors alike), both schedules.
"""

from __future__ import annotations

import copy

import pytest
import torch

import sonar_fx
from sonar_fx import WeightDecayGroup
from sonar_fx.config import ConfigFieldError
from sonar_fx.models import build_model

from helpers import assert_same_weights, batches, weights_differ

NO_DECAY_EXPERT = "model.layers.0.mlp.experts.down_proj"
MAX_NORM = 0.05  # the clip is active on every step: the groups meet the clip too


def no_decay_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Norm weights (what transformers' Trainer exempts from decay) and one expert tensor."""
    return (*(n for n, _ in model.named_parameters() if "norm" in n), NO_DECAY_EXPERT)


def cfg(groups: tuple[WeightDecayGroup, ...]) -> sonar_fx.AdamWConfig:
    return sonar_fx.AdamWConfig(
        lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=MAX_NORM, expert_clip="global",
        weight_decay_groups=groups,
    )  # fmt: skip


def torch_twin(model: torch.nn.Module, names: tuple[str, ...]) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    decay = [p for n, p in params.items() if n not in names and n != "lm_head.weight"]
    groups = [
        dict(params=decay),
        dict(params=[p for n, p in params.items() if n in names], weight_decay=0.0),
        dict(params=[params["lm_head.weight"]], weight_decay=0.5),
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def test_weight_decay_groups_equal_torch_adamw_param_groups():
    """Deferred schedule (one clip over every parameter, 2 micro-batches per step): Sonar with three
    weight decays (0.1 default, 0.0 for norms and an expert tensor, 0.5 for the head) is torch's AdamW
    over the same three param groups. Eager: an update reads its group in Python when it runs, whoever
    calls it (hook, graph op, step); the Trainer tests cover the groups compiled with aot_eager."""
    torch._dynamo.reset()
    model = build_model("tiny-olmoe", seed=0)
    twin_model, fresh = copy.deepcopy(model), copy.deepcopy(model)
    names = no_decay_names(model)
    groups = (WeightDecayGroup(params=names, weight_decay=0.0),
              WeightDecayGroup(params=("lm_head.weight",), weight_decay=0.5))  # fmt: skip
    sonar_fx.compile(model, cfg(groups), compiler="eager", schedule="deferred")
    twin = torch_twin(twin_model, names)
    data = batches(4)
    for step in range(2):
        for b in data[2 * step : 2 * step + 2]:
            model(**b).loss.backward()
            twin_model(**b).loss.backward()
        model.sonar.step()
        model.sonar.zero_grad()
        assert torch.nn.utils.clip_grad_norm_(twin_model.parameters(), MAX_NORM) > MAX_NORM
        twin.step()
        twin.zero_grad()
    assert_same_weights(model, twin_model)
    assert NO_DECAY_EXPERT in weights_differ(model, fresh)
    by_name = {g["name"]: g for g in model.sonar.param_groups}
    assert list(by_name) == [
        "dense", "experts", "dense/weight_decay=0.0", "dense/weight_decay=0.5", "experts/weight_decay=0.0",
    ]  # fmt: skip
    assert [model.sonar.expert_name(p) for p in by_name["experts/weight_decay=0.0"]["params"]] == [
        NO_DECAY_EXPERT
    ]


def test_in_backward_expert_updates_read_their_own_group():
    """In-backward (expert updates inside backward, dense-only clip): the expert tensor in a no-decay
    group is updated with weight_decay 0.0; without the groups (negative control) it is decayed (one
    step: only that tensor differs)."""
    runs = []
    for groups in [(WeightDecayGroup(params=(NO_DECAY_EXPERT,), weight_decay=0.0),), ()]:
        model = build_model("tiny-olmoe", seed=0)
        twin_model = copy.deepcopy(model)
        config = sonar_fx.AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None,
                                      weight_decay_groups=groups)  # fmt: skip
        sonar_fx.compile(model, config, compiler="eager")
        twin = torch_twin(twin_model, (NO_DECAY_EXPERT,))
        twin.param_groups[2]["weight_decay"] = 0.1  # the head: the default decay here
        batch = batches(1)[0]
        model(**batch).loss.backward()
        twin_model(**batch).loss.backward()
        model.sonar.step()
        twin.step()
        runs.append(weights_differ(model, twin_model))
    with_groups, without = runs
    assert with_groups == [] and without == [NO_DECAY_EXPERT]


def test_unknown_names_and_overlapping_groups_are_refused():
    model = build_model("tiny-olmoe", seed=0)
    typo = (WeightDecayGroup(params=("model.norm.weights",), weight_decay=0.0),)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"model\.norm\.weights.*named_parameters"):
        sonar_fx.prepare(model, cfg(typo))
    assert getattr(model, "sonar", None) is None
    first = WeightDecayGroup(params=("a", "b"), weight_decay=0.0)
    twice = (first, WeightDecayGroup(params="b", weight_decay=1))
    with pytest.raises(ConfigFieldError, match=r"weight_decay_groups\[1\]\.params=\['b'\]"):
        cfg(twice)
    listed = cfg((WeightDecayGroup(params=["a", "b"], weight_decay=0.0),))  # a list, kept as a tuple
    assert listed.weight_decay_groups[0].params == ("a", "b") and hash(listed)
    with pytest.raises(ConfigFieldError, match=r"weight_decay_groups\[0\]\.weight_decay=-1"):
        cfg((WeightDecayGroup(params=("a",), weight_decay=-1),))
