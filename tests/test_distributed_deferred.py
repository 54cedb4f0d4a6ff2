"""schedule="deferred" on DDP and expert parallelism, gloo processes: bitwise the plain engine with
the user's no_sync() accumulation, one clip over every parameter (or the dense ones) and a GradScaler,
the logged norm the plain clip's; or refused at step() before any weight moves.

One spawn of 2 ranks runs every case (`distributed_cases_deferred`, and its expert-parallel cases
with one expert per rank and an inf in one rank's experts: `distributed_cases_deferred_ep`); each rank
reports its own comparison. DDP and expert parallelism under inductor and each engine on 4 ranks have
their own spawn (slow).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from distributed_cases_deferred import (
    EXACT,
    EXACT_EP,
    FOUR_RANKS,
    INDUCTOR,
    INDUCTOR_EP,
    MAX_NORM,
    STEPS,
    label,
)
from distributed_cases_deferred_ep import ONE_EXPERT_PER_RANK

import sonar_fx
from sonar_fx.optim.sliced_sum import SLICES

import distributed_worker
from helpers import CFG, known_library_failure

pytestmark = pytest.mark.multiprocess
EXPERT_TENSORS = 4  # tiny-olmoe: 2 layers x (gate_up, down)
SLICES_PER_PIECE = len(range(0, 8, -(-8 // SLICES)))  # tiny-olmoe's 8 experts in runs (`sliced_sum`)
IN_STEP_ORDER = [f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in ("gate_up_proj", "down_proj")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("deferred")
    distributed_worker.run("distributed_cases_deferred_ep:deferred_and_ep_cases", str(out))
    return distributed_worker.results(str(out))


def marked(case: tuple) -> object:
    dtype, compiler = case[0], case[2]
    compiled_fp32 = compiler != "eager" and dtype == "fp32"
    marks = known_library_failure(grouped_mm_compiled=torch.float32) if compiled_fp32 else ()
    return pytest.param(case, marks=marks, id=label(*case))


def check_ddp(run: dict, case: tuple) -> None:
    """One rank's DDP case: bitwise, the clip active, the logged norm the plain clip's, the saving."""
    accum = case[3]
    assert run["differ"] == [], run["differ"][:3]
    assert all(n > MAX_NORM for n in run["twin_norms"]), run["twin_norms"]  # clip active each step
    # The norm Sonar logs is the one the plain engine's clip_grad_norm_ returns, bit for bit.
    assert run["norms"] == run["twin_norms"]
    assert run["updates_deferred"] == STEPS * EXPERT_TENSORS
    assert run["kept_whole"] == []  # every expert gradient came from kept operands
    assert run["kept_operand_peak"] > 0
    assert run["fallbacks"] == []
    # The saving: before step() no expert `.grad` exists (DDP's buckets hold dense ones only) and only
    # a tensor that crossed over (its operands outgrew its gradient: 3-4 micro-batches here) holds a
    # gradient, in the deferred store; with 2 micro-batches none does and the kept operands are below
    # the expert gradients. At step() the gradients are computed one at a time (two while a tensor's
    # pieces are summed), beside those held since their crossover (a later backward's sum is added
    # into each when autograd runs its AccumulateGrad: one gradient each, and one piece for a moment).
    assert run["expert_grads_alive"] == 0
    assert run["held"] == len(run["crossed_over"])
    if accum == 2:
        assert run["crossed_over"] == {}
        assert 0 < run["kept_bytes"] < run["expert_grad_bytes"], run
    assert run["biggest_expert"] <= run["step_grad_peak"] <= 2 * (run["held_bytes"] + run["biggest_expert"])
    if case[2] != "eager":  # the graph pass kept the operands: no graph fell back to the eager capture
        assert run["graphs"] >= 1, run


@pytest.mark.parametrize("case", [marked(c) for c in EXACT])
def test_deferred_on_ddp_equals_plain_ddp_with_no_sync_accumulation(ranks, case):
    runs = [r[label(*case)] for r in ranks]
    for run in runs:
        check_ddp(run, case)
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree"


def check_ep(run: dict, case: tuple) -> None:
    """One rank's expert-parallel case: bitwise, the clip active, the logged norm torchtitan's."""
    assert run["differ"] == [], run["differ"][:3]
    assert all(n > MAX_NORM for n in run["twin_norms"]), run["twin_norms"]
    assert run["norms"] == run["twin_norms"]
    assert run["fallbacks"] == []
    assert run["biggest_expert"] <= run["step_grad_peak"] <= 2 * (run["held_bytes"] + run["biggest_expert"])
    # Sonar's own grouped-GEMM op: the eager capture keeps its operands, as the compiled blocks do
    assert run["updates_deferred"] == STEPS * EXPERT_TENSORS and run["kept_whole"] == []
    assert run["expert_grads_alive"] == 0 and run["held"] == len(run["crossed_over"])
    if case[2] != "eager":
        assert run["graphs"] >= 1


@pytest.mark.parametrize("case", EXACT_EP, ids=[label(*c) for c in EXACT_EP])
def test_deferred_on_expert_parallel_equals_the_plain_engine_with_no_sync_accumulation(ranks, case):
    """Each rank's own experts, scaled by 1/world at step() (no collective), the dense half through
    DDP; the norm over every parameter is torchtitan's (each expert counted once)."""
    runs = [r[label(*case)] for r in ranks]
    for run in runs:
        check_ep(run, case)
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense tensors"
    assert len({run["digest"] for run in runs}) == len(runs), "each rank holds its own experts"


