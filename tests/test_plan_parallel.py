"""`sonar-fx plan --parallel ddp|ep|fsdp2 --world N`: one rank of a parallel run, planned from the
one-process step with what the engine changes on a rank, or (FSDP2) from the engine's own step on a fake
process group (`sonar_fx.planner.parallel`). The measured 2-rank step it is held to (within 3%) is
`benchmarks.distributed_deferred`'s, counted by `LiveStorageMeter` (frees on every thread); here, the
plan's arithmetic on a tiny config and what the meter counts.
"""

import json
import math
import threading

import pytest
import torch
import torch.distributed as dist

from sonar_fx.cli import main
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet, discover_experts
from sonar_fx.memory import ExpertGradBytes, measure_peak
from sonar_fx.memory_live import LiveStorageMeter
from sonar_fx.models import build_model
from sonar_fx.models.tiny import tiny_config
from sonar_fx.planner import PlanError, plan, planning
from sonar_fx.planner.models import model_source
from sonar_fx.planner.modes import OFFSET_BYTES
from sonar_fx.planner.parallel import Layout
from sonar_fx.planner.planning import default_methods

SHAPE = dict(num_experts=8, num_experts_per_tok=2, hidden_size=32, intermediate_size=32, num_hidden_layers=2)
DEFERRED = "sonar_deferred_global_clip"
KW = dict(batch=2, seq=8, dtype="bf16", device="cpu", grad_accum=2, opt_cfg=AdamWConfig(lr=1e-3))


def _dense_bytes() -> int:
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, **SHAPE)
    experts = {id(p) for p in ExpertSet.discover(model).params}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)


@pytest.fixture(scope="module")
def plans():
    config = tiny_config("tiny-olmoe", **SHAPE)
    return {engine: plan(config, methods=(DEFERRED,), parallel=engine, world=2 if engine else 1, **KW)
            for engine in (None, "ddp")}  # fmt: skip


def test_a_ddp_rank_is_the_one_process_step_plus_the_dense_buckets(plans):
    """Sonar keeps the experts out of DDP: its buckets copy the dense gradients, alive for the run."""
    alone, rank = plans[None].method(DEFERRED), plans["ddp"].method(DEFERRED)
    buckets = _dense_bytes()
    assert rank.step_start_bytes == alone.step_start_bytes + buckets
    assert rank.categories["gradients"] == alone.categories["gradients"] + buckets
    # Each expert gradient's all-reduce is in flight while the next is computed: never below.
    assert rank.peak_allocated_bytes >= alone.peak_allocated_bytes + buckets
    assert plans["ddp"].expert_grad == plans[None].expert_grad  # every rank holds every expert
    assert (plans["ddp"].parallel, plans["ddp"].world) == ("ddp", 2)


def test_a_plain_ddp_rank_holds_buckets_for_every_parameter():
    """The plain engine's DDP reduces every gradient, experts included: its buckets copy them all (the
    planned `standard` rank's peak and start are the one-process step's plus these bytes)."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, **SHAPE)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    rank = Layout(engine="ddp", world=2)
    assert (
        rank.bucket_bytes(model, sonar=False)
        == every
        > rank.bucket_bytes(model, sonar=True)
        == _dense_bytes()
    )


def test_an_expert_parallel_rank_holds_its_share_of_the_experts():
    """The rank's model: E/world experts per layer, the whole router (E outputs, the same top-k, as the
    engine keeps it); DDP's buckets for the dense part."""
    source = model_source(tiny_config("tiny-olmoe", **SHAPE))
    rank = Layout(engine="ep", world=2)
    alone, mine = (s.build(torch.bfloat16) for s in (source, rank.source(source)))
    halves = [ExpertGradBytes.of(discover_experts(m)).total for m in (alone, mine)]
    assert halves[1] * 2 == halves[0]
    assert mine.config.num_experts_per_tok == alone.config.num_experts_per_tok
    routers = [m.model.layers[0].mlp.gate.weight.shape for m in (alone, mine)]
    assert routers[0] == routers[1] == (SHAPE["num_experts"], SHAPE["hidden_size"])
    dense = sum(p.numel() * p.element_size() for p in mine.parameters()) - halves[1]
    assert rank.bucket_bytes(mine, sonar=True) == rank.bucket_bytes(mine, sonar=False) == dense


FEWER_THAN_TOP_K = dict(SHAPE, num_experts=2, intermediate_size=48, num_hidden_layers=1)
"""2 experts of top-2 over 2 ranks: one expert per rank (El = 1 < top-k = 2), as the engine runs it
(`holds_expert_shard`); n = 48 keeps the kept operands below the gradients (no crossover)."""


