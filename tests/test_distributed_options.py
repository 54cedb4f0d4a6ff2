"""Every optimizer option on every engine, on 2 gloo processes: expert_clip "per_tensor" and "global",
Adam, SGD and Lion, low-bit expert states, compiled runs (see `distributed_cases_options`).

One spawn checks many cases. Each case's Sonar weights are `torch.equal` to the engine's standard
recipe written in plain torch, on every rank and every tensor; ranks agree bitwise (every tensor
under DDP and FSDP2, the dense ones under expert parallelism, whose ranks hold different experts);
the clip was active (a norm above the threshold); and a neighbouring rule (no expert clip, the
local shard's norm, 32-bit states) trains differently. Every spawn ends by itself.
"""

from __future__ import annotations

import pytest
from distributed_cases_options import COMPILED_CASES, EAGER_CASES, LOWBIT_CASES, STEPS

import distributed_worker

pytestmark = pytest.mark.multiprocess

EXPERT_TENSORS = 4  # tiny-reference: 2 layers x (gate_up, down)


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> list[dict]:
    return spawn("distributed_cases_options:options", tmp_path_factory.mktemp("options"))


def spawn(fn: str, out, timeout_s: int = 600) -> list[dict]:
    distributed_worker.run(fn, str(out), timeout_s=timeout_s)
    return distributed_worker.results(str(out))


def assert_exact(label: str, ranks: list[dict], cases: dict) -> None:
    """Equal to the twin on every rank, moved, ranks agree, the clip was active, controls differ."""
    case, controls = cases[label]
    runs = [r[label] for r in ranks]
    for run in runs:
        assert run["differ"] == [], (label, run["differ"][:3])
        assert run["moved"] and run["fallbacks"] == [], label
        # Every update happened, once per tensor and step: in the graph (DDP, EP compiled) or by hook.
        assert run["by_hook"] + run["in_graph"] == STEPS * EXPERT_TENSORS, (label, run)
        if case.cfg.expert_clip == "per_tensor":
            assert run["max_expert_norm"] > case.cfg.max_grad_norm, label  # some tensor was clipped
        if case.cfg.expert_clip == "global":
            assert run["total_norm"] > case.cfg.max_grad_norm, label
        for name, _, _ in controls:
            assert run[f"control/{name}"], (label, name)  # the neighbouring rule trains otherwise
    key = "dense_digest" if case.engine == "ep" else "digest"
    assert len({run[key] for run in runs}) == 1, f"{label}: ranks disagree"


@pytest.mark.parametrize("label", [k for k in EAGER_CASES if "/global" not in k and "/per_tensor" not in k])
def test_adam_sgd_lion_on_every_engine_equal_their_standard(options, label):
    assert_exact(label, options, EAGER_CASES)
    assert options[0][label]["expert_rule"] == EAGER_CASES[label][0].cfg.name


@pytest.mark.parametrize("label", [k for k in EAGER_CASES if "/per_tensor" in k])
def test_per_tensor_clip_by_the_reduced_whole_tensor_norm_on_every_engine(options, label):
    assert_exact(label, options, EAGER_CASES)


@pytest.mark.parametrize("label", [k for k in EAGER_CASES if "/global" in k])
def test_global_clip_in_two_passes_on_every_engine(options, label):
    assert_exact(label, options, EAGER_CASES)


def test_global_clip_under_ddp_with_find_unused_parameters(options):
    runs = [r["ddp/global/find_unused"] for r in options]
    assert all(run["differ"] == [] for run in runs) and len({run["digest"] for run in runs}) == 1


@pytest.mark.parametrize("label", list(COMPILED_CASES))
def test_compiled_engines_update_where_the_gradient_is_final(options, label):
    assert_exact(label, options, COMPILED_CASES)
    where = "by_hook" if label.startswith("fsdp2") else "in_graph"  # FSDP2: after its reduce-scatter
    assert all(r[label][where] == STEPS * EXPERT_TENSORS for r in options), label


@pytest.mark.slow  # torchao's low-bit update is an inductor compile
def test_lowbit_states_on_every_engine_equal_torchao(tmp_path):
    pytest.importorskip("torchao.optim", reason="low-bit states need torchao")
    ranks = spawn("distributed_cases_options:lowbit_options", tmp_path, timeout_s=900)
    for label, (case, _) in LOWBIT_CASES.items():
        assert_exact(label, ranks, LOWBIT_CASES)
        bits = case.cfg.state_bits
        assert all(f"OptimState{bits}bit" in r[label]["state_kinds"] for r in ranks), label  # quantized
        assert ranks[0][label]["expert_rule"].endswith(f"{bits}bit")


@pytest.mark.slow
def test_expert_parallel_inductor_per_block_equals_its_standard(tmp_path):
    ranks = spawn("distributed_cases_options:ep_inductor", tmp_path, timeout_s=900)
    runs = [r["ep/inductor"] for r in ranks]
    for run in runs:
        assert run["differ"] == [] and run["moved"] and run["fallbacks"] == []
        assert run["in_graph"] == STEPS * EXPERT_TENSORS and run["by_hook"] == 0
    assert len({run["dense_digest"] for run in runs}) == 1
