"""Run-time binding: a compiled graph that dynamo reuses for another module updates THAT module.

Dynamo reuses one graph for every module instance whose guards pass, and parameters are graph inputs
that are not guarded by identity. Each test here reaches the in-graph update through such reuse
(blocks sharing a graph, two models, a deep copy, a graph break per block) and checks with
`torch.equal` that every tensor trains exactly as its twin, and that nothing else moves.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import sonar_fx
from sonar_fx.backend import make_sonar_backend
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.runtime.engine import gradient_fate

from helpers import (
    CFG,
    assert_same_weights,
    batches,
    known_library_failure,
    side_backwards_twin,
    train_with_side_backwards,
    weights_differ,
)

LAYERS = 3  # at least three blocks share one graph


def _model(name="tiny-olmoe", dtype=torch.float32, seed=0):
    return build_model(name, dtype=dtype, seed=seed, num_hidden_layers=LAYERS, use_cache=False)


def _train(model, opt, data, *, micro=1):
    """`opt`: a SonarOptimizer, or a TrainingMethod (whose optimizer_step clips what it should)."""
    step = opt.optimizer_step if hasattr(opt, "optimizer_step") else lambda: (opt.step(), opt.zero_grad())
    for i in range(0, len(data), micro):
        for b in data[i : i + micro]:
            (model(**b).loss / micro).backward()
        step()


def _compile_blocks(model, backend):
    for layer in model.model.layers:
        layer.compile(backend=backend)


def _twin(name, dtype, backend, data, *, micro=1):
    """standard_no_expert_clip with each block compiled by `backend` (None: eager)."""
    twin = _model(name, dtype)
    if backend is not None:
        _compile_blocks(twin, backend)
    _train(twin, build_method("standard_no_expert_clip", twin, CFG), data, micro=micro)
    return twin


def _regional(name, dtype, compiler, data, **kwargs):
    torch._dynamo.reset()
    counters["sonar"].clear()
    model = sonar_fx.compile(_model(name, dtype), CFG, compiler=compiler, regional=True, **kwargs)
    _train(model, model.sonar, data, micro=2 if kwargs.get("accumulation") else 1)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-olmoe", "tiny-qwen3moe"])
def test_regional_compile_shares_one_graph_and_is_exact(name, dtype):
    data = batches(3)
    model = _regional(name, dtype, "aot_eager", data)
    report = model.sonar.report()
    assert counters["sonar"]["graphs"] == 1 and report["graphs_compiled"] == 1, "one graph for all blocks"
    assert counters["sonar"]["updates"] == 2, "the shared graph holds one block's two updates"
    assert report["updates_in_graph"] == 3 * 2 * LAYERS and report["updates_by_hook"] == 0
    assert report["recompiles"] == 0
    assert_same_weights(model, _twin(name, dtype, "aot_eager", data))
    assert set(weights_differ(model, _model(name, dtype))) == {n for n, _ in model.named_parameters()}


@pytest.mark.slow
def test_regional_compile_with_inductor_is_exact(deterministic):
    data = batches(3)
    model = _regional("tiny-olmoe", torch.bfloat16, "inductor", data)
    twin = _twin("tiny-olmoe", torch.bfloat16, "inductor", data)
    assert model.sonar.report()["graphs_compiled"] + model.sonar.report()["graphs_from_cache"] == 1
    assert model.sonar.report()["updates_in_graph"] == 3 * 2 * LAYERS
    assert_same_weights(model, twin)


@known_library_failure(grouped_mm_compiled=torch.float32, compiled_vs_eager=True)
def test_regional_per_microbatch_accumulation_equals_its_eager_twin():
    data = batches(4)
    with pytest.warns(UserWarning, match="per_microbatch"):
        model = _regional("tiny-olmoe", torch.float32, "aot_eager", data, accumulation="per_microbatch")
    twin = sonar_fx.compile(_model(), CFG, compiler="eager", accumulation="per_microbatch")
    with pytest.warns(UserWarning, match="per_microbatch"):
        _train(twin, twin.sonar, data, micro=2)
    assert_same_weights(model, twin)
    assert model.sonar.report()["updates_in_graph"] == 4 * 2 * LAYERS


@pytest.mark.slow
def test_block_frames_reused_after_graph_breaks_update_their_own_block():
    """Whole-model compile, but the loop over blocks graph-breaks: each block runs as its own frame and
    dynamo reuses the first block's graph for the others."""

    def break_before_each_block(model):
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
        return model

    data = batches(3)
    torch._dynamo.reset()
    counters["sonar"].clear()
    model = sonar_fx.compile(break_before_each_block(_model()), CFG, compiler="aot_eager")
    _train(model, model.sonar, data)
    assert counters["sonar"]["graphs"] == 1, "one block graph, reused for every block"
    assert model.sonar.report()["updates_in_graph"] == 3 * 2 * LAYERS
    twin = break_before_each_block(_model())
    _train(twin, build_method("standard_no_expert_clip", twin, CFG), data)
    assert_same_weights(model, twin)