def test_deferred_on_expert_parallel_with_one_expert_per_rank_equals_the_plain_engine(ranks):
    """2 experts on 2 ranks: each rank's expert tensors are (1, out, in), found as experts (the shard
    declares its layout), kept, updated at step() and bitwise the plain engine's."""
    runs = [r["ep/one_expert_per_rank"] for r in ranks]
    for run in runs:
        check_ep(run, ONE_EXPERT_PER_RANK)
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense tensors"
    assert len({run["digest"] for run in runs}) == len(runs), "each rank holds its own expert"


def test_deferred_on_eager_expert_parallel_saves_the_expert_gradients_less_the_kept_operands(ranks):
    """One eager step of 2 micro-batches, the clip over every parameter, metered on each rank (the
    storages alive at once): the deferred step's peak lies below the plain engine's by at least the
    rank's expert-gradient bytes less two expert tensors and the kept operands (no tensor crossed over),
    and trains bitwise as it. Negative control: with one expert per rank at top-2 every tensor's
    operands outgrow its gradient within a micro-batch; the step keeps the gradients whole (a warning
    says so) and saves nothing."""
    for run in [r["ep/eager_memory"] for r in ranks]:
        assert run["differ"] == [], run["differ"][:3]
        assert run["crossed_over"] == [] and run["kept_whole"] == [] and run["crossover_warnings"] == []
        assert run["plain_start"] == run["deferred_start"]  # the same weights, states and batch counted
        expected = run["expert_bytes"] - 2 * run["biggest_expert"] - run["kept_bytes"]
        assert expected > 0, run
        assert run["plain_peak"] - run["deferred_peak"] >= expected, run
    for run in [r["ep/eager_memory/crossed_over"] for r in ranks]:
        assert run["differ"] == [], run["differ"][:3]
        assert len(run["crossed_over"]) == run["expert_tensors"] and len(run["crossover_warnings"]) == 1
        # the same peak, to less than one expert tensor (measured: the same bytes)
        assert abs(run["plain_peak"] - run["deferred_peak"]) < run["biggest_expert"], run


