"""Faults during backward and non-finite gradients: an in-backward update cannot be taken back, so
Sonar must say exactly what a failed step did, recover on request, and never train on inf/NaN.

The fault handling does not depend on the architecture: the tests that train compiled run on the
reference model (same expert layout, a third of a transformers model's trace time); the eager ones,
the dense-tensor names and reentrant checkpointing use the transformers OLMoE."""

from __future__ import annotations

import copy

import pytest
import torch

import sonar_fx
from sonar_fx.errors import InterruptedStepError
from sonar_fx.models import build_model
from sonar_fx.models.tiny import enable_activation_checkpointing
from sonar_fx.optim.step_tracker import StepTracker

from ablations import GRAPH_FAULT, inject_backward_fault, inject_backward_hook_fault, inject_graph_fault
from helpers import CFG, assert_same_weights, batches

COMPILERS = ["eager", "aot_eager"]
UPPER = ["layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"]
"""The experts of the upper layer (reference model): updated before a fault in layer 0's backward."""


def _model(compiler, name="tiny-reference", **kwargs):
    torch._dynamo.reset()
    return sonar_fx.compile(build_model(name, seed=0), CFG, compiler=compiler, **kwargs)


def _step(model, batch, scale=1.0):
    (model(**batch).loss * scale).backward()
    model.sonar.step()
    model.sonar.zero_grad()


def _state(model):
    """Weights and optimizer state, copied."""
    return copy.deepcopy({"model": model.state_dict(), "opt": model.sonar.state_dict()})


def _same_state(a, b):
    flat = lambda d: {  # noqa: E731
        **{("m", k): v for k, v in d["model"].items()},
        **{("s", i, k): v for i, s in d["opt"]["state"].items() for k, v in s.items()},
    }
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_fault_mid_backward_is_reported_and_recovery_is_explicit(compiler):
    model = _model(compiler)
    fault = {"on": False}
    inject_backward_fault(model.layers[0], lambda: fault["on"])
    b0, b1, b2 = batches(3)
    _step(model, b0)
    fault["on"] = True
    with pytest.raises(RuntimeError, match="injected fault"):
        model(**b1).loss.backward()
    fault["on"] = False
    progress = model.sonar.report()["step_in_progress"]
    assert progress["updated"] == sorted(UPPER) and progress["backward_unfinished"]
    with pytest.raises(sonar_fx.InterruptedStepError, match=r"abandon_step\(\)") as err:
        model.sonar.step()
    assert sorted(err.value.updated) == sorted(UPPER)
    model.sonar.zero_grad()  # the usual recovery: skip the batch...
    with pytest.raises(sonar_fx.InterruptedStepError):  # ...is refused with the same clear error
        model(**b2).loss.backward()
    assert sorted(model.sonar.abandon_step()) == sorted(UPPER)
    _step(model, b2)  # training goes on
    report = model.sonar.report()
    assert [sorted(a) for a in report["abandoned_steps"]] == [sorted(UPPER)]
    steps = {
        t.name: int(model.sonar.state[t.param]["step"])
        for layer in model.sonar.expert_layers
        for t in layer.tensors
    }
    assert steps == {name: 3 if name in UPPER else 2 for name in steps}, "the partial update is counted"


