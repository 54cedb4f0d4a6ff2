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
import torch.nn.functional as F

import sonar_fx
from sonar_fx import backend
from sonar_fx.backend import sonar_backend
from sonar_fx.errors import SavingLostError
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.memory import measure_peak
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.backward_root import SONAR_BACKEND_FLAG
from sonar_fx.runtime import registry

from helpers import CFG, assert_same_weights, batches

SEQ_LENGTHS = (8, 12)  # a new sequence length at each step (dynamic shapes)
SAME_LENGTHS = (16, 16)  # one graph for every step (graph counts)


def steps(lengths):
    """One batch of each length: two steps."""
    return [batches(1, seq=n, seed=i)[0] for i, n in enumerate(lengths)]


def loss_of(model):
    """A user's training function: the model's logits, the loss computed here."""

    def train_fn(batch):
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    return train_fn


def model_loss(model):
    """The model's own loss (for a compiled model)."""
    return lambda batch: model(**batch).loss


def twin(run, lengths, model_name="tiny-reference"):
    """The twin: a model never prepared, trained through `run(model)` (a function of a batch that returns
    the loss), torch AdamW(fused=True) over every tensor, dense gradients clipped."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=torch.bfloat16, seed=0)
    method = build_method("standard_no_expert_clip", model, CFG)
    train_fn = run(model)
    for b in steps(lengths):
        train_fn(b).backward()
        method.optimizer_step()
    return model


def sonar(run, lengths, model_name="tiny-reference", **compile_kwargs):
    """The same through Sonar: the model compiled by `sonar_fx.compile(**compile_kwargs)`, or prepared
    when none are given; returns it and its optimizer's report."""
    torch._dynamo.reset()
    model = build_model(model_name, dtype=torch.bfloat16, seed=0)
    opt = (
        sonar_fx.compile(model, CFG, **compile_kwargs).sonar
        if compile_kwargs
        else sonar_fx.prepare(model, CFG)
    )
    train_fn = run(model)
    for b in steps(lengths):
        train_fn(b).backward()
        opt.step()
        opt.zero_grad()
    return model, opt.report()


def compiled_with(backend, train_of=loss_of, **torch_compile_kwargs):
    """A `run` for `twin` and `sonar`: the model's training function, torch.compile'd."""
    return lambda model: torch.compile(train_of(model), backend=backend, **torch_compile_kwargs)


def counted(graphs, compiler="aot_eager", backend=None):
    """The sonar backend for `compiler` (or the dynamo backend named `backend`), appending the example
    inputs of each graph it compiled to `graphs`; delegating to a sonar backend, it is one."""
    compile_graph = sonar_backend(compiler) if backend is None else torch._dynamo.lookup_backend(backend)

    def count(gm, example_inputs, **kwargs):
        compiled = compile_graph(gm, example_inputs, **kwargs)
        graphs.append(list(example_inputs))  # compiled: not a trace dynamo restarts (dynamic=True)
        return compiled

    setattr(count, SONAR_BACKEND_FLAG, backend is None)
    return count


def in_graph_every_step(report, steps=2, experts=4):
    """Every expert update of every step ran in a graph; no hook, no fallback."""
    counts = (report["updates_in_graph"], report["updates_by_hook"], report["fallbacks"])
    return counts == (steps * experts, 0, [])


# 1 ---------------------------------------------------------------------------------- dynamic=True


@pytest.mark.slow  # two dynamic-shape compiles: over 10 s on two cores
def test_dynamic_shapes_keep_every_update_in_the_graph_bitwise():
    """dynamic=True makes dynamo restart tracing (TensorifyScalarRestartAnalysis) from inside the
    backend: that signal passes through, so no graph falls back to the hooks; bitwise to the twin
    compiled with the same dynamic=True."""
    reference = twin(lambda m: model_loss(torch.compile(m, backend="aot_eager", dynamic=True)), SEQ_LENGTHS)
    model, report = sonar(model_loss, SEQ_LENGTHS, compiler="aot_eager", dynamic=True)
    assert in_graph_every_step(report), report
    assert report["recompiles"] == 0  # one dynamic graph serves every length
    assert_same_weights(model, reference)


# 2 ---------------------------------------------------------------- a compile around a Sonar-compiled model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_experts=32, num_layers=4)  # experts dominate


def trained_measuring_the_last_step(train_step, model):
    """Three steps (seq 32); the peak memory of the last, measured while it ran."""
    data = batches(3, seq=32)
    for b in data[:2]:
        train_step(b)
    _, peak = measure_peak(lambda: train_step(data[2]))
    return model, peak.peak_bytes


