"""The saving guard: where a compiled run would save nothing it says so (or refuses), the meter measures
what was alive, and the paths that used to save nothing silently now save, exactly.

The memory claim is tested like exactness: in-graph update counts, and the measured peak of expert-
gradient bytes alive at once against the one-layer bound, with the lost-saving path as the control that
must show every gradient of the graph alive together.
"""

from __future__ import annotations

import copy
import pickle
import types
import warnings

import pytest
import torch

import sonar_fx
import sonar_fx.compiled
from sonar_fx.backend import make_sonar_backend
from sonar_fx.errors import SavingLostError
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV, resolve_on_saving_lost

from helpers import CFG, assert_same_weights, batches, known_library_failure, weights_differ

STEPS = 2
EXPERT_TENSORS = 4  # tiny models: 2 layers x (gate_up_proj, down_proj)


def _batched_mm_model():
    model = build_model("tiny-qwen3moe", dtype=torch.bfloat16, seed=0)
    model.set_experts_implementation("batched_mm")
    return model


def _train(model, step_fn, steps=STEPS):
    for batch in batches(steps):
        step_fn(batch)
    return model


@pytest.fixture(scope="module")
def batched_mm_twin():
    """Standard training (dense-only clip) of the batched_mm model: what Sonar must equal bitwise."""
    model = _batched_mm_model()
    return _train(model, build_method("standard_no_expert_clip", model, CFG).train_step)


def _sonar_step(model):
    def step(batch):
        model(**batch).loss.backward()
        model.sonar.step()
        model.sonar.zero_grad()

    return step


# ------------------------------------------------------------------------------ batched_mm saves


@known_library_failure(compiled_vs_eager=True)  # batched_mm, not grouped_mm: the twin trains eagerly
def test_batched_mm_is_updated_in_graph_exactly_and_holds_one_tensor_at_a_time(batched_mm_twin):
    """transformers' batched_mm gathers the selected experts' weights (`w[expert_ids]`), so the backward
    saves the gathered copy, never the weight; the weight gradient is an index_put accumulation. The
    weight is handed to the backward for the update to bind: every update is in-graph and exact. The
    gathered copies outweigh the expert gradients here, so the saving is lost to them: warned."""
    torch._dynamo.reset()
    model = sonar_fx.compile(_batched_mm_model(), CFG, compiler="aot_eager", on_saving_lost="warn")
    with pytest.warns(UserWarning, match=r"'batched_mm' saves a copy of the expert weights"):
        _train(model, _sonar_step(model))
    report = model.sonar.report()
    assert report["updates_inserted"] == EXPERT_TENSORS
    assert report["updates_in_graph"] == STEPS * EXPERT_TENSORS and report["updates_by_hook"] == 0
    assert (
        report["saving_lost_by_cause"].keys() == {"gathered weights"} and report["updates_after_graph"] == 0
    )
    grads = report["expert_grad_bytes"]
    assert 0 < grads["measured_peak"] <= grads["one_layer"] < grads["all_layers"]
    assert_same_weights(model, batched_mm_twin)
    assert weights_differ(model, _batched_mm_model())


@known_library_failure(compiled_vs_eager=True)
@pytest.mark.filterwarnings("ignore:sonar. the experts implementation 'batched_mm' saves:UserWarning")
def test_a_graph_that_leaves_expert_gradients_warns_and_its_peak_shows_them_all_alive(batched_mm_twin):
    """The control: without the weight hand-over (the state before it existed) the graph returns every
    expert gradient; the guard names them, the op and the bytes, and the meter's peak is every layer's
    gradients at once. Still exact."""
    torch._dynamo.reset()
    model = _batched_mm_model()
    opt = sonar_fx.prepare(model, CFG, on_saving_lost="warn")
    compiled = torch.compile(model, backend=make_sonar_backend("aot_eager", save_params=False))
    with pytest.warns(UserWarning, match=r"returns the gradients of 4 expert tensor") as caught:
        for batch in batches(STEPS):
            compiled(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    message = str(next(w.message for w in caught if "expert tensor" in str(w.message)))
    assert "model.layers.0.mlp.experts.gate_up_proj (other:aten::index_put)" in message
    assert "no memory saved for 0.19 MiB of expert gradients" in message
    report = opt.report()
    bounds = ExpertGradBytes.of(opt.expert_layers)
    assert report["updates_in_graph"] == 0 and report["updates_after_graph"] == STEPS * EXPERT_TENSORS
    assert report["saving_lost_bytes"] == bounds.total
    assert report["expert_grad_bytes"]["measured_peak"] == bounds.total > bounds.one_layer
    assert_same_weights(model, batched_mm_twin)


def test_on_saving_lost_raise_refuses_before_any_update_and_names_the_fix(monkeypatch):
    """The suite's default ("raise", from the environment) reaches a model built by sonar_fx.compile: the
    first forward raises the guard's own error, not a compiler fallback."""
    assert resolve_on_saving_lost(None) == "raise"  # tests/conftest.py
    ablation = make_sonar_backend("aot_eager", save_params=False)
    monkeypatch.setattr(sonar_fx.compiled, "sonar_backend", lambda *args, **kwargs: ablation)
    torch._dynamo.reset()
    model = build_model("tiny-qwen3moe", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    model.set_experts_implementation("batched_mm")
    model = sonar_fx.compile(model, CFG, compiler="aot_eager")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SavingLostError, match=r"Fix: compile with compiler='eager'") as err:
        model(**batches(1)[0])
    assert len(err.value.tensors) == 2  # one layer
    assert model.sonar.report()["fallbacks"] == []
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_on_saving_lost_is_checked(monkeypatch):
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "loud")
    with pytest.raises(ValueError, match="SONAR_FX_ON_SAVING_LOST='loud'"):
        resolve_on_saving_lost(None)
    with pytest.raises(ValueError, match="expected 'warn' or 'raise'"):
        sonar_fx.prepare(build_model("tiny-olmoe", seed=0), CFG, on_saving_lost="never")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ the meter


