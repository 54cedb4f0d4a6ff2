"""The loop contract (default, in-backward schedule): each habit of a training loop that touches
gradients between backward() and step() trains exactly as plain torch, or is refused with a
SonarUsageError naming the fix, with every parameter unchanged by the refused call.

The twin is plain torch: AdamW(fused=True), the dense gradients clipped (`clip_grad_norm_`), experts
not. Models: the reference model (same expert layout as the transformers families, fast to trace)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import sonar_fx
from sonar_fx import backend
from sonar_fx.backend import sonar_backend
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV
from sonar_fx.runtime import update_op

from helpers import (
    CFG,
    assert_same_weights,
    batches,
    expert_params,
    side_backwards_twin,
    train_with_side_backwards,
    weights_differ,
)

COMPILERS = ["eager", "aot_eager"]


def _model(compiler="eager", cfg=CFG, *, reset=True, **kwargs):
    """`reset=False` lets dynamo reuse a graph an earlier test compiled for this model class (graphs
    bind at run time: the reuse is safe, and saves the compile)."""
    if reset:
        torch._dynamo.reset()
    return sonar_fx.compile(build_model("tiny-reference", seed=0), cfg, compiler=compiler, **kwargs)


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not moved, f"the refused call moved {moved}"


def _sonar_step(model, batch):
    model(**batch).loss.backward()
    model.sonar.step()
    model.sonar.zero_grad()


def _dense(model):
    return [p for n, p in model.named_parameters() if ".experts." not in n]


def _torch_step(model, opt, batch):
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(_dense(model), CFG.max_grad_norm)
    opt.step()
    opt.zero_grad()


def _twin(steps, like=None):
    """Plain torch, `steps` steps: the model and its AdamW(fused=True), over every parameter in one
    group, or over the groups of the Sonar model `like` (dense, experts)."""
    model = build_model("tiny-reference", seed=0)
    params = list(model.parameters())
    if like is not None:
        by_name, names = dict(model.named_parameters()), {id(p): n for n, p in like.named_parameters()}
        params = [{"params": [by_name[names[id(p)]] for p in g["params"]]} for g in like.sonar.param_groups]
    opt = torch.optim.AdamW(params, fused=True, **_hyper())
    for b in batches(4)[:steps]:
        _torch_step(model, opt, b)
    return model, opt


def _hyper():
    return dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay)


# 1 ------------------------------------------------------------------ fp16 autocast + GradScaler


@pytest.mark.parametrize("compiler", COMPILERS)
def test_fp16_autocast_with_grad_scaler_is_refused_before_any_update(compiler):
    # nonfinite="skip" and a scale that overflows: the refusal comes first, never the misleading
    # "this looks like gradient accumulation" after the scaler skipped step().
    model = _model(compiler, nonfinite="skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    before = _weights(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batches(1)[0]).loss
    with pytest.raises(sonar_fx.SonarUsageError, match=r"float16 autocast.*schedule='deferred'"):
        scaler.scale(loss).backward()
    _unchanged(model, before)
    assert model.sonar.report()["step_in_progress"]["updated"] == []


def test_bf16_autocast_and_fp16_eval_are_not_refused():
    model = _model("eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batches(1)[0]).loss
    loss.backward()  # bf16 needs no scaler
    model.sonar.step()
    with torch.autocast("cpu", dtype=torch.float16):
        model(**batches(1)[0])  # a forward that never backwards trains nothing


# 2 --------------------------------------------------------------- state dicts to and from torch


def test_sonar_groups_carry_torch_adamw_keys():
    model = _model("eager")
    twin = torch.optim.AdamW(model.parameters(), fused=True, **_hyper()).param_groups[0]
    for group in model.sonar.param_groups:
        assert {k: group[k] for k in twin if k != "params"} == {
            k: v for k, v in twin.items() if k != "params"
        }


@pytest.mark.parametrize("single_group", [True, False])
def test_sonar_state_continues_in_torch_adamw_exactly(single_group):
    sonar = _model("eager")
    for b in batches(4)[:2]:
        _sonar_step(sonar, b)
    model, opt = _twin(0, like=None if single_group else sonar)
    model.load_state_dict(sonar.state_dict())
    opt.load_state_dict(sonar_fx.to_torch_state_dict(sonar.sonar, single_group=single_group))
    assert all(g["fused"] for g in opt.param_groups)
    for b in batches(4)[2:]:
        _torch_step(model, opt, b)
    assert_same_weights(model, _twin(4)[0])


@pytest.mark.parametrize("single_group", [True, False])
def test_torch_adamw_state_continues_in_sonar_exactly(single_group):
    sonar = _model("eager")
    model, opt = _twin(2, like=None if single_group else sonar)
    sonar.load_state_dict(model.state_dict())
    sonar_fx.load_torch_state_dict(sonar.sonar, opt.state_dict())
    assert [g["name"] for g in sonar.sonar.param_groups] == ["dense", "experts"]
    for b in batches(4)[2:]:
        _sonar_step(sonar, b)
    assert_same_weights(sonar, _twin(4)[0])


def test_a_torch_group_layout_sonar_cannot_map_is_refused():
    sonar = _model("eager")
    params = list(sonar.parameters())
    opt = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:6]}, {"params": params[6:]}])
    with pytest.raises(sonar_fx.SonarUsageError, match="3 param groups"):
        sonar_fx.load_torch_state_dict(sonar.sonar, opt.state_dict())


# 4 ------------------------------------------------------------- the user's own clip after backward


@pytest.mark.parametrize("compiler", COMPILERS)
def test_own_clip_while_sonar_clips_is_refused_at_step(compiler):
    model = _model(compiler)
    model(**batches(1)[0]).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"max_grad_norm=None.*abandon_step"):
        model.sonar.step()
    _unchanged(model, before)


def test_own_clip_with_sonar_clip_off_is_exact():
    # The fix the refusal names: Sonar's clip off, the user's clip over model.parameters() sees the
    # dense gradients only (expert .grad stays None), which is the method.
    model = _model("eager", cfg=dataclasses.replace(CFG, max_grad_norm=None))
    for b in batches(3):
        model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)
        model.sonar.step()
        model.sonar.zero_grad()
    assert_same_weights(model, _twin(3)[0])


# 5 -------------------------------------------------------------- step() twice after one backward


def test_second_step_after_one_backward_is_refused():
    model = _model("eager")
    model(**batches(1)[0]).loss.backward()
    model.sonar.step()
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"no backward since the last step.*zero_grad"):
        model.sonar.step()
    _unchanged(model, before)


def test_step_without_gradients_is_a_no_op_as_in_torch():
    model = _model("eager")
    _sonar_step(model, batches(1)[0])
    before = _weights(model)
    model.sonar.step()  # after zero_grad: nothing to apply, as torch's AdamW
    _unchanged(model, before)


# 6 -------------------------------------------------------- a second backward through a retained graph


@pytest.mark.parametrize("compiler", COMPILERS)
def test_second_backward_through_a_retained_graph_is_refused_before_any_update(compiler):
    model = _model(compiler)
    loss = model(**batches(1)[0]).loss
    loss.backward(retain_graph=True)
    before = _weights(model)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"retained graph"):
        loss.backward()
    _unchanged(model, before)


# 7 ------------------------------------------------------------- the sonar backend, model not prepared


def test_sonar_backend_on_an_unprepared_model_warns_once(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(backend, "_warned_unprepared", False)
    model = build_model("tiny-reference", seed=0)
    compiled = torch.compile(model, backend=sonar_backend("aot_eager"))
    with pytest.warns(UserWarning, match=r"sonar_fx\.prepare"):
        compiled(**batches(1)[0]).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch._dynamo.reset()
        compiled(**batches(1)[0]).loss.backward()  # once per process


def test_sonar_backend_on_a_prepared_model_does_not_warn(monkeypatch):
    monkeypatch.setattr(backend, "_warned_unprepared", False)
    torch._dynamo.reset()
    model = build_model("tiny-reference", seed=0)
    opt = sonar_fx.prepare(model, CFG)
    compiled = torch.compile(model, backend=sonar_backend("aot_eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compiled(**batches(1)[0]).loss.backward()
    opt.step()


# 8 ---------------------- side backwards: torch.autograd.grad, backward(inputs=...), create_graph=True


def _sonar_steps(model):
    return lambda: (model.sonar.step(), model.sonar.zero_grad())


@pytest.mark.parametrize("compiler", COMPILERS)
def test_backwards_that_leave_experts_out_train_exactly_as_plain_torch(compiler):
    """A side autograd.grad, backward(inputs=dense + one expert), backward(inputs=dense): each expert
    moves only where torch would have added to its .grad. One compiled graph serves every kind."""
    data = batches(4)[:3]
    model = _model(compiler)
    train_with_side_backwards(model, data, _sonar_steps(model))
    twin = side_backwards_twin(data)
    assert_same_weights(model, twin)
    first, second = expert_params(model)[:2]
    assert not torch.equal(first, expert_params(_model())[0]) and weights_differ(twin, _model())
    report = model.sonar.report()
    if compiler == "aot_eager":
        # Step 0's side call leaves all 4 out, step 1 three, step 2 all 4; updated: 4 + 1.
        assert report["updates_left_out"] == 4 + 3 + 4 and report["updates_in_graph"] == 5
        assert report["graphs_compiled"] == 1 and report["recompiles"] == 0
    assert torch.equal(second, dict(twin.named_parameters())[_name(model, second)])


def test_without_asking_the_engine_a_side_autograd_grad_moves_every_expert(monkeypatch):
    """Teeth: an update op that does not ask the engine (every update accumulates) updates every expert
    in a side autograd.grad of the embedding, and the step's own backward is then refused as
    accumulation, after the weights moved: what the engine's answer prevents."""
    monkeypatch.setattr(update_op, "gradient_fate", lambda param: "accumulate")
    model = _model("aot_eager", reset=False)
    before = _weights(model)
    torch.autograd.grad(model(**batches(1)[0]).loss, _dense(model)[:1])
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {_name(model, p) for p in expert_params(model)}
    with pytest.raises(sonar_fx.SonarUsageError, match="looks like gradient accumulation"):
        model(**batches(1)[0]).loss.backward()


