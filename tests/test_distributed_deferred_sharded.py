"""schedule="deferred" on FSDP2 and FSDP2 x EP, gloo processes: bitwise the plain engine (every
parameter's `full_tensor()`) with the user's `set_requires_gradient_sync(False)` accumulation and one
clip over every parameter (or the dense ones), the logged norm the plain clip's, fp16 autocast with a
GradScaler (an overflow included); or refused at step() before any weight moves.

One spawn runs the 2-rank cases (`distributed_cases_deferred_sharded`); FSDP2 with compiled blocks
(aot_eager, inductor) has its own, and the 4-rank cases (FSDP2, FSDP2 x EP on a 2 x 2 mesh) share one
(slow).
"""

from __future__ import annotations

import pytest
from distributed_cases_deferred_sharded import (
    COMPILED,
    EXACT,
    FOUR_RANKS,
    FOUR_RANKS_2D,
    INDUCTOR,
    MAX_NORM,
    ONE_EXPERT_PER_RANK,
    STEPS,
    label,
)
from test_distributed_deferred import SLICES_PER_PIECE, check_scaler_run

import sonar_fx

import distributed_worker
from helpers import CFG

pytestmark = pytest.mark.multiprocess
EXPERT_TENSORS = 4  # both tiny models: 2 layers x (gate_up, down)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("deferred_sharded")
    distributed_worker.run("distributed_cases_deferred_sharded:deferred_sharded", str(out))
    return distributed_worker.results(str(out))


def check_exact(run: dict, case: tuple) -> None:
    engine, _, _, compiler, accum = case[:5]
    assert run["differ"] == [], run["differ"][:3]
    assert all(n > MAX_NORM for n in run["twin_norms"]), run["twin_norms"]  # the clip is active every step
    # The norm Sonar logs is the one the plain engine's clip returns, bit for bit.
    assert run["norms"] == run["twin_norms"]
    assert run["fallbacks"] == []
    # Before step() no expert `.grad` exists on the shards, and FSDP2 reduce-scattered nothing of them.
    assert run["expert_grads_alive"] == 0
    # The saving: plain FSDP2 holds every expert's unsharded gradient across the unsynced micro-batches
    # (the rank's whole experts, E x out x in); Sonar holds none, its operands instead (eager FSDP2 x EP
    # too: the capture keeps the operands of the project's own grouped-GEMM op).
    assert run["unsharded_expert_grad_bytes"] == 0
    assert run["twin_unsharded_expert_grad_bytes"] == run["expert_grad_bytes"], run
    assert run["updates_deferred"] == STEPS * EXPERT_TENSORS and run["kept_whole"] == []
    assert run["kept_operand_peak"] > 0
    if compiler != "eager":  # the graph pass kept the operands: a graph was compiled, none fell back
        assert run["graphs"] >= 1
    if engine == "fsdp2" and accum == 2:  # the saving: the kept operands are below the expert gradients
        assert run["crossed_over"] == {}
        assert 0 < run["kept_bytes"] < run["expert_grad_bytes"], run
        # Beside each reduce-scatter in flight, the next gradient's second piece is added by expert
        # slices (`sliced_sum`): every gradient but the first of a pass, all tiny-olmoe's 8 experts.
        # A compiled block's kept recipe is its own program, whose pieces are made whole (not sliced).
        passes = 2 if case[2] == "all" else 1
        sliced = STEPS * passes * (EXPERT_TENSORS - 1) * SLICES_PER_PIECE if compiler == "eager" else 0
        assert run["sliced"] == sliced, run


@pytest.mark.parametrize("case", EXACT, ids=[label(*c) for c in EXACT])
def test_deferred_on_sharded_engines_equals_the_plain_engine_with_unsynced_accumulation(ranks, case):
    """FSDP2: each rank's full local expert gradient reduce-scattered to its Shard(0) slice as FSDP2
    reduces it, the norm over every parameter DTensor's (`full_tensor`). FSDP2 x EP: the same over the
    "dp" column with the world divide factor, the norm torchtitan's (each expert counted once)."""
    runs = [r[label(*case)] for r in ranks]
    for run in runs:
        check_exact(run, case)
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense parameters"
    expert_rows = case[5][1] if case[0] == "fsdp2_ep" else 1  # ranks of an "ep" row hold other experts
    assert len({run["digest"] for run in runs}) == expert_rows


