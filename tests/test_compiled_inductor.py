"""The compiled pass under inductor (the default compiler): exact, cache-safe, and memory-bounded.

Inductor compiles take tens of seconds on two cores, so each compiled run is made once per module
and shared. The AOTAutograd and FX graph caches stay ON here: a cache that served a graph compiled
without the pass would show up as zero in-graph updates or as returned expert gradients.
"""

import pytest
import torch

import sonar_fx
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.memory import measure_peak
from sonar_fx.methods import Execution, Method, TrainingMethod, build_method
from sonar_fx.models import build_model

from helpers import CFG, assert_same_weights, batches, trained
from test_compiled_options import SEQ_LENGTHS, compiled_with, counted, in_graph_every_step, sonar, twin

pytestmark = pytest.mark.slow
SHAPE = dict(hidden_size=64, intermediate_size=128, num_experts=32, num_layers=4)
"""The memory case's model: its expert gradients outweigh its activations, so the saving is measurable."""
MEMORY_CASE = ("tiny-reference", torch.float32)
CASES = [("tiny-olmoe", torch.bfloat16), MEMORY_CASE, ("tiny-granitemoe", torch.bfloat16)]
"""bf16 and fp32, three expert layouts; the fp32 case is also the memory test's (one compile each)."""


@pytest.fixture(scope="module", autouse=True)
def caches_on_and_deterministic():
    # Inductor's CPU embedding backward accumulates in parallel: two runs of the SAME standard arm
    # can differ in fp32. Deterministic kernels make any remaining difference Sonar's own.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(scope="module")
def runs():
    """(method, model, dtype) -> (trained model, TrainingMethod, peak bytes of the last step or None);
    standard compiled FIRST, so a cache keyed without the pass would hand the standard graph to the
    sonar compile."""
    out = {}
    for model_name, dtype in CASES:
        for method in ("standard_no_expert_clip", "sonar"):
            torch._dynamo.reset()
            out[(method, model_name, dtype)] = _trained(method, model_name, dtype)
    return out


def _trained(method_name: str, model_name: str, dtype: torch.dtype):
    """Three compiled steps; in the memory case the last one's peak is measured (CPU allocator events)."""
    if (model_name, dtype) != MEMORY_CASE:
        return (*trained(method_name, model_name, dtype, compiler="inductor"), None)
    model = build_model(model_name, dtype=dtype, **SHAPE)
    method = build_method(method_name, model, CFG, compiler="inductor")
    data = batches(3, seq=32)
    for b in data[:2]:
        method.train_step(b)
    _, peak = measure_peak(lambda: method.train_step(data[2]))
    return model, method, peak.peak_bytes


@pytest.mark.parametrize(("model_name", "dtype"), CASES)
def test_inductor_pass_equals_compiled_standard_no_expert_clip(model_name, dtype, runs):
    sonar_model, method, _ = runs[("sonar", model_name, dtype)]
    twin, _, _ = runs[("standard_no_expert_clip", model_name, dtype)]
    assert_same_weights(sonar_model, twin)
    tensors = sum(len(layer.tensors) for layer in discover_experts(sonar_model))
    report = method.optimizer.report()
    assert report["updates_in_graph"] == 3 * tensors and report["updates_by_hook"] == 0, report
    # A warm AOTAutograd cache serves the pass's graph without re-running the partitioner.
    assert report["graphs_compiled"] + report["graphs_from_cache"] == 1
    assert report["updates_inserted"] == tensors * report["graphs_compiled"]


def test_standard_compiled_after_sonar_still_returns_expert_grads(runs):
    torch._dynamo.reset()
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    method = build_method("standard_no_expert_clip", model, CFG, compiler="inductor")
    method.forward_backward(batches(1)[0])
    layers = discover_experts(model)
    assert all(t.param.grad is not None for layer in layers for t in layer.tensors)


def test_sonar_backend_after_prepare_equals_sonar_compile(runs):
    torch._dynamo.reset()
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    opt = sonar_fx.prepare(model, CFG)
    method = TrainingMethod(
        Method.named("sonar"), Execution(compiler="inductor"), torch.compile(model, backend="sonar"), opt
    )
    for b in batches(3):
        method.train_step(b)
    assert_same_weights(model, runs[("sonar", "tiny-olmoe", torch.bfloat16)][0])
    assert opt.stats.updates == {"graph": 12}


def test_compiled_pass_saves_at_least_90_percent_of_the_prediction(runs):
    """The memory case's last step, compiled standard against compiled sonar: all but the largest
    layer's expert gradients are never alive together."""
    standard_model, _, standard = runs[("standard_no_expert_clip", *MEMORY_CASE)]
    _, _, sonar = runs[("sonar", *MEMORY_CASE)]
    layers = discover_experts(standard_model)
    predicted = sum(layer.grad_bytes() for layer in layers) - max(layer.grad_bytes() for layer in layers)
    assert standard - sonar >= 0.9 * predicted, (standard, sonar, predicted)


def test_a_compiled_training_function_with_dynamic_shapes_equals_its_twin():
    """Issue 43 under inductor, where bits can differ: a user's training function (model and loss)
    compiled with backend sonar and dynamic=True is one graph as its twin's (prepare's hook breaks
    nothing; dynamo's restart passes through the backend), every update in the graph, bitwise."""
    twin_graphs, graphs = [], []
    twin_fn = compiled_with(counted(twin_graphs, backend="inductor"), dynamic=True)
    reference = twin(twin_fn, SEQ_LENGTHS, model_name="tiny-olmoe")
    sonar_fn = compiled_with(counted(graphs, compiler="inductor"), dynamic=True)
    model, report = sonar(sonar_fn, SEQ_LENGTHS, model_name="tiny-olmoe")
    assert len(graphs) == len(twin_graphs) == 1
    assert in_graph_every_step(report), report
    assert_same_weights(model, reference)