def test_an_expert_parallel_rank_computes_every_slot_routed_to_it_however_few_its_experts():
    """With fewer experts on a rank than top-k, the rank still computes batch x seq x top-k slots in
    expectation (every rank's slots, El/E of them each; exactly that here: each token picks both
    experts), not batch x seq (half these operands): the deferred step keeps both GEMMs' operands for
    each of those slots (in + out widths: d + 2n, n + d) per micro-batch and layer, and one offsets
    entry per local expert. The planner refused this rank before (fewer experts than top-k)."""
    shape, top_k = FEWER_THAN_TOP_K, FEWER_THAN_TOP_K["num_experts_per_tok"]
    kw = dict(KW, batch=1, seq=4)
    planned = plan(tiny_config("tiny-olmoe", **shape), methods=(DEFERRED,), parallel="ep", world=2, **kw)
    d, n, layers, size = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], 2
    slots = kw["batch"] * kw["seq"] * top_k
    operands = kw["grad_accum"] * layers * slots * ((d + 2 * n) + (n + d)) * size
    offsets = layers * 2 * 1 * OFFSET_BYTES  # 2 tensors per layer, 1 local expert each
    deferred = planned.method(DEFERRED)
    assert deferred.crossed_over == ()
    assert deferred.kept_operand_bytes == operands + offsets
    assert (
        planned.expert_grad.total * 2
        == ExpertGradBytes.of(
            discover_experts(build_model("tiny-olmoe", dtype=torch.bfloat16, **shape))
        ).total
    )  # the rank holds one of the two experts


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(world=2), "--parallel"),
        (dict(parallel="fsdp2", world=1), "2 or more ranks"),
        (dict(parallel="ddp", world=1), "2 or more ranks"),
        (dict(parallel="ep", world=3), "divide evenly"),
    ],
)
def test_what_a_rank_cannot_be_planned_as_is_refused_naming_why(kwargs, says):
    with pytest.raises(PlanError, match=says):
        plan(tiny_config("tiny-olmoe", **SHAPE), methods=(DEFERRED,), **{**KW, **kwargs})