@pytest.mark.parametrize("clip", ["all", "dense"])
def test_nonfinite_skip_with_an_inf_in_one_ranks_experts_skips_the_step_on_every_expert_parallel_rank(
    ranks, clip
):
    """An inf in one expert gradient of rank 1 only, with the clip over every parameter or the dense
    ones: no rank moves a weight that step (the verdict is over every rank; with the dense clip a rank
    deciding alone left the other waiting in the next collective), the steps around it train, and the
    run stays bitwise the plain engine that skips the same step."""
    runs = [r["ep/inf_in_one_ranks_experts" + ("/dense" if clip == "dense" else "")] for r in ranks]
    for run in runs:
        assert run["moved"][1] == []  # on the clean rank too
        assert run["moved"][0] == run["moved"][2] and len(run["moved"][0]) > EXPERT_TENSORS  # they train
        assert run["skipped_steps"] == 1
        assert run["differ"] == [], run["differ"][:3]
    # Each rank says why: the poisoned rank names its expert tensor, the clean one the other rank.
    (clean,), (poisoned,) = (run["skip_warnings"] for run in runs)
    assert ".mlp.experts." in poisoned and "another rank" in clean, (poisoned, clean)


def test_nonfinite_raise_with_an_inf_in_one_ranks_dense_gradient_stops_every_expert_parallel_rank(ranks):
    """nonfinite="raise", the dense clip: an inf in rank 1's dense gradient (before DDP averages it)
    stops every rank at step() before any weight moves, with no collective (the dense norm is the same
    on every rank); a clean step runs one verdict all-reduce, the experts' (it ran two: the dense step
    asked every rank too); the step after the raise trains on every rank."""
    for run in (r["ep/raise/dense_inf"] for r in ranks):
        assert run["all_reduces"] == [1, 0, 1]
        assert run["dense_name"] in run["raised"][1] and run["raised"][0] == run["raised"][2] == ""
        assert run["moved"][1] == []  # on every rank
        assert len(run["moved"][0]) == len(run["moved"][2]) > EXPERT_TENSORS  # they train


def test_nonfinite_raise_with_an_inf_in_one_ranks_experts_stops_every_expert_parallel_rank(ranks):
    """nonfinite="raise", the dense clip: an inf in one expert gradient of rank 1 stops every rank at the
    end of step() (the one verdict all-reduce of each step), the non-finite tensor untouched; the step
    after it trains on every rank."""
    runs = [r["ep/raise/expert_inf"] for r in ranks]
    for run in runs:
        assert run["all_reduces"] == [1, 1, 1]
        assert run["raised"][0] == run["raised"][2] == "" and len(run["moved"][2]) == len(run["moved"][0])
    (clean, poisoned), (moved_clean, moved_poisoned) = zip(
        *((run["raised"][1], run["moved"][1]) for run in runs), strict=True
    )
    assert "another rank" in clean and ".mlp.experts." in poisoned, (clean, poisoned)
    untouched = [n for n in moved_clean if n not in moved_poisoned]
    assert len(untouched) == 1 and untouched[0] in poisoned, untouched


@pytest.mark.slow
def test_deferred_on_ddp_under_inductor_equals_plain_ddp_under_inductor(tmp_path):
    distributed_worker.run("distributed_cases_deferred:deferred_inductor", str(tmp_path))
    runs = [r[label(*INDUCTOR)] for r in distributed_worker.results(str(tmp_path))]
    for run in runs:
        assert run["differ"] == [], run["differ"][:3]
        assert run["norms"] == run["twin_norms"] and all(n > MAX_NORM for n in run["norms"])
        assert run["updates_deferred"] == STEPS * EXPERT_TENSORS and run["kept_whole"] == []
        assert run["fallbacks"] == [] and run["graphs"] >= 1
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree"


@pytest.mark.slow
def test_deferred_on_expert_parallel_under_inductor_equals_the_plain_engine_under_inductor(tmp_path):
    """Each block compiled by inductor on both sides, bf16, 2 micro-batches, the clip over every
    parameter (torchtitan's norm): the graph of the local experts keeps their operands under inductor,
    the all-to-alls run between graphs, and the run is bitwise the plain engine's."""
    distributed_worker.run("distributed_cases_deferred:deferred_inductor_ep", str(tmp_path))
    runs = [r[label(*INDUCTOR_EP)] for r in distributed_worker.results(str(tmp_path))]
    for run in runs:
        check_ep(run, INDUCTOR_EP)
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense tensors"
    assert len({run["digest"] for run in runs}) == len(runs), "each rank holds its own experts"