def test_autograd_grad_of_an_expert_is_refused_before_any_weight_moves():
    model = _model("aot_eager", reset=False)
    before = _weights(model)
    with pytest.raises(
        sonar_fx.SonarUsageError, match=r"torch\.autograd\.grad\(\.\.\.\) asked for .*experts"
    ):
        torch.autograd.grad(model(**batches(1)[0]).loss, expert_params(model)[-1:])
    _unchanged(model, before)
    _sonar_step(model, batches(1)[0])  # the refused call left nothing behind: the step is torch's first
    assert_same_weights(model, _twin(1)[0])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("compiler", COMPILERS)
def test_create_graph_backward_is_refused_before_any_weight_moves(compiler):
    """Torch's own compiled backward already refuses create_graph=True while it donates buffers; with
    donation off the graph runs, and Sonar refuses at the first expert update. A side autograd.grad with
    create_graph=True that leaves the experts out is plain torch's (nothing moves)."""
    with torch._functorch.config.patch(donated_buffer=False):
        model = _model(compiler)
        before = _weights(model)
        (grad,) = torch.autograd.grad(model(**batches(1)[0]).loss, _dense(model)[:1], create_graph=True)
        assert grad.requires_grad
        _unchanged(model, before)
        with pytest.raises(sonar_fx.SonarUsageError, match=r"backward\(create_graph=True\) reached"):
            model(**batches(1)[0]).loss.backward(create_graph=True)
        _unchanged(model, before)