def test_the_cli_plans_a_rank(capsys):
    args = ["plan", "--model", "tiny-olmoe", "--batch", "1", "--seq", "4", "--device", "cpu", "--dtype",
            "fp32", "--methods", DEFERRED, "--grad-accum", "2", "--parallel", "ddp", "--world", "2",
            "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["parallel"], out["world"]) == ("ddp", 2)
    assert out["methods"][0]["peak_allocated_bytes"] > out["methods"][0]["step_start_bytes"]


# --------------------------------------------------------------------------------- an FSDP2 rank


@pytest.fixture(scope="module")
def fsdp2_plan():
    return plan(tiny_config("tiny-olmoe", **SHAPE), methods=("standard", DEFERRED), parallel="fsdp2", world=2,
                **KW)  # fmt: skip


def _rank0_bytes(world: int) -> int:
    """Rank 0's shard of every parameter (world 1: every parameter whole): `fully_shard` splits dim 0 as
    `torch.chunk` does, the first ranks taking ceil(rows / world) rows."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, **SHAPE)
    params = list(model.parameters())
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size() for p in params)


def test_an_fsdp2_rank_starts_with_its_shards_of_weights_and_both_adamw_moments(plans, fsdp2_plan):
    """The one process holds every weight and both AdamW moments of it; FSDP2's rank 0 holds its shard of
    each, three times (the moments are the shard's shape): the rest (step counters, the batch) is the
    same. Both methods start alike, Sonar's expert moments sharded as plain FSDP2's are."""
    whole, shards = _rank0_bytes(1), _rank0_bytes(2)
    assert whole // 2 < shards < whole  # (odd row counts: rank 0 takes the larger half)
    expected = plans[None].method(DEFERRED).step_start_bytes - 3 * (whole - shards)
    for method in ("standard", DEFERRED):
        assert fsdp2_plan.method(method).step_start_bytes == expected, method


def test_a_plain_fsdp2_rank_holds_every_unsharded_gradient_of_the_unsynced_micro_batches(fsdp2_plan):
    """Under `set_requires_gradient_sync(False)` FSDP2 keeps each parameter's whole (unsharded) gradient
    until the synced backward: the plain step's peak holds at least all of them beside the shards; the
    deferred step keeps operands for the experts instead, and peaks lower."""
    whole = _rank0_bytes(1)
    plain, deferred = fsdp2_plan.method("standard"), fsdp2_plan.method(DEFERRED)
    assert plain.peak_allocated_bytes >= plain.step_start_bytes + whole
    assert deferred.peak_allocated_bytes < plain.peak_allocated_bytes
    assert deferred.kept_operand_bytes > 0
    assert (fsdp2_plan.parallel, fsdp2_plan.world) == ("fsdp2", 2)


def test_an_fsdp2_plan_leaves_no_process_group_and_refuses_to_run_inside_one(monkeypatch):
    """The plan's fake process group is destroyed after it, also when planning a method fails inside it;
    inside a process group of the caller's, the plan is refused before it makes one. The distributed
    engines run no oib_all: left out of their default methods, refused by name before any model is
    built (DDP's and expert parallelism's plans run one process's step, which would plan it)."""
    config = tiny_config("tiny-olmoe", **SHAPE)
    assert "oib_all" in default_methods(None)
    for engine in ("ddp", "ep", "fsdp2"):
        assert "oib_all" not in default_methods(engine) and "sonar" in default_methods(engine)
        with pytest.raises(PlanError, match=rf"\['oib_all'\] are not available on the {engine} engine"):
            plan(config, methods=("standard", "oib_all"), parallel=engine, world=2, **KW)

    def fails(*args, **kwargs):
        assert dist.is_initialized()  # inside FSDP2's fake process group
        raise RuntimeError("a method that fails while planned")

    monkeypatch.setattr(planning, "MethodRun", fails)
    with pytest.raises(RuntimeError, match="fails while planned"):
        plan(config, methods=("standard",), parallel="fsdp2", world=2, **KW)
    assert not dist.is_initialized()
    monkeypatch.undo()
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(PlanError, match="has a process group already"):
            plan(config, methods=("standard",), parallel="fsdp2", world=2, **KW)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------- the measurement the plan is held to

MIB = 2**20


def test_the_live_count_sees_a_free_on_another_thread_that_the_profiler_misses():
    """A gradient an asynchronous collective's thread lets go of: freed before the next allocation, so
    one of the two is alive at a time. The count says so; the profiler (negative control) records no
    free on that thread and counts both."""
    alive = torch.zeros(MIB // 4)
    box: dict[str, torch.Tensor] = {}
    meter = LiveStorageMeter([alive])

    def step() -> None:
        with meter:
            box["grad"] = torch.ones(MIB // 4) * 2  # 1 MiB, freed elsewhere
            other = threading.Thread(target=box.clear)
            other.start()
            other.join()
            (torch.ones(MIB // 4) * 3).sum()

    _, profiled = measure_peak(step)
    assert meter.start_bytes == MIB
    assert meter.peak_bytes - meter.start_bytes == 2 * MIB  # ones(), then its product: never more
    assert meter.frees_elsewhere == 1
    assert meter.now == meter.start_bytes  # everything made in the region is gone
    assert profiled.peak_bytes >= 3 * MIB  # the control: the freed gradient still counted


def test_a_storage_an_op_only_writes_is_counted_once():
    """DDP's bucket is alive for the run (`constant_bytes`) and written by the reducer's copies: seen as
    an op's argument and output, it is not a new allocation."""
    bucket, grad = torch.zeros(MIB // 4), torch.ones(MIB // 4)
    with LiveStorageMeter([grad], constant_bytes=MIB) as meter:
        bucket.copy_(grad)
        bucket.view(2, -1).mul_(2)
    assert meter.peak_bytes == meter.start_bytes == 2 * MIB


def test_a_storage_resized_in_place_is_reread_after_every_op():
    """FSDP2's all-gather outputs: allocated and freed by resizing their storage, outside any op."""
    gathered = torch.empty(0)
    with LiveStorageMeter(resizable=[gathered]) as meter:
        gathered.untyped_storage().resize_(MIB)
        torch.ones(1).add_(1)  # any op: the resize is seen here
        gathered.untyped_storage().resize_(0)
        torch.ones(MIB // 4).add_(1)
    assert meter.peak_bytes == MIB + 4


def test_the_peak_is_named_by_the_phase_it_was_reached_in():
    """The caller names what the region is doing; the peak keeps the name it had when reached: here the
    first phase's 2 MiB, not the second's 1 MiB (negative control: the phase the region ended in)."""
    with LiveStorageMeter() as meter:
        meter.phase = "backward"
        (torch.ones(MIB // 4) * 2).sum()  # ones(), its product: 2 MiB at once
        meter.phase = "step"
        torch.ones(MIB // 4).sum()
    assert meter.peak_bytes >= 2 * MIB
    assert meter.peak_phase == "backward" and meter.phase == "step"


_KEPT_BY_AN_OP: list[torch.Tensor] = []


@torch.library.custom_op("sonar_fx_tests::keep_a_product", mutates_args=())
def _keep_a_product(x: torch.Tensor) -> torch.Tensor:
    """Makes and keeps a tensor in its own body (as the deferred store's fold inside a kept op)."""
    _KEPT_BY_AN_OP.append(x * 2)
    return x.sum()


def test_a_tensor_an_ops_body_keeps_is_counted_through_held():
    """A custom op's body runs below the mode: what it makes and keeps is seen only where the holder's
    tensors are handed in (`held`); without them (negative control) the 1 MiB is missed."""
    x = torch.ones(MIB // 4)
    kept = {}
    for handed in (False, True):
        _KEPT_BY_AN_OP.clear()
        with LiveStorageMeter([x], held=(lambda: list(_KEPT_BY_AN_OP)) if handed else None) as meter:
            _keep_a_product(x)
        kept[handed] = meter.now - meter.start_bytes
    assert kept == {False: 0, True: MIB}
    _KEPT_BY_AN_OP.clear()