@pytest.fixture(scope="module")
def outer_twin():
    """The twin under the same outer compile: (trained model, last step's peak, expert layers)."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0, **SHAPE)
    method = build_method("standard_no_expert_clip", model, CFG)
    outer = torch.compile(model, backend="aot_eager")

    def train_step(batch):
        outer(**batch).loss.backward()
        method.optimizer_step()

    return (*trained_measuring_the_last_step(train_step, model), discover_experts(model))


@pytest.mark.parametrize("wrapped", ["model", "function"])
def test_a_compile_around_a_sonar_compiled_model_is_served_by_the_pass(wrapped, outer_twin):
    """`torch.compile(model)` (another backend) over `sonar_fx.compile(model)`, or over a function that
    calls it: the Sonar-compiled forward runs as its own graph (a graph break in the outer one), so the
    pass updates every expert in its backward. Bitwise to the twin under the same outer compile; the
    step's measured peak holds the saving, as the meter's figure does."""
    twin_model, twin_peak, layers = outer_twin
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0, **SHAPE)
    opt = sonar_fx.compile(model, CFG, compiler="aot_eager").sonar
    outer = torch.compile(model if wrapped == "model" else model_loss(model), backend="aot_eager")

    def train_step(batch):
        (outer(**batch).loss if wrapped == "model" else outer(batch)).backward()
        opt.step()
        opt.zero_grad()

    model, peak = trained_measuring_the_last_step(train_step, model)
    assert_same_weights(model, twin_model)
    report = opt.report()
    assert in_graph_every_step(report, steps=3, experts=2 * SHAPE["num_layers"]), report
    predicted = sum(layer.grad_bytes() for layer in layers) - max(layer.grad_bytes() for layer in layers)
    assert twin_peak - peak >= 0.9 * predicted, (twin_peak, peak, predicted)
    measured = report["expert_grad_bytes"]
    assert 0 < measured["measured_peak"] <= measured["one_layer"] and report["saving_lost_bytes"] == 0


def test_a_fullgraph_compile_around_a_sonar_compiled_model_is_refused_before_it_runs():
    """fullgraph=True cannot break the outer graph: dynamo refuses at trace time, before any forward,
    with the reason that names the fix."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0)
    sonar_fx.compile(model, CFG, compiler="aot_eager")
    outer = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(torch._dynamo.exc.Unsupported, match="compile your function with backend='sonar'"):
        outer(**batches(1)[0])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# 3, 4 ------------------------------------------------------------- a user's compiled training function


@pytest.fixture(scope="module")
def train_fn_twin():
    """The twin of a compiled training function: (trained model, the graphs it compiled)."""
    twin_graphs = []
    return twin(compiled_with(counted(twin_graphs, backend="aot_eager")), SAME_LENGTHS), twin_graphs


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_training_function_is_one_graph_as_its_twin_bitwise(fullgraph, train_fn_twin):
    """prepare's forward hook traces to nothing under the sonar backend: the user's training function
    (model and loss) is one graph, as its twin's, and fullgraph=True runs."""
    (reference, twin_graphs), graphs = train_fn_twin, []
    model, report = sonar(compiled_with(counted(graphs), fullgraph=fullgraph), SAME_LENGTHS)
    assert len(graphs) == len(twin_graphs) == 1
    assert in_graph_every_step(report), report
    assert_same_weights(model, reference)


def test_a_compiled_training_function_still_marks_where_each_backward_begins():
    """The hook's job moves to the graph: a second backward before step() is refused as such when it
    begins, before its graph runs, and nothing moves (without the mark it would be taken for
    accumulation at its first update)."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0)
    opt = sonar_fx.prepare(model, CFG)
    train_fn = torch.compile(loss_of(model), backend=sonar_backend("aot_eager"), fullgraph=True)
    batch = steps(SAME_LENGTHS)[0]
    train_fn(batch).backward()
    assert opt.tracker.backwards == 1
    loss = train_fn(batch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(sonar_fx.SonarUsageError, match="a second backward began"):
        loss.backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_another_backend_still_breaks_the_graph_to_watch_it():
    """Negative control: under a backend that is not sonar's the hook stays a graph break (two graphs),
    so the saving guard still sees the foreign graph (the suite raises on a lost saving)."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=torch.bfloat16, seed=0)
    sonar_fx.prepare(model, CFG)
    graphs = []
    train_fn = torch.compile(loss_of(model), backend=counted(graphs, backend="aot_eager"))
    with pytest.raises(SavingLostError, match="backend other than sonar"):
        train_fn(steps(SAME_LENGTHS)[0]).backward()
    assert len(graphs) == 2


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
        train = torch.compile(_forward_then_graph_break(policy), backend=counted(graphs := []))
        train(batches(1)[0]).backward()
    assert not [w for w in caught if "sonar backend" in str(w.message)]
    assert [_holds_params(inputs) for inputs in graphs] == [True, False]  # the model; its loss alone
    opt.step()
    reference = build_model("tiny-reference", seed=1)
    compiled = torch.compile(reference, backend=sonar_backend("aot_eager"))
    owned_by_none = r"holds 4 batched expert tensor\(s\) that no Sonar optimizer owns \(layers\.0\.mlp\."
    with pytest.warns(UserWarning, match=owned_by_none):
        compiled(**batches(1)[0]).loss.backward()
    assert all(p.grad is not None for p in reference.parameters())  # a plain compile: nothing updated