@pytest.mark.slow
def test_deferred_on_ddp_on_four_ranks_equals_plain_ddp(tmp_path):
    """4 gloo ranks, fp32 eager, 4 micro-batches, the clip over all parameters: bitwise with each
    parameter in its own DDP bucket on both sides (`ONE_TENSOR_BUCKETS`: gloo's ring sums an element in
    an order set by its place in the buffer reduced); each all-reduce overlaps the next gradient. The
    negative control, DDP's default buckets on both sides, is last bits apart."""
    distributed_worker.run("distributed_cases_deferred:deferred_four_ddp", str(tmp_path), world=4)
    ranks = distributed_worker.results(str(tmp_path), world=4)
    case = FOUR_RANKS["ddp"]
    runs = [r[label(*case)] for r in ranks]
    for run in runs:
        check_ddp(run, case)
        assert run["overlapped"] == STEPS * 2 * (EXPERT_TENSORS - 1), run["overlapped"]
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree"
    for r in ranks:
        control = r["control/default_buckets"]
        assert control["differ"] and control["max_abs_diff"] > 0, control


@pytest.mark.slow
def test_deferred_on_expert_parallel_on_four_ranks_equals_the_plain_engine(tmp_path):
    """4 gloo ranks, two experts of each tensor per rank (8 in all), fp32 eager, 4 micro-batches, the
    clip over all parameters (torchtitan's norm): bitwise with DDP's default buckets (the dense ones
    alike on both sides; the experts need no collective)."""
    distributed_worker.run("distributed_cases_deferred:deferred_four_ep", str(tmp_path), world=4)
    case = FOUR_RANKS["ep"]
    runs = [r[label(*case)] for r in distributed_worker.results(str(tmp_path), world=4)]
    for run in runs:
        check_ep(run, case)
        assert run["overlapped"] == 0  # the rank's own experts: no collective in flight at step()
    assert len({run["dense_digest"] for run in runs}) == 1, "ranks disagree on the dense tensors"
    assert len({run["digest"] for run in runs}) == 4, "each rank holds its own experts"


@pytest.mark.parametrize("engine", ["ddp", "ep"])
def test_grad_scaler_fp16_autocast_with_overflowing_steps_equals_the_plain_engine(ranks, engine):
    """fp16 autocast, fp32 weights, a GradScaler whose scale overflows every other step, the clip over
    every parameter: bitwise the plain engine with `scaler.unscale_`, the clip (expert parallelism:
    torchtitan's norm, each expert counted once, the inf verdict over every rank) and `scaler.step`,
    each step's scale and the logged norm of each step taken included."""
    for r in ranks:
        check_scaler_run(
            r["grad_scaler" if engine == "ddp" else "grad_scaler/ep"], steps_taken=2, max_norm=MAX_NORM
        )


def check_scaler_run(run: dict, steps_taken: int, max_norm: float) -> None:
    """A GradScaler case against its plain twin: every tensor equal, the same scale after each step
    (backed off at least once), the same logged norm on each of at least `steps_taken` steps taken,
    each above the clip's threshold `max_norm`."""
    assert run["differ"] == [], run["differ"][:3]
    ours, theirs = zip(*run["scales"], strict=True)
    assert ours == theirs
    assert any(b < a for a, b in itertools.pairwise(theirs)), theirs  # a step overflowed: backed off
    stepped = [n for n in run["norms"] if math.isfinite(n[1])]
    assert len(stepped) >= steps_taken and all(o == t for o, t in stepped), run["norms"]
    assert all(n[1] > max_norm for n in stepped)  # the clip is active on every step taken


def test_nonfinite_skip_with_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks):
    for r in ranks:
        run = r["inf_on_one_rank"]
        assert run["moved_in_skipped"] == []  # on the clean rank too
        assert run["skipped_steps"] == 1
        assert run["differ"] == [], run["differ"][:3]


