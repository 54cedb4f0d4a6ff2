"""Sonar on DDP, FSDP2 and expert parallelism, on 2 (and 4) gloo processes over loopback.

Each test spawns the processes once and checks what every rank reported: Sonar's weights are
`torch.equal` to the same engine's standard training with dense-only clipping, on every rank and
every tensor, and ranks agree bitwise (digests of every tensor). The negative controls (plain hooks
on a DDP model, the pass without its all-reduce) must differ, and ranks must disagree there.
Every spawn ends by itself: a hung collective times out and the processes are killed.
"""

from __future__ import annotations

import pytest

import distributed_worker

pytestmark = pytest.mark.multiprocess
EXPERTS = 4  # 2 layers x (gate_up, down) in tiny-olmoe and tiny-reference
UPDATES = 3 * EXPERTS  # 3 steps


def spawn(fn: str, tmp_path, world: int = 2, timeout_s: int = distributed_worker.TIMEOUT_S) -> list[dict]:
    distributed_worker.run(fn, str(tmp_path), world=world, timeout_s=timeout_s)
    return distributed_worker.results(str(tmp_path), world)


def assert_exact(runs: list[dict], *, in_graph: int = 0, by_hook: int = 0) -> None:
    """Every rank bitwise equal to its twin, training moved the weights, ranks agree."""
    for run in runs:
        assert run["differ"] == [], run["differ"][:3]
        assert run["moved"]
        assert (run["in_graph"], run["by_hook"]) == (in_graph, by_hook), run
        assert run["fallbacks"] == []
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree"


def test_ddp_eager_sync_and_async_equal_ddp_standard_fp32_bf16(tmp_path):
    ranks = spawn("distributed_cases:ddp_eager", tmp_path)
    for mode in ("sync", "async"):
        for dtype in ("fp32", "bf16"):
            runs = [r[f"{mode}/{dtype}"] for r in ranks]
            assert_exact(runs, by_hook=UPDATES)
            assert all(run["reduced_here"] == UPDATES for run in runs)
    # Negative control: plain hooks on a DDP model update from local gradients: wrong, ranks disagree.
    plain = [r["plain_hooks"] for r in ranks]
    assert all(len(run["differ"]) > EXPERTS for run in plain)
    assert len({run["digest"] for run in plain}) == 2


def test_ddp_aot_eager_one_graph_and_ddp_optimizer_subgraphs(tmp_path):
    ranks = spawn("distributed_cases:ddp_aot_eager", tmp_path)
    one = [r["one_graph/fp32"] for r in ranks]
    assert_exact(one, in_graph=UPDATES)
    assert all(
        run["graphs"] == 1 and run["all_reduces"] == EXPERTS and run["reduced_here"] == 0 for run in one
    )
    split = [r["split/bf16"] for r in ranks]
    assert_exact(split, in_graph=UPDATES)
    assert all(
        run["graphs"] > 1 and run["all_reduces"] == EXPERTS and run["reduced_here"] == 0 for run in split
    )
    # Negative control: the pass without its all-reduce updates from local gradients.
    bare = [r["no_all_reduce"] for r in ranks]
    assert all(run["in_graph"] == UPDATES and run["differ"] for run in bare)
    assert len({run["digest"] for run in bare}) == 2
    # A graph whose compile fails runs eagerly: the hooks all-reduce, never a local update.
    failed = [r["pass_fails"] for r in ranks]
    for run in failed:
        assert run["differ"] == [] and run["by_hook"] == UPDATES and run["reduced_here"] == UPDATES
        assert run["fallbacks"] == ["RuntimeError: sonar: injected compiler failure"]
    assert len({run["digest"] for run in failed}) == 1


@pytest.mark.slow
def test_ddp_inductor_ddp_optimizer_subgraphs(tmp_path):
    """Inductor on DDP's default path, the graph split at bucket boundaries (optimize_ddp); the one
    graph of optimize_ddp=False runs the same pass, checked under aot_eager above."""
    ranks = spawn("distributed_cases:ddp_inductor_split", tmp_path, timeout_s=3000)
    runs = [r["split/bf16"] for r in ranks]
    assert_exact(runs, in_graph=UPDATES)
    assert all(run["all_reduces"] == EXPERTS and run["reduced_here"] == 0 for run in runs)
    assert all(run["graphs"] > 1 for run in runs), "DDP's optimizer splits the graph"