@pytest.mark.slow
def test_two_models_through_backend_sonar_each_train_only_themselves(deterministic):
    data = batches(2)
    torch._dynamo.reset()
    a, b = _model(), _model()
    opt_a, opt_b = sonar_fx.prepare(a, CFG), sonar_fx.prepare(b, CFG)
    _train(torch.compile(a, backend="sonar"), opt_a, data)
    a_after = copy.deepcopy(a.state_dict())
    _train(torch.compile(b, backend="sonar"), opt_b, data)
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in a_after.items()), "training b moved a"
    assert opt_b.report()["updates_in_graph"] == 2 * 2 * LAYERS
    assert opt_b.report()["graphs_compiled"] == 0, "b ran the graph compiled for a"
    assert_same_weights(a, b)  # same init, same data, same graph: b trained itself exactly as a did
    assert weights_differ(b, _model())


@pytest.mark.slow
def test_graph_reused_for_an_unprepared_model_raises_instead_of_updating_another():
    torch._dynamo.reset()
    a, stranger = _model(), _model()
    _train(torch.compile(a, backend="sonar"), sonar_fx.prepare(a, CFG), batches(1))
    before = copy.deepcopy(a.state_dict())
    with pytest.raises(sonar_fx.UnboundExpertError, match="no live SonarOptimizer owns"):
        torch.compile(stranger, backend="sonar")(**batches(1)[0]).loss.backward()
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in before.items())


@pytest.mark.slow
def test_deep_copy_of_a_compiled_model_trains_itself_and_never_the_original():
    first, rest = batches(1), batches(3, seed=2)
    torch._dynamo.reset()
    model = sonar_fx.compile(_model(), CFG, compiler="aot_eager")
    _train(model, model.sonar, first)
    clone = copy.deepcopy(model)
    assert clone.sonar is not model.sonar and clone.sonar.cfg == CFG
    snapshot = copy.deepcopy(model.state_dict())
    _train(clone, clone.sonar, rest)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items()), (
        "the copy moved the original"
    )
    assert clone.sonar.report()["updates_in_graph"] == 4 * 2 * LAYERS  # its history is copied too
    _train(model, model.sonar, rest)  # the original, continued on the same data, equals the copy
    assert_same_weights(model, clone)
    assert model.sonar.report()["updates_in_graph"] == 4 * 2 * LAYERS


def test_pickled_prepared_model_keeps_its_optimizer_and_trains_exactly():
    data = batches(3)
    model = sonar_fx.compile(_model(), CFG, compiler="eager")
    _train(model, model.sonar, data[:1])
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded.sonar.cfg == CFG and loaded.sonar is not model.sonar
    _train(loaded, loaded.sonar, data[1:])
    _train(model, model.sonar, data[1:])
    assert_same_weights(model, loaded)
    assert loaded.sonar.report()["updates_by_hook"] == 3 * 2 * LAYERS


