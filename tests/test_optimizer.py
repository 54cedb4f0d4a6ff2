"""SonarOptimizer behaves like a torch.optim.Optimizer: state, resume, LR schedulers, misuse errors."""

import copy
import io

import pytest
import torch

import sonar_fx
from sonar_fx.models import build_model

from helpers import CFG, assert_same_weights, batches


def _sonar(seed=0, **kwargs):
    model = build_model("tiny-olmoe", seed=seed)
    return model, sonar_fx.compile(model, CFG, compiler="eager", **kwargs).sonar


def _step(model, opt, batch):
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()


def test_param_groups_are_dense_and_experts():
    model, opt = _sonar()
    assert [g["name"] for g in opt.param_groups] == ["dense", "experts"]
    assert len(opt.param_groups[1]["params"]) == 4
    n_params = len(list(model.parameters()))
    assert sum(len(g["params"]) for g in opt.param_groups) == n_params


def test_state_dict_round_trip_resumes_bitwise():
    data = batches(6)
    straight, opt = _sonar()
    for b in data:
        _step(straight, opt, b)

    first, opt1 = _sonar()
    for b in data[:3]:
        _step(first, opt1, b)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    resumed, opt2 = _sonar(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for b in data[3:]:
        _step(resumed, opt2, b)

    assert_same_weights(straight, resumed)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and len(s1) == len(list(straight.parameters()))
    for k in s1:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)


def test_lr_scheduler_drives_expert_updates():
    zero_wd = CFG.__class__(**{**CFG.__dict__, "weight_decay": 0.0})
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.compile(model, zero_wd, compiler="eager").sonar
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)
    experts = [t.param for layer in opt.expert_layers for t in layer.tensors]
    before = [p.detach().clone() for p in experts]
    b0, b1 = batches(2)
    _step(model, opt, b0)
    assert all(torch.equal(p, q) for p, q in zip(experts, before, strict=True)), "lr 0 must not move experts"
    sched.step()
    assert opt.param_groups[1]["lr"] == CFG.lr
    _step(model, opt, b1)
    assert all(not torch.equal(p, q) for p, q in zip(experts, before, strict=True))


def test_second_backward_before_step_raises_with_explanation():
    model, _ = _sonar()
    b0, b1 = batches(2)
    model(**b0).loss.backward()
    with pytest.raises(sonar_fx.SonarUsageError, match="accumulation='per_microbatch'"):
        model(**b1).loss.backward()


def test_per_microbatch_accumulation_is_explicit_and_warns_once():
    model, opt = _sonar(accumulation="per_microbatch")
    b0, b1, b2 = batches(3)
    model(**b0).loss.backward()
    with pytest.warns(UserWarning, match="once per micro-batch"):
        model(**b1).loss.backward()
    opt.step()
    opt.zero_grad()
    model(**b2).loss.backward()
    model(**b2).loss.backward()  # no second warning needed; must not raise
    assert opt.stats.updates["hook"] == 4 * 4


def test_bad_inputs_name_the_fix():
    model = build_model("tiny-olmoe", seed=0)
    with pytest.raises(TypeError, match="AdamWConfig"):
        sonar_fx.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), compiler="eager")
    with pytest.raises(sonar_fx.SonarUsageError, match="fp16"):
        sonar_fx.compile(build_model("tiny-olmoe", dtype=torch.float16), CFG, compiler="eager")
    with pytest.raises(sonar_fx.NoExpertsFoundError, match="experts="):
        sonar_fx.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), CFG, compiler="eager")
    with pytest.raises(ValueError, match="compiler="):
        sonar_fx.compile(model, CFG, compiler="tvm")
    mixed = build_model("tiny-olmoe", seed=0)
    mixed.model.layers[0].mlp.experts.down_proj.data = mixed.model.layers[
        0
    ].mlp.experts.down_proj.data.double()
    with pytest.raises(sonar_fx.SonarUsageError, match="disagree in dtype"):
        sonar_fx.compile(mixed, CFG, compiler="eager")
    prepared = build_model("tiny-olmoe", seed=0)
    sonar_fx.prepare(prepared, CFG)
    with pytest.raises(sonar_fx.SonarUsageError, match="already prepared"):
        sonar_fx.prepare(prepared, CFG)


@pytest.mark.parametrize(
    ("field", "value"), [("lr", -1.0), ("betas", (0.9, 1.0)), ("eps", 0.0), ("weight_decay", -0.1)]
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"AdamWConfig.{field.split('[')[0]}"):
        sonar_fx.AdamWConfig(**{field: value})


def test_config_is_frozen_and_keyword_only():
    cfg = sonar_fx.AdamWConfig(max_grad_norm=None)
    assert not cfg.clips
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        sonar_fx.AdamWConfig(1e-3)  # type: ignore[misc]
    assert copy.deepcopy(cfg) == cfg