def test_restoring_the_last_checkpoint_after_a_fault_equals_an_uninterrupted_run():
    data = batches(3)
    straight = _model("aot_eager")
    for b in data:
        _step(straight, b)

    model = _model("aot_eager")
    fault = {"on": False}
    inject_backward_fault(model.layers[0], lambda: fault["on"])
    _step(model, data[0])
    checkpoint = _state(model)
    fault["on"] = True
    with pytest.raises(RuntimeError, match="injected fault"):
        model(**data[1]).loss.backward()
    fault["on"] = False
    model.sonar.abandon_step()
    model.load_state_dict(checkpoint["model"])
    model.sonar.load_state_dict(checkpoint["opt"])
    for b in data[1:]:
        _step(model, b)
    assert_same_weights(model, straight)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_nonfinite_raise_names_the_tensors_and_touches_nothing(compiler):
    model = _model(compiler)
    b0, b1, b2 = batches(3)
    _step(model, b0)
    before = _state(model)
    with pytest.raises(sonar_fx.NonFiniteGradientError, match="non-finite expert gradients") as err:
        (model(**b1).loss * float("nan")).backward()
    assert sorted(err.value.tensors) == sorted(
        t.name for layer in model.sonar.expert_layers for t in layer.tensors
    )
    with pytest.raises(sonar_fx.InterruptedStepError):
        model.sonar.step()
    model.sonar.abandon_step()
    assert _same_state(before, _state(model)), "a weight or moment moved on a non-finite gradient"
    _step(model, b2)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_nonfinite_skip_equals_never_seeing_the_batch(compiler):
    b0, bad, b1 = batches(3)
    model = _model(compiler, nonfinite="skip")
    _step(model, b0)
    with pytest.warns(UserWarning, match="step skipped"):
        _step(model, bad, scale=float("inf"))
    _step(model, b1)
    clean = _model(compiler, nonfinite="skip")
    _step(clean, b0)
    _step(clean, b1)
    assert_same_weights(model, clean)
    assert _same_state(_state(model), _state(clean)), "moments or step counts differ"
    report = model.sonar.report()
    assert report["skipped_steps"] == 1
    assert report["skipped_updates"] == {
        t.name: 1 for layer in model.sonar.expert_layers for t in layer.tensors
    }


def test_nonfinite_dense_gradient_raises_before_the_dense_update():
    model = _model("eager", "tiny-olmoe")
    b0, b1 = batches(2)
    _step(model, b0)
    model(**b1).loss.backward()
    dense = model.model.embed_tokens.weight
    dense.grad[0, 0] = float("nan")
    before = _state(model)
    with pytest.raises(sonar_fx.NonFiniteGradientError, match=r"model\.embed_tokens\.weight") as err:
        model.sonar.step()
    assert err.value.tensors == ["model.embed_tokens.weight"]
    after = _state(model)
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])


@pytest.mark.parametrize("schedule", ["in_backward", "deferred"])
def test_a_nonfinite_dense_gradient_says_whether_the_experts_moved(schedule):
    """In backward the experts were updated before `step()` saw the dense inf; deferred, none was."""
    model = _model("eager", "tiny-olmoe", schedule=schedule)
    b0, b1 = batches(2)
    _step(model, b0)
    # NaN in backward (the deferred schedule refuses a dense gradient edited between backward and step)
    model.model.embed_tokens.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
    model(**b1).loss.backward()
    before = _state(model)
    said = "updated in backward" if schedule == "in_backward" else "No expert tensor was touched"
    with pytest.raises(sonar_fx.NonFiniteGradientError, match=said):
        model.sonar.step()
    if schedule == "deferred":
        assert _same_state(before, _state(model)), "a weight or moment moved on the refused step"


def test_nonfinite_ignore_trains_on_nan_as_before():
    model = _model("eager", nonfinite="ignore")
    _step(model, batches(1)[0], scale=float("nan"))
    assert all(t.param.isnan().any() for layer in model.sonar.expert_layers for t in layer.tensors)


@pytest.mark.parametrize("where", ["module backward hook", "inside the graph"])
def test_a_fault_inside_a_compiled_backward_is_an_interrupted_step_as_in_eager(where):
    """The whole compiled backward is one autograd node: a fault in the middle of it (a module's backward
    pre-hook, dynamo-compiled into the graph, or an op of the graph itself) leaves the updates above it
    done, and the next backward and step() name them, as in eager."""
    model = _model("aot_eager")
    if where == "module backward hook":
        switch = inject_backward_hook_fault(model.layers[0])
    else:
        inject_graph_fault(model.layers[0])
        switch = GRAPH_FAULT
    b0, b1, b2 = batches(3)
    _step(model, b0)
    switch["on"] = True
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            model(**b1).loss.backward()
    finally:
        switch["on"] = False
    assert model.sonar.report()["step_in_progress"]["updated"] == sorted(UPPER)
    with pytest.raises(sonar_fx.InterruptedStepError, match=r"abandon_step\(\)") as err:
        model(**b2).loss.backward()
    assert sorted(err.value.updated) == sorted(UPPER)
    with pytest.raises(sonar_fx.InterruptedStepError):
        model.sonar.step()
    assert sorted(model.sonar.abandon_step()) == sorted(UPPER)
    _step(model, b2)
    assert model.sonar.report()["updates_in_graph"] == 4 + 2 + 4  # step, the partial one, step