def test_expert_parallel_norm_reduces_each_tensor_over_the_ranks_as_torchtitan_does(ranks):
    """torchtitan's norm (DTensor's `get_total_norm(...).full_tensor()`) reduces each expert tensor's
    norm over the ranks, then takes the norm of those: Sonar's is that, bit for bit on every draw; each
    rank's total reduced once (the negative control) is other bits on some."""
    for r in ranks:
        seen = r["ep_norm"]
        assert all(seen["equal"]), seen
        assert not all(seen["per_rank_total_equal"]), seen


def test_negative_control_a_twin_syncing_every_micro_batch_differs(ranks):
    for r in ranks:
        assert r["control/sync_every"], "a sync on every micro-batch must give other bits"


@pytest.mark.parametrize(
    ("sync", "names"),
    [("every", ["micro-batch 1 of 2", "with model.no_sync():"]), ("never", ["last micro-batch", "outside"])],
)
def test_loop_ddp_reduces_otherwise_is_refused_at_step_before_any_weight_moves(ranks, sync, names):
    for r in ranks:
        run = r[f"refused/{sync}"]
        assert run["message"] is not None and all(n in run["message"] for n in names), run["message"]
        assert run["moved"] == []
        assert run["then"] == [], run["then"][:3]  # zero_grad() and the no_sync() loop: exact again


def test_model_sonar_clip_grad_norm_on_ddp_is_refused_before_it_clips(ranks):
    for r in ranks:
        run = r["users_clip"]
        assert run["message"] is not None and "expert_clip='global'" in run["message"], run["message"]
        assert run["dense_grads"] > 0 and run["clipped"] == []


def test_the_one_rule_lets_deferred_through_only_where_a_test_shows_it_exact():
    """DDP and expert parallelism run it (the tests above; FSDP2 and FSDP2 x EP:
    test_distributed_deferred_sharded); DDP's async in-backward overlap is refused by
    `distributed_gap`, naming the engines that run it."""
    for engine in ("ddp", "ep"):
        assert sonar_fx.api.distributed_gap(CFG, engine, "deferred") is None
    for engine in ("ddp-async",):
        gap = sonar_fx.api.distributed_gap(CFG, engine, "deferred")
        assert gap is not None and gap[0] == "schedule" and "ddp, ep, fsdp2 or fsdp2_ep engine" in gap[1], gap


@pytest.mark.parametrize("case", [marked(c) for c in EXACT])
def test_each_ddp_all_reduce_runs_while_the_next_expert_gradient_is_computed(ranks, case):
    """DDP's all-reduce of each expert gradient at step() is asynchronous: every gradient but the first
    of each pass is computed while the one before is reduced (two passes with the clip over all), its
    micro-batch pieces after the first added by expert slices (the eager capture's grouped GEMMs), and
    at most two are alive at once beside what backward kept and a slice (the meter counts the one in
    flight)."""
    passes = 2 if case[1] == "all" else 1
    for run in (r[label(*case)] for r in ranks):
        assert run["overlapped"] == STEPS * passes * (EXPERT_TENSORS - 1), run["overlapped"]
        if case[2] == "eager":  # pieces after the first, beside a gradient in flight: by slices
            sliced = [n for n in IN_STEP_ORDER[1:] if n not in run["crossed_over"]]  # (held whole: one piece)
            assert run["sliced"] == STEPS * passes * len(sliced) * (case[3] - 1) * SLICES_PER_PIECE, run
        if not run["crossed_over"]:  # (a tensor held since its crossover adds to the step's peak)
            assert run["step_grad_peak"] <= 2 * run["biggest_expert"], run


@pytest.mark.parametrize("case", EXACT_EP, ids=[label(*c) for c in EXACT_EP])
def test_expert_parallel_has_no_collective_in_flight_at_step(ranks, case):
    """Negative control: the rank's own experts need no collective, so nothing is held for one."""
    for run in (r[label(*case)] for r in ranks):
        assert run["overlapped"] == 0
