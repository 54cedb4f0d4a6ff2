"""FSDP2 x expert parallelism on a 2 x 2 mesh of 4 gloo processes (see `distributed_cases_2d`).

Sonar on `sonar_fx.distributed.fsdp2_ep` is `torch.equal` to the same layout trained with the standard
recipe (AdamW on the DTensors; dense-only, per-tensor and torchtitan's global clipping) on every rank
and tensor; dense weights agree on all 4 ranks and experts along each "dp" column; the layout's
divide-by-world matters (FSDP2's default divide-by-dp trains otherwise); and plain data parallelism
trains the same model up to the order of the reductions' sums.
"""

from __future__ import annotations

import pytest

import distributed_worker

pytestmark = pytest.mark.multiprocess

STEPS, EXPERT_TENSORS = 2, 4


def test_fsdp2_x_expert_parallel_equals_the_same_layout_standard(tmp_path):
    distributed_worker.run("distributed_cases_2d:fsdp2_ep_cases", str(tmp_path), world=4, timeout_s=600)
    ranks = distributed_worker.results(str(tmp_path), world=4)
    for label in ("adamw", "per_tensor", "global/bf16"):
        runs = [r[label] for r in ranks]
        for run in runs:
            assert run["differ"] == [], (label, run["differ"][:3])
            assert run["by_hook"] == STEPS * EXPERT_TENSORS  # FSDP2 hands each reduced shard to the hook
            assert run["local_experts"] == [[1, 32, 32], [1, 32, 16]] * 2  # E=4: 2 per ep rank, 1 per dp rank
        assert len({run["dense_digest"] for run in runs}) == 1, f"{label}: dense weights disagree"
        columns = [{runs[r]["expert_digest"] for r in (ep, ep + 2)} for ep in (0, 1)]  # rank = 2 * dp + ep
        assert all(len(c) == 1 for c in columns) and columns[0] != columns[1], label
    assert ranks[0]["per_tensor"]["max_expert_norm"] > 0.05 and ranks[0]["global/bf16"]["total_norm"] > 0.5
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