def test_a_fault_under_reentrant_checkpointing_is_an_interrupted_step():
    """Reentrant checkpointing runs each layer's backward as a nested graph task: the end of the first
    one must not pass for the end of the step (the tracker waits for the backward that began at the
    model's outputs), or the next backward would be taken for gradient accumulation."""
    model = _model("eager", "tiny-olmoe")
    assert enable_activation_checkpointing(model, {"use_reentrant": True})
    model.train()
    fault = inject_backward_hook_fault(model.model.layers[0])
    b0, b1, b2 = batches(3)
    _step(model, b0)
    fault["on"] = True
    with pytest.raises(RuntimeError, match="injected fault"):
        model(**b1).loss.backward()
    fault["on"] = False
    with pytest.raises(sonar_fx.InterruptedStepError) as err:
        model(**b2).loss.backward()
    assert sorted(err.value.updated) == sorted(f"model.{name}" for name in UPPER)
    model.sonar.abandon_step()
    _step(model, b2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-olmoe"])
def test_a_full_backward_hook_fault_in_a_transformers_model_is_an_interrupted_step(name):
    """Issue 30, item 8: a full backward hook on an attention projection (a graph break under dynamo)
    that raises mid-backward, on the transformers families under aot_eager: the next backward is the
    InterruptedStepError eager gives, never a false accumulation error."""
    torch._dynamo.reset()
    model = build_model(name, seed=0, num_hidden_layers=3)
    fault = {"on": False}

    def hook(module, grad_input, grad_output):
        if fault["on"]:
            raise RuntimeError("injected fault in a full backward hook")

    model.model.layers[1].self_attn.o_proj.register_full_backward_hook(hook)
    model = sonar_fx.compile(model, CFG, compiler="aot_eager")
    b0, b1, b2 = batches(3)
    _step(model, b0)
    fault["on"] = True
    with pytest.raises(RuntimeError, match="injected fault"):
        model(**b1).loss.backward()
    fault["on"] = False
    upper = sorted(f"model.layers.{i}.mlp.experts.{t}" for i in (1, 2) for t in ("gate_up_proj", "down_proj"))
    assert model.sonar.report()["step_in_progress"]["updated"] == upper
    with pytest.raises(sonar_fx.InterruptedStepError, match=r"abandon_step\(\)") as err:
        model(**b2).loss.backward()
    assert sorted(err.value.updated) == upper
    assert sorted(model.sonar.abandon_step()) == upper
    _step(model, b2)


def test_a_backward_told_again_after_its_updates_is_not_called_one_that_raised():
    """The tracker told twice in one running backward, with an update between: refused (the step is
    partial), and the message says nothing raised instead of blaming a backward that raised part-way.
    A second backward after the first one's end (accumulation) is no such case."""
    tracker = StepTracker("per_microbatch")
    caught: list[InterruptedStepError] = []

    def told_twice(grad):
        tracker.backward_began()
        tracker.record("layers.0.mlp.experts.down_proj")
        with pytest.raises(InterruptedStepError) as err:
            tracker.backward_began()
        caught.append(err.value)
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(told_twice)
    y.sum().backward()
    [error] = caught
    assert "nothing raised" in str(error) and "raised part-way" not in str(error)
    assert "abandon_step()" in str(error) and error.updated == ["layers.0.mlp.experts.down_proj"]

    accumulating = StepTracker("per_microbatch")

    def told_once(grad):
        accumulating.backward_began()
        accumulating.record("layers.0.mlp.experts.down_proj")
        return grad

    for _ in range(2):  # each backward begins once and ends: no error
        y = x * 2
        y.register_hook(told_once)
        y.sum().backward()
        accumulating.backward_finished()
    assert accumulating.interrupted is None and accumulating.backwards == 2