def test_deep_copy_of_the_optimizer_alone_keeps_its_config():
    model = sonar_fx.compile(_model(), CFG, compiler="eager")
    clone = copy.deepcopy(model.sonar)
    assert clone.cfg == CFG and clone.granularity == "batched"
    pairs = zip(clone.expert_group["params"], model.sonar.expert_group["params"], strict=True)
    assert all(p is not q for p, q in pairs)


SIDE_ROUTES = [
    "regional",
    "backend_sonar",
    pytest.param("backend_sonar_inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("route", SIDE_ROUTES)
def test_side_backwards_through_shared_graphs_train_as_plain_torch(route, deterministic):
    """torch.autograd.grad and backward(inputs=...) that leave experts out, through a block graph
    shared by both layers (regional), or a model compiled with the "sonar" backend after `prepare`
    (aot_eager; inductor, the registered backend, against a twin compiled by inductor): each expert
    moves only where plain torch adds to its .grad."""
    data = batches(3)
    torch._dynamo.reset()
    model = build_model("tiny-reference", seed=0)
    if route == "regional":
        runner = sonar_fx.compile(model, CFG, compiler="aot_eager", regional=True)
        opt = runner.sonar
    else:
        opt = sonar_fx.prepare(model, CFG)
        backend = "sonar" if route.endswith("inductor") else make_sonar_backend("aot_eager")
        runner = torch.compile(model, backend=backend)
    train_with_side_backwards(runner, data, lambda: (opt.step(), opt.zero_grad()))
    twin = side_backwards_twin(data, compile_with="inductor" if route.endswith("inductor") else None)
    assert_same_weights(model, twin)
    assert weights_differ(model, build_model("tiny-reference", seed=0))
    report = opt.report()
    # 2 layers x 2 tensors: all left out by step 0's side call and by step 2, three by step 1.
    assert report["updates_left_out"] == 4 + 3 + 4 and report["updates_in_graph"] == 4 + 1
    assert report["graphs_compiled"] + report["graphs_from_cache"] == 1 and report["recompiles"] == 0


_fates: list[str] = []


@torch.library.custom_op("sonar_test::record_fate", mutates_args=("param",))
def _record_fate(param: torch.Tensor) -> None:
    """Inside a custom op's body (below autograd's dispatch keys), as the update op asks."""
    _fates.append(gradient_fate(param))


class _OneNode(torch.autograd.Function):
    """One autograd node for two leaves, as a compiled graph is: it runs when either needs a gradient."""

    @staticmethod
    def forward(ctx, p, q):
        ctx.p = p
        return p * q

    @staticmethod
    def backward(ctx, grad):
        _record_fate(ctx.p)
        return grad, grad


def test_gradient_fate_is_the_engines_answer_for_the_backward_in_progress():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    calls = {
        "backward()": lambda out: out.backward(),
        "backward(inputs=[q])": lambda out: out.backward(inputs=[q]),
        "backward(inputs=[p])": lambda out: out.backward(inputs=[p]),
        "autograd.grad(q)": lambda out: torch.autograd.grad(out, [q]),
        "autograd.grad(p)": lambda out: torch.autograd.grad(out, [p]),
    }
    seen = {}
    for name, call in calls.items():
        _fates.clear()
        call(_OneNode.apply(p, q).sum())
        seen[name] = list(_fates)
    assert seen == {
        "backward()": ["accumulate"],
        "backward(inputs=[q])": ["left_out"],
        "backward(inputs=[p])": ["accumulate"],
        "autograd.grad(q)": ["left_out"],
        "autograd.grad(p)": ["requested"],
    }
    assert gradient_fate(p) == "accumulate", "outside any backward: the caller asked for the update"
    p.requires_grad_(False)  # frozen: torch adds nothing to its .grad
    p.grad = None
    out, _fates[:] = _OneNode.apply(p, q).sum(), []
    out.backward()
    assert _fates == ["left_out"] and p.grad is None