def test_the_meter_measures_one_tensor_at_a_time_on_the_eager_path():
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    _train(model, _sonar_step(model))
    grads = model.sonar.report()["expert_grad_bytes"]
    tensors = [t.param for layer in model.sonar.expert_layers for t in layer.tensors]
    largest = max(p.numel() * p.element_size() for p in tensors)
    assert grads["measured_peak"] == largest < grads["one_layer"]


# ----------------------------------------------------------------------- nested compile regions


@pytest.fixture
def nested_experts():
    """The experts' forward as a nested compile region (one subgraph for every layer's call)."""
    cls = type(build_model("tiny-olmoe", seed=0).model.layers[0].mlp.experts)
    original = cls.forward
    cls.forward = torch.compiler.nested_compile_region(original)
    yield
    cls.forward = original


@pytest.mark.slow
def test_experts_in_a_nested_compile_region_are_updated_in_graph_exactly(nested_experts):
    """Every call of a nested region returns the same cached fake tensors, so storage identity alone
    would take one layer's saved weight for another's (and update the wrong tensor): aliases are
    saved values reached from the parameter through views."""
    twin = build_model("tiny-olmoe", seed=0)
    _train(twin, build_method("standard_no_expert_clip", twin, CFG).train_step)
    torch._dynamo.reset()
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="aot_eager")
    _train(model, _sonar_step(model))
    report = model.sonar.report()
    assert report["updates_in_graph"] == STEPS * EXPERT_TENSORS and report["saving_lost_bytes"] == 0
    assert report["expert_grad_bytes"]["measured_peak"] <= report["expert_grad_bytes"]["one_layer"]
    assert_same_weights(model, twin)


# ----------------------------------------------------------------- a forward that is not compiled