def test_deferred_on_fsdp2_ep_with_one_expert_per_rank_equals_the_plain_engine(ranks):
    """As many experts as the ep size (2 over a 1 x 2 mesh): each rank's expert tensors are (1, out, in),
    found as experts, kept, updated at step() and bitwise the plain engine's with torchtitan's clip."""
    runs = [r["fsdp2_ep/one_expert_per_rank"] for r in ranks]
    for run in runs:
        check_exact(run, ONE_EXPERT_PER_RANK)
        assert run["experts_per_tensor"] == [1]  # the rank's (full, over its dp column) expert tensors
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense parameters"
    assert len({run["digest"] for run in runs}) == 2, "each rank holds its own expert"


def test_nonfinite_skip_with_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks):
    for r in ranks:
        run = r["inf_on_one_rank"]
        assert run["moved_in_skipped"] == []  # on the clean rank too
        assert run["skipped_steps"] == 1
        assert run["differ"] == [], run["differ"][:3]


@pytest.mark.parametrize("grid", ["fsdp2", "ep21", "ep12"])
def test_grad_scaler_with_overflow_equals_plain_fsdp2_with_the_scaler_and_clip(ranks, grid):
    """fp16 autocast, fp32 weights, a GradScaler whose scale overflows every other step, the clip over
    every parameter: bitwise the plain engine with `scaler.unscale_`, `clip_grad_norm_`, `scaler.step`
    (every parameter's full_tensor, each step's scale), on FSDP2 and FSDP2 x EP (2x1 and 1x2 grids)."""
    for r in ranks:
        check_scaler_run(r[f"grad_scaler/{grid}"], steps_taken=3, max_norm=MAX_NORM)


def test_a_shards_nonfinite_flag_is_the_whole_tensors_from_its_reduced_norm_with_no_collective(ranks):
    """An FSDP2 shard's flag comes from the whole tensor's norm (already reduced over ranks): an inf or
    NaN in one rank's shard flags the tensor on every rank (the shard's own verdict would not), with no
    collective of its own (fp32, bf16). float16 keeps the shard's own whole-tensor check: its reduced
    norm overflows for a finite gradient (norm ~693), which must not be flagged."""
    for rank, r in enumerate(ranks):
        verdicts = r["shard_verdicts"]
        for dtype in ("float32", "bfloat16"):
            for case, bad_rank in (("inf_in_rank_1", 1), ("nan_in_rank_0", 0)):
                v = verdicts[f"{case}/{dtype}"]
                assert v["flag"] == 1.0 and v["collectives"] == 0, (case, dtype, v)
                assert v["local"] == (1.0 if rank == bad_rank else 0.0)  # the control: local differs
            finite = verdicts[f"finite/{dtype}"]
            assert finite["flag"] == 0.0 and finite["collectives"] == 0, finite
        for case in ("inf_in_rank_1", "nan_in_rank_0"):
            assert verdicts[f"{case}/float16"]["flag"] == 1.0
        overflow = verdicts["finite/float16"]
        assert not overflow["norm_finite"] and overflow["flag"] == 0.0, overflow
        assert overflow["collectives"] > 0  # the shard's own check: the whole tensor's min and max


@pytest.mark.parametrize("grid", ["fsdp2", "ep12"])
def test_grad_scaler_inf_in_one_ranks_expert_gradient_skips_the_step_on_every_rank(ranks, grid):
    """The dense gradients finite, one expert gradient non-finite on rank 1 only (on the 1x2 grid no
    other rank holds that expert): no weight moves on any rank, the scale backs off on every rank."""
    runs = [r[f"expert_inf/{grid}"] for r in ranks]
    for run in runs:
        assert run["moved"][1] == [] and run["moved"][0] and run["moved"][2]
        assert run["scales"][1] < run["scales"][0]
    assert len({tuple(run["scales"]) for run in runs}) == 1


def test_grad_scaler_unscale_is_recognised_but_a_users_clip_after_it_is_refused(ranks):
    """The scaler's in-place unscale of the dense shards is a write the watch sees (unrecognised, the
    step would be refused); `accept_unscale` recognises it, not a clip after it; and end to end, the
    plain recipe's own clip_grad_norm_ after `scaler.unscale_` is refused at step(), nothing moved."""
    for r in ranks:
        watch = r["watch_under_scaler"]
        assert watch["seen/False"] > 0 and watch["accepted/False"] and watch["left/False"] == 0
        assert watch["seen/True"] > 0 and not watch["accepted/True"] and watch["left/True"] > 0
        run = r["user_clip_under_scaler"]
        assert run["message"] is not None and "clip_grad_norm_ of your own" in run["message"], run
        assert run["moved"] == []


