"""The distributed deferred benchmark's own logic, without its processes: which runs are smoke tests
and where each writes (`benchmarks.distributed_runs`), the memory table's per-step crossover count on
one gloo rank, and the FSDP2 run's plan beside its count. Timings are never asserted here.
"""

import dataclasses
import json

import pytest
import torch

from benchmarks import common
from benchmarks.common import Table


def _time_rows(plain_s: float, deferred_s: float, rounds: int) -> list:
    from benchmarks.distributed_deferred import TimeRow

    return [TimeRow(engine="ddp", rank=0, clip="dense", plain_s=[plain_s] * rounds,
                    deferred_s=[deferred_s] * rounds, extra_gemm_s=[])]  # fmt: skip


def test_distributed_deferred_quick_says_its_ratios_are_a_smoke_test_and_grades_none():
    """`--quick` (the micro model, 2 rounds): its time table says it is a smoke test and why, its time
    goal shows the ratio ungraded, and it writes *_smoke (never shown, never over the measured run);
    the default run's table and goal are a measurement, graded."""
    from benchmarks import distributed_deferred as dd
    from benchmarks.distributed_arms import QUICK, Config
    from benchmarks.distributed_runs import MEASURED_ROUNDS

    slow = _time_rows(1.0, 2.0, QUICK.rounds)  # 2.00x: MISSED if it were graded
    table, (graded,) = dd.time_table(slow, QUICK), dd.goals([], slow, QUICK)
    assert "SMOKE TEST" in table.title and "olmoe-micro" in table.note and "2 paired rounds" in table.note
    assert graded.status == common.NOT_MEASURED and graded.measured.startswith("2.00x")
    assert dd.results_name(QUICK) == "distributed_deferred_smoke"
    assert (
        dd.results_name(dataclasses.replace(QUICK, engines=("fsdp2",))) == "distributed_deferred_fsdp2_smoke"
    )
    # Either reason alone makes it a smoke test: the full model with 2 rounds, the micro one with 15.
    assert "2 paired rounds" in dd.smoke_test(dataclasses.replace(Config(), rounds=2))
    assert "olmoe-micro" in dd.smoke_test(dataclasses.replace(QUICK, rounds=MEASURED_ROUNDS))
    # The negative control: the default run measures, and is graded.
    measured = _time_rows(1.0, 2.0, Config().rounds)
    table, (graded,) = dd.time_table(measured, Config()), dd.goals([], measured, Config())
    assert dd.smoke_test(Config()) is None and "SMOKE" not in table.title + table.note
    assert graded.status == "MISSED"
    assert dd.results_name(Config()) is None
    assert dd.results_name(dataclasses.replace(Config(), engines=("fsdp2",))) == "distributed_deferred_fsdp2"
    other_shape = dataclasses.replace(Config(), shape="olmoe-cpu-8e")
    assert dd.results_name(other_shape) == "distributed_deferred_olmoe-cpu-8e"
    assert dd.results_name(other_shape, "distributed_plan") == "distributed_plan_olmoe-cpu-8e"


def _memory_row(engine: str = "fsdp2", rank: int = 0, planned: int = 0, **counts: int):
    from benchmarks.distributed_deferred import MemoryRow

    mib = dict(plain_peak=300, deferred_peak=200, expert_bytes=100, two_tensors=20, kept_bytes=10)
    n = {k: v * 2**20 for k, v in mib.items()} | {"crossed_over": 0} | counts
    return MemoryRow(engine=engine, rank=rank, plain_profiled=n["plain_peak"],
                     deferred_profiled=n["deferred_peak"], frees_elsewhere=0, planned_plain=planned,
                     planned_peak=planned, overlapped=0, plain_peak_in="backward", deferred_peak_in="step",
                     expert_tensors=8, **n)  # fmt: skip


