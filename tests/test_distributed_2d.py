"""FSDP2 x expert parallelism on a 2 x 2 mesh of 4 gloo processes (see `distributed_cases_2d`).

Sonar on `sonar_fx.distributed.fsdp2_ep` is `torch.equal` to the same layout trained with the standard
recipe (torch's or torchao's optimizer on the DTensors; dense-only, per-tensor and torchtitan's global
clipping; eager or each block compiled) on every rank and tensor; dense weights agree on all 4 ranks
and experts along each "dp" column; the layout's divide-by-world matters (FSDP2's default
divide-by-dp trains otherwise); plain data parallelism trains the same model up to the order of the
reductions' sums; and Sonar's gradient saving per rank is what the design predicts.
"""

from __future__ import annotations

import pytest
from distributed_cases_2d import CASES, LOWBIT_CASES, STEPS

import distributed_worker

pytestmark = pytest.mark.multiprocess

EXPERT_TENSORS = 4


def spawn(fn: str, out, timeout_s: int = 600) -> list[dict]:
    distributed_worker.run(fn, str(out), world=4, timeout_s=timeout_s)
    return distributed_worker.results(str(out), world=4)


def assert_exact(label: str, ranks: list[dict], case) -> None:
    runs = [r[label] for r in ranks]
    for run in runs:
        assert run["differ"] == [] and run["fallbacks"] == [], (label, run["differ"][:3])
        assert run["by_hook"] == STEPS * EXPERT_TENSORS  # FSDP2 hands each reduced shard to the hook
        bits = getattr(case.cfg, "state_bits", 32)
        assert run["expert_rule"] == case.cfg.name + (f"{bits}bit" if bits != 32 else "")
    assert len({run["dense_digest"] for run in runs}) == 1, f"{label}: dense weights disagree"
    columns = [{runs[r]["expert_digest"] for r in (ep, ep + 2)} for ep in (0, 1)]  # rank = 2 * dp + ep
    assert all(len(c) == 1 for c in columns) and columns[0] != columns[1], label
    if case.cfg.expert_clip == "per_tensor":
        assert runs[0]["max_expert_norm"] > case.cfg.max_grad_norm, label  # the clip was active
    if case.cfg.expert_clip == "global":
        assert runs[0]["total_norm"] > case.cfg.max_grad_norm, label


def test_fsdp2_x_expert_parallel_equals_the_same_layout_standard(tmp_path):
    ranks = spawn("distributed_cases_2d:fsdp2_ep_cases", tmp_path)
    for label, case in CASES.items():
        assert_exact(label, ranks, case)
    assert ranks[0]["adamw"]["local_experts"] == [[1, 32, 32], [1, 32, 16]] * 2  # E=4: 2 per ep, 1 per dp
    for r in ranks:
        assert r["control/divide_by_dp"], "FSDP2's default divide factor must train otherwise"
        # Against DDP with every expert on every rank (fp32, 2 steps, lr 1e-2): the all-to-all, the
        # reduce-scatters and DDP's all-reduce sum the 4 ranks' gradients in different orders.
        assert r["vs_ddp"] < 1e-5
    # Memory per rank (benchmarks.distributed's 2-D rows, counted storage bytes): Sonar saves this
    # rank's expert gradients less one layer, and holds no more parameters or states than standard.
    for r in ranks:
        standard, sonar, replicas = r["memory"]
        assert standard["arm"] == "standard" and sonar["arm"] == "sonar"
        assert standard["peak_bytes"] - sonar["peak_bytes"] >= sonar["expected_min"] > 0
        assert sonar["held_bytes"] == standard["held_bytes"] < replicas["held_bytes"] / 2


@pytest.mark.slow  # torchao's low-bit update is an inductor compile
def test_fsdp2_x_expert_parallel_lowbit_states_equal_torchao(tmp_path):
    pytest.importorskip("torchao.optim", reason="low-bit states need torchao")
    ranks = spawn("distributed_cases_2d:fsdp2_ep_lowbit", tmp_path, timeout_s=900)
    for label, case in LOWBIT_CASES.items():
        assert_exact(label, ranks, case)