def test_backward_after_a_side_backward_that_moved_an_expert_names_it():
    model = _model("aot_eager", reset=False)
    model(**batches(1)[0]).loss.backward(inputs=_dense(model) + expert_params(model)[:1])
    before = _weights(model)
    with pytest.raises(
        sonar_fx.SonarUsageError, match=r"side backward that left 3 expert tensor\(s\) out"
    ) as err:
        model(**batches(1)[0]).loss.backward()
    assert "looks like gradient accumulation" not in str(err.value)
    _unchanged(model, before)


def test_accumulation_after_a_side_autograd_grad_is_still_named_accumulation():
    """The side call left every expert out but updated none: the backward after the step's own one is
    accumulation, and the message says so rather than blaming the side call."""
    model = _model("aot_eager", reset=False)
    torch.autograd.grad(model(**batches(1)[0]).loss, _dense(model)[:1])
    model(**batches(1)[0]).loss.backward()
    with pytest.raises(sonar_fx.SonarUsageError, match="looks like gradient accumulation") as err:
        model(**batches(1)[0]).loss.backward()
    assert "side backward that" not in str(err.value)


def _name(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


# 9 ----------------------------------------------------- the LR set in param_groups after backward

LRS = (1e-2, 4e-3, 1e-3)
"""The LR of each step, set in every param group (the loop of a well-known GPT-2 training script)."""


def _set_lr(opt, lr):
    for group in opt.param_groups:
        group["lr"] = lr


@pytest.mark.parametrize("compiler", COMPILERS)
def test_lr_set_between_backward_and_step_is_refused_before_the_dense_step(compiler):
    model = _model(compiler)
    _sonar_step(model, batches(2)[0])
    model(**batches(2)[1]).loss.backward()  # the experts step here, with lr 1e-2
    _set_lr(model.sonar, LRS[1])
    before = _weights(model)
    with pytest.raises(
        sonar_fx.SonarUsageError, match=r"lr: 0\.01 -> 0\.004.*before the forward.*abandon_step"
    ):
        model.sonar.step()
    _unchanged(model, before)  # no dense tensor moved
    assert model.sonar.abandon_step()  # names the experts that moved; the next step goes on
    _sonar_step(model, batches(3)[2])
    assert model.sonar.report()["updates_by_hook" if compiler == "eager" else "updates_in_graph"] > 0


def _lr_loop(model, opt, *, sonar, lr_after_backward):
    for lr, b in zip(LRS, batches(3), strict=True):
        if not lr_after_backward:
            _set_lr(opt, lr)
        model(**b).loss.backward()
        if lr_after_backward:
            _set_lr(opt, lr)
        if not sonar:
            torch.nn.utils.clip_grad_norm_(_dense(model), CFG.max_grad_norm)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("schedule", ["in_backward", "deferred"])
def test_lr_set_where_the_schedule_reads_it_is_exact(schedule, monkeypatch):
    """The fix the refusal names (the LR set before the forward), and the deferred schedule, which
    reads the LR at step(), with the LR set right before step(): each equal to plain torch."""
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "warn")  # kept whole (below): warned, not refused
    after = schedule == "deferred"
    model = _model("eager", schedule=schedule)
    # The reference model's eager experts are not captured: their gradients are kept whole (said once).
    kept_whole = pytest.warns(UserWarning, match="whole until step") if after else contextlib.nullcontext()
    with kept_whole:
        _lr_loop(model, model.sonar, sonar=True, lr_after_backward=after)
    twin = build_model("tiny-reference", seed=0)
    _lr_loop(twin, torch.optim.AdamW(twin.parameters(), fused=True, **_hyper()), sonar=False,
             lr_after_backward=after)  # fmt: skip
    assert_same_weights(model, twin)
    # Negative control: the same twin with the LR constant trains otherwise.
    constant = _twin(3)[0]
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), constant.parameters(), strict=True))