def test_distributed_quick_plan_and_timeline_write_their_smoke_results_never_the_measured_ones(
    tmp_path, monkeypatch
):
    """`--plan --quick` and `--timeline --quick` write distributed_plan_smoke / distributed_timeline_smoke
    (as `--quick` writes distributed_deferred_smoke), every table titled a smoke test; without --quick
    (the negative control) the measured names, unlabelled; `--plan --engines fsdp2` its own. The runs are
    stood in for (the output folder is what is tested)."""
    from benchmarks import deferred_timeline
    from benchmarks import distributed_deferred as dd

    ran = []
    monkeypatch.setattr(dd, "measured_and_planned", lambda cfg: ran.append(cfg) or [_memory_row()])
    monkeypatch.setattr(dd, "per_rank", lambda cfg, job: [])  # no time rounds
    timeline_table = Table(title="Deferred step timeline", headers=["rank"], rows=[["rank 0"]])
    monkeypatch.setattr(deferred_timeline, "run_timeline", lambda cfg: common.Output(tables=[timeline_table]))
    for flags, written in [
        (["--plan", "--quick"], "distributed_plan_smoke"),
        (["--timeline", "--quick"], "distributed_timeline_smoke"),
        (["--plan"], "distributed_plan"),
        (["--timeline"], "distributed_timeline"),
        (["--plan", "--engines", "fsdp2"], "distributed_plan_fsdp2"),
        (["--quick"], "distributed_deferred_smoke"),
    ]:
        out = tmp_path / "_".join(flags)
        dd.main([*flags, "--out", str(out)])
        assert [p.name for p in out.iterdir()] == [written]
        titles = [t["title"] for t in json.loads((out / written / "results.json").read_text())["tables"]]
        smoke = [t.endswith(": a SMOKE TEST, not a measurement") for t in titles]
        assert smoke == [written.endswith("_smoke")] * len(titles), titles
    assert ran[0].shape == "olmoe-micro" and ran[1].shape == "olmoe-cpu"  # the quick Config, then the default


@pytest.fixture
def one_rank(tmp_path):
    """A world of one gloo process (this one): the distributed benchmark's arms on one rank."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_distributed_memory_counts_the_crossovers_of_the_measured_step_not_the_run(
    one_rank, deferred_saving_lost
):
    """olmoe-micro's expert tensors all cross over within 2 micro-batches (their operands outgrow their
    gradient) and none within 1: after a step of 2, a measured step of 1 counts 0 crossed over, while
    the run's record (the negative control, what the column counted) still holds all 4; a measured step
    of 2 counts 4."""
    from benchmarks import distributed_deferred as dd
    from benchmarks.distributed_arms import QUICK, build, steps_of

    torch.set_num_threads(1)  # a micro model: more threads only add contention (conftest restores it)
    cfg = dataclasses.replace(QUICK, world=1)
    arm = build(cfg, "ddp", True, "all")
    two, again = steps_of(cfg, 2, seed=1)
    arm.train(two)
    assert len(arm.sonar.deferred.crossed) == 4  # the run's record
    assert dd._measure_step(arm, again[:1]).crossed_over == 0
    assert dd._measure_step(arm, again).crossed_over == 4
    assert dd._measure_step(build(cfg, "ddp", False, "all"), again).crossed_over == 0  # the plain arm
    row = _memory_row(expert_bytes=1, crossed_over=3)  # expected <= 0: the cell says what it counts
    assert row.saving_cell() == "none expected (3/8 crossed over in the step)"


def test_distributed_fsdp2_run_plans_each_rank_beside_its_count_graded_within_3_percent(monkeypatch):
    """`--engines fsdp2` (the timed run) tables the planner's peak beside each rank's counted one, with
    the error, and grades it against the 3% goal: 2% off is met, 4% off (negative control) MISSED."""
    from benchmarks import distributed_deferred as dd
    from benchmarks.distributed_arms import Config

    cfg = Config(engines=("fsdp2",), rounds=0)
    counted = 200 * 2**20
    rows = [
        [dataclasses.asdict(_memory_row(rank=k, plain_peak=counted, deferred_peak=counted))] for k in (0, 1)
    ]
    monkeypatch.setattr(dd, "per_rank", lambda cfg, job: rows)
    for off, status in ((1.02, "met"), (1.04, "MISSED")):
        planned = int(counted * off)
        monkeypatch.setattr(dd, "planned_peaks", lambda cfg, e, n=planned: {"standard": n, dd.DEFERRED: n})
        out = dd.run(cfg)
        (plan,) = [t for t in out.tables if t.title == "Plan vs measured per rank"]
        assert [r[:3] + r[6:8] for r in plan.rows] == [
            ["fsdp2", str(k), arm, f"{planned / 2**20:.1f}", f"{off - 1:+.1%}"]
            for k in (0, 1) for arm in ("plain", "deferred")
        ]  # fmt: skip
        graded = {g.name: g.status for g in out.goals if "planned" in g.name}
        assert graded == {f"fsdp2 rank {k} {arm}: |planned - measured| / measured": status
                          for k in (0, 1) for arm in ("plain", "deferred")}  # fmt: skip
    assert out.script == "distributed_deferred_fsdp2"