def test_a_replaced_forward_warns_once_that_nothing_was_compiled():
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="aot_eager")
    eager = type(model).forward
    model.forward = types.MethodType(lambda self, **kw: eager(self, **kw), model)  # as TRL's fused head does
    with pytest.warns(UserWarning, match=r"no compiled forward ran: the model's forward was replaced"):
        _sonar_step(model)(batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sonar_step(model)(batches(1)[0])  # once
    assert model.sonar.report()["updates_by_hook"] == 2 * EXPERT_TENSORS


# ------------------------------------------------------------- tensors that no param group holds


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # from PEFT
def test_step_warns_once_about_trainable_tensors_no_group_holds():
    peft = pytest.importorskip("peft")
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    for name, param in model.named_parameters():
        param.requires_grad_(".mlp.experts." in name or "lora_" in name)
    opt = model.base_model.model.sonar
    step = lambda batch: (model(**batch).loss.backward(), opt.step(), opt.zero_grad())  # noqa: E731
    with pytest.warns(UserWarning, match=r"4 trainable tensor\(s\) have a gradient but are in no param"):
        step(batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(batches(1)[0])


# --------------------------------------------------------------- copies of a partly frozen model


@pytest.mark.parametrize(
    ("compiler", "copier"),
    [
        ("eager", "deepcopy"),
        ("eager", "pickle"),
        pytest.param("aot_eager", "deepcopy", marks=known_library_failure(grouped_mm_compiled=torch.float32)),
    ],
)
def test_a_copy_of_a_partly_frozen_model_trains_exactly_as_the_model(compiler, copier):
    torch._dynamo.reset()
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler=compiler)
    frozen = model.model.layers[0].mlp.experts.down_proj
    frozen.requires_grad_(False)
    data = batches(3)
    _sonar_step(model)(data[0])
    copied = copy.deepcopy(model) if copier == "deepcopy" else pickle.loads(pickle.dumps(model))
    before = frozen.detach().clone()
    for batch in data[1:]:
        _sonar_step(model)(batch)
        _sonar_step(copied)(batch)
    assert_same_weights(copied, model)
    assert torch.equal(copied.model.layers[0].mlp.experts.down_proj, before)
    path = "updates_by_hook" if compiler == "eager" else "updates_in_graph"
    assert copied.sonar.report()[path] == 3 * 3  # the copy's counters start from the model's (1 step)
    # Teeth: unfreezing the copy's tensor (its hook was registered although it was frozen) trains it.
    copied.model.layers[0].mlp.experts.down_proj.requires_grad_(True)
    _sonar_step(copied)(data[0])
    assert not torch.equal(copied.model.layers[0].mlp.experts.down_proj, before)


# ------------------------------------------------------------- the hot path's timing reference


def test_the_hand_written_expert_hooks_do_sonars_arithmetic():
    """`benchmarks.handwritten` (PyTorch tutorial's hooks, what Sonar's eager hooks are timed against)
    is an equal-work reference only if it computes the same thing: bitwise equal, with a control."""
    from benchmarks.handwritten import handwritten_expert_hooks

    by_hand = build_model("tiny-olmoe", seed=0)
    _train(by_hand, handwritten_expert_hooks(by_hand, CFG).train_step)
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    _train(model, _sonar_step(model))
    assert_same_weights(by_hand, model)
    clipped_all = build_model("tiny-olmoe", seed=0)
    _train(clipped_all, build_method("standard", clipped_all, CFG).train_step)
    assert weights_differ(by_hand, clipped_all)


# ------------------------------------------------------- prepare + the user's own torch.compile


def _user_compiled(backend, **prepare_kwargs):
    torch._dynamo.reset()
    model = build_model("tiny-reference", seed=0)
    opt = sonar_fx.prepare(model, CFG, **prepare_kwargs)
    return model, opt, torch.compile(model, backend=backend)


def test_prepare_then_a_plain_torch_compile_warns_once_and_reports_every_gradient_alive():
    """A graph another backend compiled returns all its expert gradients at once for the hooks: one
    warning names the cause and the fix, and the meter counts them alive together (the one-layer bound
    is broken, as it is); training stays exact (hooks)."""
    _, opt, compiled = _user_compiled("aot_eager", on_saving_lost="warn")
    with pytest.warns(UserWarning, match=r"backend other than sonar's.*sonar_fx\.compile") as record:
        for b in batches(2):
            compiled(**b).loss.backward()
            opt.step()
            opt.zero_grad()
    assert sum("backend other than sonar's" in str(w.message) for w in record) == 1
    report = opt.report()
    grads = report["expert_grad_bytes"]
    assert grads["measured_peak"] == grads["all_layers"] > grads["one_layer"]
    assert report["updates_by_hook"] == report["updates_after_graph"] == 2 * 4


def test_prepare_then_a_plain_torch_compile_under_raise_refuses_before_any_weight_moves():
    """Refused when the foreign graph's backward returns the expert gradients (a graph whose
    partition rewrote them returns None and is not refused), before any hook updates a weight."""
    model, _, compiled = _user_compiled("aot_eager")  # the suite's default: on_saving_lost="raise"
    before = copy.deepcopy(model.state_dict())
    loss = compiled(**batches(1)[0]).loss
    with pytest.raises(SavingLostError, match=r"backend='sonar'") as err:
        loss.backward()  # as the graph's backward returns its expert gradients, before any hook runs
    assert len(err.value.tensors) == 4
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_prepare_then_the_sonar_backend_stays_within_one_layer():
    _, opt, compiled = _user_compiled(make_sonar_backend("aot_eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in batches(2):
            compiled(**b).loss.backward()
            opt.step()
            opt.zero_grad()
    report = opt.report()
    grads = report["expert_grad_bytes"]
    assert report["updates_in_graph"] == 2 * 4 and report["updates_by_hook"] == 0
    assert grads["measured_peak"] <= grads["one_layer"]


# --------------------------------------------------- paths that save less than half of the prediction


def _state(model):
    return copy.deepcopy(model.state_dict())


def _unchanged(model, before):
    after = model.state_dict()
    return all(torch.equal(before[k], after[k]) for k in before)


def test_batched_mm_in_backward_under_raise_refuses_at_the_first_forward():
    """batched_mm saves every routed token's expert-weight copies for backward: with them alive when
    backward begins, freeing expert gradients cannot lower the peak. Refused by the forward, before any
    update; one token per step (copies at half the prediction) is the control that trains."""
    model = sonar_fx.compile(_batched_mm_model(), CFG, compiler="eager")  # the suite's "raise"
    before = _state(model)
    with pytest.raises(SavingLostError, match=r"'batched_mm' saves a copy.*set_experts_implementation"):
        model(**batches(1)[0])
    assert _unchanged(model, before) and model.sonar.report()["updates_by_hook"] == 0
    _sonar_step(model)(batches(1, batch=1, seq=1)[0])
    assert model.sonar.report()["updates_by_hook"] == EXPERT_TENSORS


def test_deferred_crossover_warns_once_with_the_sizes_and_raise_refuses_before_any_weight_moves():
    """Operands outgrowing every gradient (many tokens): each crossed-over gradient is kept whole until
    step(), alive with the others; counted as lost and as alive, warned once with the sizes, refused
    under "raise" in the backward (the deferred step moves no weight before step())."""
    big = batches(2, batch=4, seq=64)
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred",
                             on_saving_lost="warn")  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"kept operands outgrew them .*operands [\d,]+ B > gradient [\d,]+ B"
    ):
        model(**big[0]).loss.backward()
        model.sonar.step()
        model.sonar.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        model(**big[1]).loss.backward()
        model.sonar.step()
    report = model.sonar.report()
    bounds = ExpertGradBytes.of(model.sonar.expert_layers)
    assert (
        report["saving_lost_by_cause"]
        == {"crossover": bounds.total}
        == {"crossover": report["saving_lost_bytes"]}
    )
    assert report["expert_grad_bytes"]["measured_peak"] >= bounds.total  # all kept whole, and a piece summed
    refused = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred")
    before = _state(refused)
    with pytest.raises(SavingLostError, match=r"crossover.*Fix: fewer tokens per step"):
        refused(**big[0]).loss.backward()
    assert _unchanged(refused, before)


def _penalised_step(model):
    """A step whose loss also reads every expert weight outside its GEMM (a penalty on it): autograd
    computes that part of each expert gradient itself, so the gradient arrives whole."""

    def step(batch):
        penalty = sum(p.square().sum() for p in model.sonar.expert_group["params"])
        (model(**batch).loss + 1e-3 * penalty).backward()
        model.sonar.step()
        model.sonar.zero_grad()

    return step


def test_deferred_gradients_kept_whole_warn_once_naming_the_cause():
    """Eager experts whose weight is also read outside its GEMM (a penalty): the capture keeps the GEMM's
    operands, autograd computes the penalty's part whole, and every such gradient waits for step().
    Counted alive and lost, warned once at the step with all of them named; refused under "raise" in
    the backward, before any weight moves. (Every experts implementation's GEMM is captured:
    tests/test_deferred_paths.py.)"""
    model = sonar_fx.compile(
        build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred", on_saving_lost="warn"
    )
    with pytest.warns(UserWarning, match=r"kept 4 expert gradient\(s\) whole.*outside its GEMM.*Fix: "):
        _penalised_step(model)(batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _penalised_step(model)(batches(1)[0])
    report = model.sonar.report()
    bounds = ExpertGradBytes.of(model.sonar.expert_layers)
    assert (
        report["saving_lost_by_cause"] == {"kept whole": bounds.total}
        and report["saving_lost_bytes"] == bounds.total
    )
    assert report["deferred"]["kept_whole"] == sorted(
        model.sonar.expert_name(p) for p in model.sonar.expert_group["params"]
    )
    refused = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred")
    before = _state(refused)
    with pytest.raises(SavingLostError, match=r"whole until step\(\)"):
        penalty = sum(p.square().sum() for p in refused.sonar.expert_group["params"])
        (refused(**batches(1)[0]).loss + penalty).backward()
    assert _unchanged(refused, before)


def test_prepare_deferred_then_a_plain_torch_compile_warns_with_the_real_cause_or_refuses():
    """The deferred schedule under the user's own compile with another backend: the graph returns every
    expert gradient, kept whole until step(). The warning names the foreign compile (not compiler=
    'eager'), the meter counts them all alive, saving_lost_bytes all of them; "raise" refuses."""
    _, opt, compiled = _user_compiled("aot_eager", on_saving_lost="warn", schedule="deferred")
    with pytest.warns(
        UserWarning, match=r"backend other than sonar's.*keeps them whole until step\(\)"
    ) as record:
        for b in batches(2):
            compiled(**b).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [str(w.message) for w in record if "sonar:" in str(w.message)][1:] == []  # one warning, this one
    report = opt.report()
    bounds = ExpertGradBytes.of(opt.expert_layers)
    assert report["saving_lost_bytes"] == bounds.total == report["expert_grad_bytes"]["measured_peak"]
    model, _, compiled = _user_compiled("aot_eager", schedule="deferred")
    before = _state(model)
    loss = compiled(**batches(1)[0]).loss
    with pytest.raises(SavingLostError, match=r"backend='sonar'"):
        loss.backward()
    assert _unchanged(model, before)
