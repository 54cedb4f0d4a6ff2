"""The optimizer's surface beyond the training loop: a param group added mid-run, torch flags Sonar does
not compute (in a torch state dict, or edited into a group), a user's gradient hook on an expert tensor,
options no config has, and a scheduler cycling a field a rule never reads. Each either trains exactly as
plain torch written here (`torch.equal`, with a control that the compared tensors moved) or is refused
with a SonarUsageError naming the setting, with every weight unchanged by the refused call."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sonar_fx
from sonar_fx.errors import UnsupportedOptionError
from sonar_fx.models import build_model
from sonar_fx.optim.matrices import matrix_params
from sonar_fx.optim.rules import end_of_step_optimizer, rule_for
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from helpers import assert_same_weights, batches

CONFIGS = {
    "adamw": sonar_fx.AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
    "sgd": sonar_fx.SGDConfig(lr=5e-2, momentum=0.9, weight_decay=0.01, max_grad_norm=0.5),
    "lion": sonar_fx.LionConfig(lr=1e-3, weight_decay=0.5, max_grad_norm=0.5),
    "muon": sonar_fx.MuonConfig(lr=2e-2, max_grad_norm=0.5),
}
LATE = ("layers.0.mix.weight", "lm_head.weight")  # unfrozen after the first step: a middle one, the head
LATE_LR = 3e-3


def _model(frozen=(), name="tiny-reference"):
    model = build_model(name, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not moved, f"the refused call moved {moved}"


def _sonar(compiler="eager", cfg=CONFIGS["adamw"], frozen=(), name="tiny-reference", **kwargs):
    torch._dynamo.reset()
    return sonar_fx.compile(_model(frozen, name), cfg, compiler=compiler, **kwargs)


def _sonar_step(model, batch):
    model(**batch).loss.backward()
    model.sonar.step()
    model.sonar.zero_grad()


def _dense(model):
    return [p for n, p in model.named_parameters() if p.requires_grad and ".experts." not in n]


# 1 ------------------------------------------------------------------ add_param_group mid-run


class _Twin:
    """Plain torch: the family's end-of-step optimizer over the trainable tensors, the dense gradients
    clipped in model order, experts not; tensors unfrozen later get their own torch optimizer of the
    family's dense rule (per-tensor arithmetic: the same bits as one more group)."""

    def __init__(self, cfg, frozen):
        self.cfg, self.model = cfg, _model(frozen)
        layers = sonar_fx.ExpertSet.discover(self.model).layers
        matrices = [t.param for layer in layers for t in layer.tensors] + matrix_params(
            cfg, self.model, layers
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizers = [end_of_step_optimizer(cfg, params, matrices=matrices)]

    def add(self, names, lr):
        tensors = [self.model.get_parameter(n).requires_grad_(True) for n in names]
        self.optimizers.append(rule_for(self.cfg).torch_optimizer([{"params": tensors, "lr": lr}], self.cfg))

    def step(self, batch):
        self.model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(_dense(self.model), self.cfg.max_grad_norm)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    ("name", "compiler", "schedule"),
    [
        ("adamw", "eager", "in_backward"),
        ("sgd", "eager", "in_backward"),
        ("lion", "eager", "in_backward"),
        ("muon", "eager", "in_backward"),
        ("adamw", "aot_eager", "in_backward"),
        ("adamw", "eager", "deferred"),
    ],
)
def test_a_group_added_mid_run_trains_as_torchs(name, compiler, schedule, monkeypatch):
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "warn")  # the reference model's experts: kept whole, warned
    cfg, (b0, b1, b2) = CONFIGS[name], batches(3)
    model = _sonar(compiler, cfg, frozen=LATE, schedule=schedule)
    twin = _Twin(cfg, frozen=LATE)
    # The deferred schedule says once that it kept the reference model's expert gradients whole.
    with pytest.warns(UserWarning, match="whole") if schedule == "deferred" else contextlib.nullcontext():
        _sonar_step(model, b0)
    twin.step(b0)
    after_first = _weights(model)
    opt = model.sonar
    opt.add_param_group(
        {"params": [model.get_parameter(n).requires_grad_(True) for n in LATE], "lr": LATE_LR}
    )
    twin.add(LATE, LATE_LR)
    assert opt.param_groups[-1]["lr"] == LATE_LR
    for b in (b1, b2):
        _sonar_step(model, b)
        twin.step(b)
    assert all(not torch.equal(model.get_parameter(n), after_first[n]) for n in LATE), "the new group trains"
    assert_same_weights(model, twin.model)