def test_fsdp2_eager_per_block_compiled_and_dcp_resume(tmp_path):
    ranks = spawn("distributed_cases_sharded:fsdp2_cases", tmp_path)
    for label in ("eager/fp32", "eager/bf16", "per_block/bf16"):
        assert_exact([r[label] for r in ranks], by_hook=UPDATES)  # per block: hooks, after reduce-scatter
    for r in ranks:
        assert r["resume"] == {"restored_equal": True, "differ": []}
        (warning,) = r["shared_group_warning"]
        assert "share their fully_shard group" in warning and "fully_shard_experts(model)" in warning


def test_expert_parallel_equals_its_standard_and_data_parallel(tmp_path):
    ranks = spawn("distributed_cases_sharded:ep_cases", tmp_path)
    for dtype in ("fp32", "bf16"):
        runs = [r[f"eager/{dtype}"] for r in ranks]
        for run in runs:
            assert run["differ"] == [] and run["by_hook"] == UPDATES and run["local_experts"] == 4
        assert len({run["dense_digest"] for run in runs}) == 1, "dense weights must agree across ranks"
    for r in ranks:
        # The EP layer trains like plain data parallelism up to fp32 rounding, with the 1/world scale only.
        assert r["vs_data_parallel"]["scaled"] < 1e-6 < 1e-5 < r["vs_data_parallel"]["unscaled"]
        assert r["titan"]["differ"] == [] and r["titan"]["by_hook"] == 3 * 6


def test_expert_parallel_nonfinite_on_one_rank_stops_every_rank(tmp_path):
    ranks = spawn("distributed_cases:ep_nonfinite", tmp_path)
    assert "layers.0.mlp.experts.down_proj" in ranks[1]["raised"]
    assert "expert tensors of another rank" in ranks[0]["raised"]
    assert all(r["abandoned"] for r in ranks)


def test_graph_compiled_with_all_reduce_is_refused_by_an_undistributed_model(tmp_path):
    for r in spawn("distributed_cases:mixed_up_graphs", tmp_path):
        assert "sonar_fx.distributed" in r["plain_reusing_ddp_graph"]


def test_world_size_4_is_close_to_ddp_and_ranks_agree_bitwise(tmp_path):
    """Per-tensor gloo all-reduce rounds differently from DDP's bucketed one beyond 2 ranks."""
    ranks = spawn("distributed_cases:ddp_world4", tmp_path, world=4)
    assert len({r["digest"] for r in ranks}) == 1
    assert all(r["max_abs_diff"] < 1e-5 and r["by_hook"] == UPDATES for r in ranks)


def test_gradient_memory_saving_per_engine_by_storage_count(tmp_path):
    """Sonar's saving is the engine's expert-gradient bytes (twice under DDP's bucket copies) less at
    most one layer; with experts in a shared FSDP2 group it is zero. Counted storage bytes, so the
    numbers are exact and the same on both ranks."""
    ranks = spawn("distributed_cases:memory_rows", tmp_path)
    assert ranks[0] == ranks[1]
    rows = {(r["engine"], r["arm"]): r for r in ranks[0]}
    every_grad = ranks[0][0]["all_grad_bytes"]
    assert rows[("DDP", "standard")]["peak_bytes"] == 2 * every_grad  # buckets + .grad, all of it
    assert rows[("DDP (gradient_as_bucket_view)", "standard")]["peak_bytes"] == every_grad
    for row in ranks[0]:
        assert row["standard_bytes"] - row["peak_bytes"] >= row["expected_min"], row
    ddp = rows[("DDP", "sonar")]
    assert ddp["standard_bytes"] - ddp["peak_bytes"] > ddp["expert_bytes"]  # the bucket copy goes too
    shared = rows[("FSDP2", "sonar, experts in the block's group")]
    assert shared["peak_bytes"] == shared["standard_bytes"]
    own = rows[("FSDP2", "sonar")]
    assert own["standard_bytes"] - own["peak_bytes"] >= own["expert_bytes"] - own["layer_bytes"] > 0
