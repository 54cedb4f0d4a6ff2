"""Sonar is bitwise equal to its twin on every expert layout transformers uses (tiny configs, fp32).

The twin is standard_no_expert_clip with the split discovery makes (`tests/families.py`'s `run_twins`,
the same code that fills the README's families table). One family per layout: non-gated (NemotronH),
zero-computation experts (LongCat-Flash), per-expert linear modules in MLP and attention (JetMoE),
fused 2-D (DBRX), shared experts (Qwen2-MoE), an undecorated experts module (Llama-4), experts given
by name (Doge), per-expert biases both ways (gpt-oss). The full table: `python -m tests.families`.
"""

import pytest
import torch

import sonar_fx
from sonar_fx.errors import SonarUsageError
from sonar_fx.methods import build_method

from families import batches, build_family, differing, run_twins, train
from helpers import CFG, known_library_failure

EAGER_FAMILIES = ["nemotron_h", "longcat_flash", "jetmoe", "dbrx", "qwen2_moe", "llama4_text"]
EAGER_FAMILIES += [pytest.param("doge", marks=known_library_failure(forward_of="doge"))]


def _exact(run):
    assert run.sonar_error is None and run.twin_error is None, (run.sonar_error, run.twin_error)
    assert not run.differ, f"{len(run.differ)} tensors differ, e.g. {run.differ[:3]}"


@pytest.mark.parametrize("model_type", EAGER_FAMILIES)
def test_eager_exact(model_type):
    run = run_twins(model_type, "eager", steps=2)
    _exact(run)
    assert run.report["updates_by_hook"] == 2 * run.report["expert_tensors"]


@pytest.mark.parametrize("expert_biases", ["experts", "dense"])
def test_gpt_oss_biases_exact_either_way_and_the_policy_matters(expert_biases):
    run = run_twins("gpt_oss", "eager", steps=2, control=True, expert_biases=expert_biases)
    _exact(run)
    assert run.clip_control_differs, "a global clip must change the result, or exactness proves nothing"
    assert run.report["expert_tensors"] == (8 if expert_biases == "experts" else 4)
    # Negative control: Sonar with one policy against the twin of the other differs in the biases.
    other = "dense" if expert_biases == "experts" else "experts"
    sonar, _, _ = train("sonar", "gpt_oss", "eager", 2, expert_biases=expert_biases)
    twin, _, _ = train("standard_no_expert_clip", "gpt_oss", "eager", 2, expert_biases=other)
    assert any(n.endswith("_bias") and ".experts." in n for n in differing(sonar, twin))


@pytest.mark.slow
def test_gpt_oss_compiled_weights_in_graph_biases_exact_too():
    # A bias gradient comes from an index-put (a scatter of token rows), not a matmul. The backward
    # graph holds no alias of a bias (its forward gather saves only the indices), so the run-time
    # bound update has nothing to find it by: the pass leaves biases to their hooks, which update them
    # right after the graph returns (a few KB kept to the end of backward), and the result is exact.
    counters = torch._dynamo.utils.counters["sonar"]
    left_before = counters["left_to_hooks"]
    run = run_twins("gpt_oss", "aot_eager", steps=2, expert_biases="experts")
    _exact(run)
    paths = run.report["last_step"]
    assert len(paths) == 8 and run.report["updates_in_graph"] + run.report["updates_by_hook"] == 2 * 8
    assert {p for n, p in paths.items() if not n.endswith("_bias")} == {"graph"}
    assert {p for n, p in paths.items() if n.endswith("_bias")} <= {"graph", "hook"}
    left = counters["left_to_hooks"] - left_before
    assert left == sum(p == "hook" for p in paths.values()), "every bias found: in graph or left to hooks"


@pytest.fixture
def one_thread():
    # Inductor's CPU scatter-add (the per-expert bias gradient) is not deterministic across threads:
    # with two, plain compiled training already differs from itself.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ONE_MOE_LAYER = {"num_hidden_layers": 1}  # half the graph to compile, the same layout


def _in_graph(run):
    weights = {p for n, p in run.report["last_step"].items() if not n.endswith("_bias")}
    assert weights == {"graph"} and not run.report["fallbacks"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("gpt_oss", ONE_MOE_LAYER),  # per-expert biases, transposed interleaved gate/up
        ("nemotron_h", {"layers_block_type": ["full_attention", "moe"]}),  # not gated
    ],
)
def test_inductor_exact(model_type, overrides, one_thread):
    run = run_twins(model_type, "inductor", steps=2, overrides=overrides)
    _exact(run)
    _in_graph(run)


@pytest.mark.slow
def test_compiled_shared_experts_and_mla_exact():
    # DeepSeek-V3: the pass finds the routed experts beside a shared expert (a dense MLP) and MLA
    # attention; aot_eager, as the pass is the same under inductor (tested on the layouts above).
    run = run_twins("deepseek_v3", "aot_eager", steps=2, overrides=ONE_MOE_LAYER)
    _exact(run)
    _in_graph(run)


# --- a model built on the meta device ---------------------------------------------------------------


def _materialised(state):
    model = build_family("olmoe", device="meta")
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    return model


@pytest.mark.slow
def test_meta_device_model_prepared_after_to_empty_and_load_trains_exactly():
    reference = build_family("olmoe", seed=0)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    # transformers recomputes non-persistent buffers (rotary inv_freq) at init: restore them too.
    buffers = {n: b.clone() for n, b in reference.named_buffers()}
    torch._dynamo.reset()  # earlier graphs of the shared transformers wrapper count to its recompile limit
    runs = {}
    for method in ("sonar", "standard_no_expert_clip"):
        model = _materialised(state)
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
        m = build_method(method, model, CFG, compiler="aot_eager")
        torch.manual_seed(0)
        for b in batches(2):
            m.train_step(b)
        runs[method] = (model, m)
    (sonar, m), (twin, _) = runs["sonar"], runs["standard_no_expert_clip"]
    assert not differing(sonar, twin)
    assert differing(sonar, reference), "training must have moved the weights"
    assert m.optimizer.report()["updates_in_graph"] == 2 * 4


def test_prepare_on_the_meta_device_raises_and_names_the_fix():
    model = build_family("olmoe", device="meta")
    with pytest.raises(SonarUsageError, match=r"to_empty"):
        sonar_fx.prepare(model, CFG)
    assert getattr(model, "sonar", None) is None


def test_partly_frozen_layer_trains_exactly_with_its_partner_as_expert():
    runs = {}
    for method in ("sonar", "standard_no_expert_clip"):
        model = build_family("olmoe", seed=0)
        frozen = model.model.layers[0].mlp.experts.gate_up_proj
        frozen.requires_grad_(False)
        with pytest.warns(UserWarning, match="Partly frozen"):
            m = build_method(method, model, CFG, compiler="eager")
        torch.manual_seed(0)
        for b in batches(2):
            m.train_step(b)
        runs[method] = (model, m, frozen.detach().clone())
    (sonar, m, frozen_after), (twin, _, _) = runs["sonar"], runs["standard_no_expert_clip"]
    assert not differing(sonar, twin)
    assert torch.equal(frozen_after, build_family("olmoe", seed=0).model.layers[0].mlp.experts.gate_up_proj)
    assert m.optimizer.report()["last_step"]["model.layers.0.mlp.experts.down_proj"] == "hook"
