"""Muon on the engines whose gradients are whole matrices: DDP and expert parallelism, 2 gloo ranks.

Sonar's in-backward Muon is `torch.equal` on every tensor of every rank to the engine's standard
training with the end-of-step Muon recipe (clipping only dense gradients); DDP ranks agree bitwise
(expert parallelism: on the replicated dense tensors). FSDP2 is refused (tests/test_muon_training.py).
"""

from __future__ import annotations

import pytest

import distributed_worker

pytestmark = pytest.mark.multiprocess


def test_muon_on_ddp_and_expert_parallel_equals_their_standard_recipe(tmp_path):
    distributed_worker.run("distributed_cases_muon:muon_cases", str(tmp_path), world=2, timeout_s=600)
    ranks = distributed_worker.results(str(tmp_path), 2)
    for label, updates in (("ddp/fp32", 3 * 4), ("ep/bf16", 3 * 4)):
        runs = [r[label] for r in ranks]
        for run in runs:
            assert run["differ"] == [], run["differ"][:3]
            assert run["moved"] and run["by_hook"] == updates and run["fallbacks"] == []
    assert len({r["ddp/fp32"]["digest"] for r in ranks}) == 1, "DDP ranks disagree"
    assert len({r["ep/bf16"]["dense_digest"] for r in ranks}) == 1, "EP dense weights disagree"
    assert all(r["ep/bf16"]["matrices"] == 8 for r in ranks)  # routers stay AdamW with E/world experts