def test_negative_control_a_twin_syncing_every_micro_batch_differs(ranks):
    for r in ranks:
        assert r["control/sync_every"], "a sync on every micro-batch must give other bits"


@pytest.mark.parametrize(
    ("sync", "names"),
    [
        ("every", ["micro-batch 1 of 2", "set_requires_gradient_sync(False)", "zero_grad()"]),
        ("never", ["last micro-batch", "set_requires_gradient_sync(True)", "step() again"]),
    ],
)
def test_loop_fsdp2_reduces_otherwise_is_refused_at_step_before_any_weight_moves(ranks, sync, names):
    for r in ranks:
        run = r[f"refused/{sync}"]
        assert run["message"] is not None and all(n in run["message"] for n in names), run["message"]
        assert run["moved"] == []
        assert run["then"] == [], run["then"][:3]  # the message's fix: exact again


@pytest.mark.slow
def test_deferred_on_fsdp2_with_compiled_blocks_equals_plain_fsdp2_with_compiled_blocks(tmp_path):
    distributed_worker.run("distributed_cases_deferred_sharded:deferred_sharded_compiled", str(tmp_path))
    runs = [r[label(*COMPILED)] for r in distributed_worker.results(str(tmp_path))]
    for run in runs:
        check_exact(run, COMPILED)
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree on the full parameters"


@pytest.mark.slow
def test_deferred_on_fsdp2_with_inductor_blocks_equals_plain_fsdp2_with_inductor_blocks(tmp_path):
    """Each block compiled by inductor on both sides, bf16, 4 micro-batches, the clip over every
    parameter: the graph pass keeps the operands under inductor too, bitwise the plain engine."""
    distributed_worker.run("distributed_cases_deferred_sharded:deferred_sharded_inductor", str(tmp_path))
    runs = [r[label(*INDUCTOR)] for r in distributed_worker.results(str(tmp_path))]
    for run in runs:
        check_exact(run, INDUCTOR)
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree on the full parameters"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("deferred_sharded_four")
    distributed_worker.run("distributed_cases_deferred_sharded:deferred_sharded_four", str(out), world=4)
    return distributed_worker.results(str(out), world=4)


@pytest.mark.slow
def test_deferred_on_fsdp2_on_four_ranks_equals_plain_fsdp2(four_ranks):
    runs = [r[label(*FOUR_RANKS)] for r in four_ranks]
    for run in runs:
        check_exact(run, FOUR_RANKS)
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree on the full parameters"


@pytest.mark.slow
def test_deferred_on_fsdp2_ep_on_a_two_by_two_mesh_equals_the_plain_engine(four_ranks):
    """4 ranks as a 2 x 2 (dp, ep) mesh, fp32 eager, 4 micro-batches, the clip over every parameter
    (torchtitan's, each expert counted once over both mesh dimensions): tokens exchanged within each
    ep row, each expert tensor's gradient reduce-scattered over its dp column as FSDP2 reduces it."""
    runs = [r[label(*FOUR_RANKS_2D)] for r in four_ranks]
    for run in runs:
        check_exact(run, FOUR_RANKS_2D)
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense parameters"
    # Full experts: alike down a dp column, other experts across an ep row.
    assert len({run["digest"] for run in runs}) == 2, "each ep row holds the same experts"


def test_the_one_rule_lets_deferred_through_on_every_engine_a_test_shows_exact():
    """DDP, expert parallelism (test_distributed_deferred), FSDP2 and FSDP2 x EP (above) run it; DDP's
    async in-backward overlap is refused by `distributed_gap`, naming the engines that run it."""
    for engine in ("ddp", "ep", "fsdp2", "fsdp2_ep"):
        assert sonar_fx.api.distributed_gap(CFG, engine, "deferred") is None
    gap = sonar_fx.api.distributed_gap(CFG, "ddp-async", "deferred")
    assert gap is not None and gap[0] == "schedule" and "fsdp2" in gap[1], gap