def test_a_group_added_mid_run_keeps_the_torch_state_dict_layout():
    """The added group carries the fused twin's keys, and the model order covers the new tensors, so the
    state converts to one torch group in the model's order and continues there bitwise."""
    (b0, b1, b2, b3), frozen = batches(4), ("lm_head.weight",)
    model, twin = _sonar(frozen=frozen), _Twin(CONFIGS["adamw"], frozen=frozen)
    _sonar_step(model, b0)
    twin.step(b0)
    model.sonar.add_param_group({"params": [model.lm_head.weight.requires_grad_(True)]})
    twin.add(frozen, CONFIGS["adamw"].lr)
    _sonar_step(model, b1)
    twin.step(b1)
    plain = _model()  # every tensor trainable now, as in the sonar model
    plain.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(plain.parameters(), fused=True)
    torch_opt.load_state_dict(sonar_fx.to_torch_state_dict(model.sonar, single_group=True))
    for b in (b2, b3):
        plain(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(_dense(plain), CONFIGS["adamw"].max_grad_norm)
        torch_opt.step()
        torch_opt.zero_grad()
        twin.step(b)
    assert_same_weights(plain, twin.model)


def test_add_param_group_refusals_change_nothing():
    model = _sonar(frozen=("lm_head.weight",))
    opt, before = model.sonar, _weights(model)
    groups = len(opt.param_groups)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"expert tensor.*requires_grad_"):
        opt.add_param_group({"params": [opt.expert_group["params"][0]]})
    _unchanged(model, before)
    model(**batches(1)[0]).loss.backward()  # the experts move here; the dense tensors wait for step()
    dense_before = {n: w for n, w in _weights(model).items() if ".experts." not in n}
    with pytest.raises(sonar_fx.SonarUsageError, match="between backward and step"):
        opt.add_param_group({"params": [model.lm_head.weight.requires_grad_(True)]})
    assert len(opt.param_groups) == groups
    opt.step()  # the step goes on without the refused group
    model.lm_head.weight.requires_grad_(False)
    assert all(
        not torch.equal(model.get_parameter(n), w) for n, w in dense_before.items() if n != "lm_head.weight"
    )
    muon = _sonar(cfg=CONFIGS["muon"], frozen=("lm_head.weight",))
    with pytest.raises(sonar_fx.SonarUsageError, match=r"Muon's momentum.*AdamW"):
        muon.sonar.add_param_group({"params": [muon.lm_head.weight], "momentum": 0.9})
    assert len(muon.sonar.param_groups) == 3


# 2 ------------------------------------------------------ torch flags Sonar does not compute


def _torch_state(**flags):
    """A torch AdamW's state dict over Sonar's two groups after two steps, with `flags` in its groups."""
    model = _model()
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    fused = {"fused": True} if not {"foreach", "fused"} & flags.keys() else {}
    opt = torch.optim.AdamW([{"params": _dense(model)}, {"params": experts}], lr=1e-2, **fused, **flags)
    for b in batches(2):
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


@pytest.mark.parametrize(
    "flags",
    [
        {"amsgrad": True},
        {"maximize": True},
        {"foreach": True},
        {"fused": None},  # torch's for-loop AdamW: other last bits than the fused kernel
    ],
)
def test_load_torch_state_dict_refuses_flags_sonar_does_not_compute(flags):
    model = _sonar()
    (flag,) = flags
    state = _torch_state(**flags)
    assert state["param_groups"][0][flag] == flags[flag]
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in model.sonar.param_groups]
    with pytest.raises(sonar_fx.SonarUsageError, match=rf"{flag}={flags[flag]!r}.*does not compute"):
        sonar_fx.load_torch_state_dict(model.sonar, state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in model.sonar.param_groups] == groups_before
    assert not model.sonar.state  # nothing loaded


def test_load_torch_state_dict_refuses_another_weight_decay_capturable_differentiable():
    """Flags a CPU torch AdamW cannot step with here (or Adam's decay) set in a fused twin's state."""
    model = _sonar()
    state = _torch_state()
    for flag, value, fix in [
        ("decoupled_weight_decay", False, "AdamConfig"),
        ("capturable", True, "CUDA graph"),
        ("differentiable", True, "no_grad"),
    ]:
        edited = {**state, "param_groups": [{**g, flag: value} for g in state["param_groups"]]}
        with pytest.raises(sonar_fx.SonarUsageError, match=rf"{flag}={value}.*{fix}"):
            sonar_fx.load_torch_state_dict(model.sonar, edited)
        assert not model.sonar.state
    sonar_fx.load_torch_state_dict(model.sonar, state)  # control: the fused twin's own flags load
    assert model.sonar.state


@pytest.mark.parametrize(
    ("compiler", "name", "group", "flag"),
    [
        ("eager", "adamw", "experts", "maximize"),
        ("eager", "adamw", "dense", "amsgrad"),
        ("eager", "sgd", "dense", "maximize"),
        ("aot_eager", "adamw", "experts", "maximize"),
    ],
)
def test_a_flag_edited_mid_run_is_refused_before_any_weight_moves(compiler, name, group, flag):
    model = _sonar(compiler, CONFIGS[name])
    b0, b1 = batches(2)
    _sonar_step(model, b0)
    target = next(g for g in model.sonar.param_groups if g["name"] == group)
    target[flag] = True
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=rf"'{group}' has {flag}=True"):
        model(**b1).loss.backward()  # the first expert update of the step checks every group
    _unchanged(model, before)
    model.sonar.abandon_step()
    target[flag] = False  # control: the same step goes on once the flag is back
    _sonar_step(model, b1)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_flag_edited_between_backward_and_step_is_refused_at_step():
    model = _sonar()
    model(**batches(1)[0]).loss.backward()
    model.sonar.dense_group["maximize"] = True
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match="'dense' has maximize=True"):
        model.sonar.step()
    _unchanged(model, before)


