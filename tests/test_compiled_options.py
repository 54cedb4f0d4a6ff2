"""The sonar backend under torch.compile's own options and wrappings (docs/pass.md, "torch.compile's
options"): dynamic shapes, a compile wrapped around a Sonar-compiled model, a user's compiled training
function, fullgraph=True; and the unprepared-model warning, decided by the graph's own expert tensors.

Each exactness claim is `torch.equal` on every weight against the twin written here: the same model
compiled the same way (never prepared), torch AdamW(fused=True) over all parameters, the dense
gradients clipped (`standard_no_expert_clip`). aot_eager here; inductor, where bits can differ, in
test_compiled_inductor.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sonar_fx
from sonar_fx import backend
from sonar_fx.backend import sonar_backend
from sonar_fx.methods import Execution, Method, TrainingMethod, build_method
from sonar_fx.models import build_model
from sonar_fx.runtime import registry

from helpers import CFG, assert_same_weights, batches

SONAR, AOT_EAGER = Method.named("sonar"), Execution(compiler="aot_eager")
LENGTHS = (8, 12)  # one step each: a new sequence length every step


def _steps():
    return [batches(1, seq=n, seed=n)[0] for n in LENGTHS]


def _twin(run, model_name="tiny-reference"):
    """The twin: a model never prepared, run through `run(model)` (its compiled forward or training
    function, returning the loss), torch AdamW(fused=True), dense gradients clipped; trained on `_steps()`."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=torch.bfloat16, seed=0)
    method = build_method("standard_no_expert_clip", model, CFG)
    method.model = run(model)
    for b in _steps():
        method.train_step(b)
    return model


def _sonar(run, model_name="tiny-reference", **compile_kwargs):
    """A Sonar model (compiled with `compile_kwargs`, else prepared) run through `run(model)` and trained
    on `_steps()`; returns it and its optimizer's report."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=torch.bfloat16, seed=0)
    if compile_kwargs:
        opt = sonar_fx.compile(model, CFG, **compile_kwargs).sonar
    else:
        opt = sonar_fx.prepare(model, CFG)
    method = TrainingMethod(SONAR, AOT_EAGER, run(model), opt)
    for b in _steps():
        method.train_step(b)
    return model, opt.report()


def _in_graph_every_step(report, experts=4):
    """Every expert update of every step ran in a graph; no hook, no fallback."""
    counts = (report["updates_in_graph"], report["updates_by_hook"], report["fallbacks"])
    return counts == (len(LENGTHS) * experts, 0, [])


# 1 ---------------------------------------------------------------------------------- dynamic=True


@pytest.mark.slow  # two dynamic-shape compiles: over 10 s on two cores
def test_dynamic_shapes_keep_every_update_in_the_graph_bitwise():
    """dynamic=True makes dynamo restart tracing (TensorifyScalarRestartAnalysis) from inside the
    backend: that signal passes through, so no graph falls back to the hooks; bitwise to the twin
    compiled with the same dynamic=True."""
    twin = _twin(lambda m: torch.compile(m, backend="aot_eager", dynamic=True))
    model, report = _sonar(lambda m: m, compiler="aot_eager", dynamic=True)
    assert _in_graph_every_step(report), report
    assert report["recompiles"] == 0  # one dynamic graph serves every length
    assert_same_weights(model, twin)


def _counted(graphs, compiler="aot_eager"):
    """The sonar backend, appending each graph's example inputs to `graphs`."""

    def count(gm, example_inputs, **kwargs):
        graphs.append(list(example_inputs))
        return sonar_backend(compiler)(gm, example_inputs, **kwargs)

    return count


def _holds_params(example_inputs):
    return any(isinstance(x, torch.nn.Parameter) for x in example_inputs)


def _forward_then_graph_break(model):
    def train_fn(batch):
        out = model(**batch)
        torch._dynamo.graph_break()
        return out.loss * 1.0  # a graph of its own, holding no parameter

    return train_fn


def test_unprepared_warning_depends_on_the_graphs_own_experts_not_on_other_models(monkeypatch):
    """A prepared policy is alive (its experts bound) beside a reference model compiled with the sonar
    backend by mistake: the reference's graph holds unbound expert tensors, so it warns. Control: the
    policy's own graphs (its model, and its loss after a graph break) hold no unbound expert: silent."""
    monkeypatch.setattr(backend, "_warned_unprepared", False)
    torch._dynamo.reset()
    policy = build_model("tiny-reference", seed=0)
    opt = sonar_fx.prepare(policy, CFG)
    assert registry.owner_of(opt.experts.params[0]) is opt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train = torch.compile(_forward_then_graph_break(policy), backend=_counted(graphs := []))
        train(batches(1)[0]).backward()
    assert not [w for w in caught if "sonar backend" in str(w.message)]
    assert [_holds_params(inputs) for inputs in graphs] == [True, False]  # the model; its loss alone
    opt.step()
    reference = build_model("tiny-reference", seed=1)
    compiled = torch.compile(reference, backend=sonar_backend("aot_eager"))
    with pytest.warns(UserWarning, match=r"holds 4 batched expert tensor\(s\) that no Sonar optimizer owns"):
        compiled(**batches(1)[0]).loss.backward()
    assert all(p.grad is not None for p in reference.parameters())  # a plain compile: nothing updated