# 3 ------------------------------------------------- a user's gradient hook on an expert tensor


def _halve(grad):
    return grad * 0.5


@pytest.mark.parametrize("schedule", ["in_backward"])
def test_a_users_hook_on_an_expert_runs_in_eager_sonar_exactly_as_in_torch(schedule, monkeypatch):
    """Eager, autograd hands the gradient to the hook first: the in-backward hook path. (Under the
    deferred schedule the reference model's kernel keeps its operands eagerly, so such a hook is
    refused: the test below.)"""
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "warn")  # kept whole: warned, not refused
    cfg, data = CONFIGS["adamw"], batches(3)
    model = _sonar(schedule=schedule)
    twin = _Twin(cfg, frozen=())
    hooked = "layers.1.mlp.experts.down_proj"
    model.get_parameter(hooked).register_hook(_halve)
    twin.model.get_parameter(hooked).register_hook(_halve)
    unhooked = _Twin(cfg, frozen=())
    # The deferred schedule says once that it kept these gradients whole (no saving without a graph).
    with pytest.warns(UserWarning, match="whole") if schedule == "deferred" else contextlib.nullcontext():
        for b in data:
            _sonar_step(model, b)
            twin.step(b)
            unhooked.step(b)
    assert_same_weights(model, twin.model)
    # control: the hook changes the update, so the comparison can fail
    assert not torch.equal(model.get_parameter(hooked), unhooked.model.get_parameter(hooked))


@pytest.mark.parametrize(
    ("compiler", "schedule", "name"),
    [
        ("aot_eager", "in_backward", "tiny-reference"),  # the graph consumes the gradient
        ("aot_eager", "deferred", "tiny-reference"),  # the graph keeps its operands instead
        ("eager", "deferred", "tiny-olmoe"),  # grouped_mm keeps its operands, eagerly
        ("eager", "deferred", "tiny-reference"),  # and the reference kernel's grouped GEMM
    ],
)
def test_a_users_hook_the_update_would_skip_is_refused_naming_it(compiler, schedule, name):
    model = _sonar(compiler, schedule=schedule, name=name)
    hooked = ("model." if name == "tiny-olmoe" else "") + "layers.1.mlp.experts.down_proj"
    model.get_parameter(hooked).register_hook(_halve)
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=rf"{hooked} has a gradient hook of yours \(_halve"):
        model(**batches(1)[0]).loss.backward()
    _unchanged(model, before)


# 4 ------------------------------------------------------------------ options no config has


@pytest.mark.parametrize(
    ("config", "option", "alternative"),
    [
        (sonar_fx.AdamWConfig, "maximize", "negative"),
        (sonar_fx.AdamWConfig, "amsgrad", "torch.optim.AdamW\\(amsgrad=True\\)"),
        (sonar_fx.AdamWConfig, "foreach", "fused kernel"),
        (sonar_fx.AdamConfig, "fused", "fused kernel"),
        (sonar_fx.SGDConfig, "differentiable", "no_grad"),
        (sonar_fx.AdamWConfig, "decoupled_weight_decay", "AdamConfig"),
        (sonar_fx.MuonConfig, "betas", "adamw_betas"),
        (sonar_fx.LionConfig, "momentum", "betas\\[1\\]"),
        (sonar_fx.AdamWConfig, "weight_decy", "did you mean weight_decay"),
    ],
)
def test_an_option_no_config_has_names_the_option_and_the_alternative(config, option, alternative):
    with pytest.raises(UnsupportedOptionError, match=rf"{config.__name__}\({option}=.*{alternative}") as err:
        config(**{option: True})
    assert err.value.option == option
    assert isinstance(err.value, sonar_fx.SonarUsageError) and isinstance(err.value, TypeError)


# 5 ------------------------------------------------------- schedulers that cycle momentum


def test_muon_momentum_cycled_through_betas_is_refused_before_any_weight_moves():
    model = _sonar(cfg=CONFIGS["muon"])
    torch.optim.lr_scheduler.OneCycleLR(model.sonar, max_lr=2e-2, total_steps=4)  # cycle_momentum=True
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"cycle_momentum.*'experts'.*momentum"):
        model(**batches(1)[0]).loss.backward()
    _unchanged(model, before)


def test_muon_with_onecycle_lr_alone_trains():
    """Control: the same scheduler without momentum cycling is accepted and trains."""
    model = _sonar(cfg=CONFIGS["muon"])
    sched = torch.optim.lr_scheduler.OneCycleLR(model.sonar, max_lr=2e-2, total_steps=4, cycle_momentum=False)
    before = _weights(model)
    _sonar_step(model, batches(1)[0])
    sched.step()
    assert model.sonar.expert_group["momentum"] == CONFIGS["muon"].momentum
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if ".experts." in n)
