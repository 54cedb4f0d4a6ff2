"""Question: what do the deferred schedule's memory and time look like per rank on DDP, EP and FSDP2?

Under the recipe people run: micro-batches accumulated without gradient sync but at the last, one
clip.

Each engine runs its plain recipe (every gradient kept until `step()`, `clip_grad_norm_`, fused AdamW)
against Sonar's deferred schedule on the same engine, on `world` gloo processes, the OLMoE-shaped
benchmark model (`benchmarks.workload.SHAPES`), `accum` micro-batches per step, the user's loop on both
sides (DDP: `no_sync()`; FSDP2: `set_requires_gradient_sync(False)`; on all but the last). Per rank:
- memory (clip over every parameter): the step's peak of allocated bytes, the bytes alive at its start
  (weights, optimizer states, gradients, DDP's buckets, the batch: storage bytes, FSDP2's shards) plus
  the profiler's transient peak above it (`sonar_fx.memory.measure_peak`). The saving against the plain
  engine is graded against what the design predicts: the expert-gradient bytes the plain engine holds
  on the rank, less the two expert tensors the pipelined step holds (one in flight, one being
  computed), less the kept operands (a floor: it takes the plain peak at its step, where a peak in
  backward also holds a micro-batch's activations; the table says in which phase each peak lies).
  Where the kept operands and two tensors reach the expert gradients (each expert receives so many
  slots that its operands outgrow its gradient: it crosses over and keeps its gradient whole, as the
  plain engine does) nothing is expected, the table says so, and the goal is that the deferred step
  costs nothing more. The planner's per-rank peak (`sonar_fx.plan(..., parallel=engine,
  world=world)`; DDP, EP and FSDP2) is graded against the measured one;
- time (paired ratios over `rounds` rounds, arms interleaved): the dense-only clip (one pass) and the
  clip over all parameters (a norm pass that computes every expert gradient once more: the extra
  weight-gradient GEMMs, timed apart by recomputing every gradient once from the kept operands, are
  the floor of that ratio);
- `--timeline` (`benchmarks.deferred_timeline`): live memory through one DDP step on each rank, each
  expert gradient's all-reduce marked from its start to its wait.
`--quick`, alone or with `--plan` / `--timeline`, is a smoke test of the code paths: labelled so and
written to <its results name>_smoke, never over the measured results (`benchmarks.distributed_runs`).
This module never asserts anything; the goals table grades it.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import common
from benchmarks.common import Goal, Mode, Output, Override, Table, goal, mib
from benchmarks.distributed_arms import ENGINES, MAX_NORM, QUICK, Arm, Config, build, steps_of
from benchmarks.distributed_runs import (
    SCRIPT,
    labelled_smoke,
    memory_only,
    memory_tables,
    results_name,
    smoke_test,
)
from benchmarks.workload import SHAPES
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import fmt_ratio, paired_ratio
from sonar_fx.memory import measure_peak
from sonar_fx.memory_live import LiveStorageMeter
from sonar_fx.planner import plan

# ------------------------------------------------------------------------------------------ memory


@dataclass(frozen=True, kw_only=True)
class MemoryRow:
    engine: str
    rank: int
    plain_peak: int
    """The plain engine's step 2: the most storage bytes alive at once, counted from the tensors
    (`LiveStorageMeter`: frees on every thread), DDP's buckets included."""
    deferred_peak: int
    """The same for the deferred schedule."""
    plain_profiled: int
    """The same step by the profiler: bytes alive at its start + the allocator events' transient peak
    (misses frees on gloo's threads; holds kernel scratch)."""
    deferred_profiled: int
    frees_elsewhere: int
    """Deferred step: storages freed on a thread other than the step's (what the profiler misses)."""
    expert_bytes: int
    """The expert-gradient bytes the plain engine holds on this rank (EP: its E/world experts; FSDP2,
    whose loop skips gradient sync: every expert's unsharded gradient until the synced backward)."""
    two_tensors: int
    """Two of the largest expert tensor's gradient: the one in flight and the one being computed."""
    kept_bytes: int
    """The deferred step's kept operands at their most (`DeferredGrads.last_peak_bytes`)."""
    planned_plain: int
    """`sonar-fx plan --parallel ENGINE --world N --methods standard`'s peak (0: not planned)."""
    planned_peak: int
    """`sonar-fx plan --parallel ENGINE --world N`'s peak of the deferred step (0: not planned)."""
    overlapped: int
    """Expert gradients computed while the collective of the one before ran, in the measured step."""
    plain_peak_in: str
    """Where the plain step's counted peak lies: "backward" (the micro-batches' forwards and
    backwards) or "step" (from `step()` on)."""
    deferred_peak_in: str
    crossed_over: int
    """Expert tensors whose kept operands outgrew their gradient within the measured step (kept whole
    from then on: no saving for them at that step's peak), of `expert_tensors`."""
    expert_tensors: int

    @property
    def saving(self) -> int:
        return self.plain_peak - self.deferred_peak

    @property
    def expected(self) -> int:
        """The floor of the saving; 0 or less: nothing to save (`saving_cell` says why)."""
        return self.expert_bytes - self.two_tensors - self.kept_bytes

    def saving_cell(self) -> str:
        if self.expected > 0:
            return f"{self.saving / self.expected:.2f}"
        return f"none expected ({self.crossed_over}/{self.expert_tensors} crossed over in the step)"


@dataclass(frozen=True)
class _Measured:
    counted: int
    profiled: int
    frees_elsewhere: int
    peak_in: str
    crossed_over: int
    """Deferred arm: expert tensors that crossed over in this step (0 for the plain arm)."""


def _measure_step(arm: Arm, micro: list[dict[str, torch.Tensor]]) -> _Measured:
    """One step measured two ways at once: the profiler's allocator events and the live storages."""
    if arm.sonar is not None:  # the store records every crossover of the run: this step's own are counted
        arm.sonar.deferred.crossed.clear()
    start = arm.start_bytes(micro)
    meter = LiveStorageMeter(
        arm.alive(micro), constant_bytes=arm.bucket_bytes(), resizable=arm.all_gather_outputs(), held=arm.held
    )

    def step() -> None:
        with meter:
            meter.phase = "backward"
            arm.backwards(micro)
            meter.phase = "step"
            arm.step()

    _, peak = measure_peak(step)
    crossed = len(arm.sonar.deferred.crossed) if arm.sonar is not None else 0
    return _Measured(
        meter.peak_bytes, start + peak.peak_bytes, meter.frees_elsewhere, meter.peak_phase, crossed
    )


def measured_step(cfg: Config) -> int:
    """The step `measure_memory` measures (counted from 1), warmup + 2: optimizer states exist, and DDP
    has rebuilt its buckets (in the first forward after its first synced backward, a new set, the old
    one freed: once per run)."""
    return cfg.warmup + 2


def measure_memory(cfg: Config, engine: str) -> MemoryRow:
    """The clip over every parameter, plain and deferred: `measured_step`'s absolute peak on this rank."""
    measured, kept, overlapped, arm = {}, 0, 0, None
    for deferred in (False, True):
        arm = build(cfg, engine, deferred, "all")
        steps = steps_of(cfg, measured_step(cfg), seed=1)
        for micro in steps[:-1]:
            arm.train(micro)
        overlapped_before = arm.sonar.deferred.overlapped if deferred else 0
        measured[deferred] = _measure_step(arm, steps[-1])
        if deferred:
            kept = arm.sonar.deferred.last_peak_bytes
            overlapped = arm.sonar.deferred.overlapped - overlapped_before
    assert arm is not None
    # What the plain engine holds: each expert tensor's whole gradient on the rank (EP: its E/world
    # experts; FSDP2 under set_requires_gradient_sync(False): every expert's unsharded gradient).
    sizes = [p.numel() * p.element_size() for p in arm.experts]
    return MemoryRow(
        engine=engine, rank=dist.get_rank(), plain_peak=measured[False].counted,
        deferred_peak=measured[True].counted, plain_profiled=measured[False].profiled,
        deferred_profiled=measured[True].profiled, frees_elsewhere=measured[True].frees_elsewhere,
        expert_bytes=sum(sizes), two_tensors=2 * max(sizes), kept_bytes=kept or 0,
        planned_plain=0, planned_peak=0, overlapped=overlapped, plain_peak_in=measured[False].peak_in,
        deferred_peak_in=measured[True].peak_in, crossed_over=measured[True].crossed_over,
        expert_tensors=len(sizes),
    )  # fmt: skip


DEFERRED = "sonar_deferred_global_clip"


def planned_peaks(cfg: Config, engine: str) -> dict[str, int]:
    """`sonar-fx plan --parallel ENGINE --world N`'s per-rank peaks of the plain (`standard`: clip over
    every parameter) and the deferred step, by method. Planned in the launching process, which has no
    process group (FSDP2's plan makes a fake one of its own, and destroys it), with the one torch
    thread each rank runs (`_rank_main`): the CPU matmul scratch the plan counts is measured on this
    host and depends on the threads (`sonar_fx.planner.scratch`; none with one thread here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        planned = _plan(cfg, engine)
    finally:
        torch.set_num_threads(threads)
    return {m.method: m.peak_allocated_bytes for m in planned.methods}


def _plan(cfg: Config, engine: str) -> Any:
    return plan(
        _shape_config(cfg), batch=cfg.batch, seq=cfg.seq, dtype=getattr(torch, cfg.dtype),
        opt_cfg=AdamWConfig(lr=1e-3, max_grad_norm=MAX_NORM), methods=("standard", DEFERRED), device="cpu",
        grad_accum=cfg.accum, parallel=engine, world=cfg.world,
    )  # fmt: skip


def _shape_config(cfg: Config) -> Any:
    from sonar_fx.models.tiny import tiny_config

    shape = SHAPES[cfg.shape]
    return tiny_config(shape.base, **shape.overrides())


# -------------------------------------------------------------------------------------------- time


@dataclass(frozen=True, kw_only=True)
class TimeRow:
    engine: str
    rank: int
    clip: str
    plain_s: list[float]
    deferred_s: list[float]
    extra_gemm_s: list[float]
    """clip over all: every expert gradient computed once from the kept operands (the norm pass's
    extra GEMMs), timed apart; empty for the dense-only clip."""


def measure_time(cfg: Config, engine: str, clip: str) -> TimeRow:
    """`cfg.rounds` rounds, each arm one timed step per round in alternating order (both ranks alike),
    timed from a barrier to a barrier."""
    plain, deferred = build(cfg, engine, False, clip), build(cfg, engine, True, clip)
    steps = steps_of(cfg, cfg.warmup + cfg.rounds, seed=100)
    for micro in steps[: cfg.warmup]:
        plain.train(micro)
        deferred.train(micro)
    times: dict[str, list[float]] = {"plain": [], "deferred": [], "extra": []}
    for r, micro in enumerate(steps[cfg.warmup :]):
        for arm in (plain, deferred) if r % 2 == 0 else (deferred, plain):
            dist.barrier()
            began = time.perf_counter()
            arm.train(micro)
            # The step ends when every rank has ended it: a plain step that ends without a collective
            # would otherwise leave the slower rank's lag to the next step's first collective, untimed.
            dist.barrier()
            times["plain" if arm is plain else "deferred"].append(time.perf_counter() - began)
        if clip == "all":
            times["extra"].append(_extra_gemms(deferred, micro))
    return TimeRow(engine=engine, rank=dist.get_rank(), clip=clip, plain_s=times["plain"],
                   deferred_s=times["deferred"], extra_gemm_s=times["extra"])  # fmt: skip


def _extra_gemms(arm: Arm, micro: list[dict[str, torch.Tensor]]) -> float:
    """The time of the norm pass's extra weight-gradient GEMMs: after a step's backwards, each expert
    gradient computed once from the kept operands (and dropped); then the step is dropped
    (`zero_grad()`: the next forward starts a fresh step)."""
    arm.backwards(micro)
    store = arm.sonar.deferred
    began = time.perf_counter()
    with torch.no_grad():
        for p in arm.experts:
            store.gradient(p, consume=False)
    took = time.perf_counter() - began
    arm.sonar.zero_grad()
    return took


# ------------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, cfg: Config, port: int, out: str, job: Job) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # each rank's copy of the same warnings (crossover, deprecations)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world)
    try:
        records = [r for engine in cfg.engines for r in job(cfg, engine)]
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))


Job = Callable[[Config, str], list[dict[str, Any]]]
"""What each rank runs per engine (a module-level function: spawn pickles it by name)."""


def memory_job(cfg: Config, engine: str) -> list[dict[str, Any]]:
    return [asdict(measure_memory(cfg, engine))]


def time_job(cfg: Config, engine: str) -> list[dict[str, Any]]:
    return [asdict(measure_time(cfg, engine, clip)) for clip in ("dense", "all")]


def per_rank(cfg: Config, job: Job) -> list[list[dict[str, Any]]]:
    """Each rank's records of `job`, on `cfg.world` gloo processes."""
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(
            _rank_main, args=(cfg, _free_port(), out, job), nprocs=cfg.world, join=True
        )
        return [json.loads(Path(out, f"rank{k}.json").read_text()) for k in range(cfg.world)]


# ------------------------------------------------------------------------------------------ reports


def memory_table(rows: list[MemoryRow], cfg: Config) -> Table:
    def m(n: int) -> str:
        return f"{mib(n):.1f}"

    step = measured_step(cfg)
    body = [[r.engine, str(r.rank), m(r.plain_peak), m(r.deferred_peak), m(r.saving),
             f"{r.plain_peak_in} / {r.deferred_peak_in}", m(r.expert_bytes), m(r.two_tensors),
             m(r.kept_bytes), r.saving_cell(), str(r.overlapped)]
            for r in rows]  # fmt: skip
    note = (
        f"{SHAPES[cfg.shape].describe()}, {cfg.dtype}, batch {cfg.batch} x seq {cfg.seq} per rank x "
        f"{cfg.accum} micro-batches (no_sync() on all but the last), {cfg.world} gloo ranks, clip over every "
        f"parameter; compilers {cfg.compilers}. Peak = the most storage bytes alive at once in step {step}, "
        "counted from the tensors (`sonar_fx.memory_live.LiveStorageMeter`: weights, states, gradients, "
        "the batch, every op's outputs, frees on every thread; DDP's buckets included); peak in = the phase "
        "each arm's peak lies in (backward: the micro-batches; step: from step() on). expected = expert "
        "grads - two tensors - kept operands (a floor: the plain peak taken at its step; a peak in backward "
        "holds a micro-batch's activations beside every expert gradient, and the saving exceeds it); none "
        "expected where that is 0 or less, with how many of the rank's expert tensors crossed over in the "
        f"step (step {step}'s own count, not the run's: their operands outgrew their gradient within its "
        "micro-batches, kept whole from then on, as the plain engine keeps them; the warning each rank "
        "silences here), and the goal is that the deferred step costs nothing more. overlapped = expert "
        "gradients computed while the one before was reduced."
    )
    headers = ["engine", "rank", "plain MiB", "deferred MiB", "saving MiB", "peak in (plain / deferred)",
               "expert grads MiB", "two tensors MiB", "kept operands MiB", "saving / expected",
               "overlapped"]  # fmt: skip
    return Table(title="Memory per rank", headers=headers, rows=body, note=note)


def plan_table(rows: list[MemoryRow]) -> Table:
    """Each rank's step measured two ways and planned: the plan is graded against the counted peak."""
    body = []
    for r in rows:
        for arm, counted, profiled, planned in (
            ("plain", r.plain_peak, r.plain_profiled, r.planned_plain),
            ("deferred", r.deferred_peak, r.deferred_profiled, r.planned_peak),
        ):
            error = "-" if not planned else f"{(planned - counted) / counted:+.1%}"
            body.append([r.engine, str(r.rank), arm, f"{mib(counted):.1f}", f"{mib(profiled):.1f}",
                         f"{(profiled - counted) / counted:+.1%}", f"{mib(planned):.1f}" if planned else "-",
                         error, str(r.frees_elsewhere) if arm == "deferred" else "-"])  # fmt: skip
    note = (
        "counted: the live storages' peak (the memory table's); profiled: bytes alive at the start + the CPU "
        "profiler's transient peak, on the same step (it misses frees on gloo's threads and holds kernel "
        "scratch inside an op, which the count does not see); planned: `sonar-fx plan --parallel ENGINE "
        "--world N` (standard for plain, sonar_deferred_global_clip for deferred; device cpu, one torch "
        "thread as each rank runs), its error against counted; frees elsewhere: storages the deferred step "
        "freed on another thread."
    )
    headers = ["engine", "rank", "arm", "counted MiB", "profiled MiB", "profiled - counted", "planned MiB",
               "plan error", "frees elsewhere"]  # fmt: skip
    return Table(title="Plan vs measured per rank", headers=headers, rows=body, note=note)


def time_table(rows: list[TimeRow], cfg: Config) -> Table:
    body = []
    for r in rows:
        floor = _floor(r)
        body.append([r.engine, str(r.rank), r.clip, f"{statistics.median(r.plain_s) * 1e3:.0f}",
                     fmt_ratio(paired_ratio(r.deferred_s, r.plain_s)),
                     "-" if floor is None else f"{floor:.2f}x"])  # fmt: skip
    note = (
        f"{cfg.rounds} rounds, arms alternating, each round one step of {cfg.accum} micro-batches per arm "
        "from a barrier to a barrier (a step ends when every rank has ended it, as the next step's first "
        "collective waits for the slowest); ratio = deferred / plain on the same rank in the same round "
        "(median [IQR]). "
        "floor (clip over all) = 1 + the norm pass's extra weight-gradient GEMMs (every expert gradient "
        "computed once more from the kept operands, timed apart) / the plain step. Shared 2-core machine: "
        "ratios, not absolute times."
    )
    headers = ["engine", "rank", "clip", "plain step ms", "deferred / plain", "floor (extra GEMMs)"]
    table = Table(title="Time per rank", headers=headers, rows=body, note=note)
    smoke = smoke_test(cfg)
    if smoke is None:
        return table
    return labelled_smoke(table, smoke, "These ratios show that both arms ran, nothing more.")


def _floor(r: TimeRow) -> float | None:
    if not r.extra_gemm_s:
        return None
    return 1.0 + statistics.median(r.extra_gemm_s) / statistics.median(r.plain_s)


def goals(memory: list[MemoryRow], times: list[TimeRow], cfg: Config) -> list[Goal]:
    """Each rank's goals; a smoke test's time ratios are not graded (shown, "not measured")."""
    smoke = smoke_test(cfg) is not None
    out = []
    for r in memory:
        if r.expected > 0:
            out.append(goal(f"{SCRIPT}.saving", f"{r.engine} rank {r.rank}: saving / expected",
                            r.saving / r.expected))  # fmt: skip
        else:
            name = f"{r.engine} rank {r.rank}: {r.saving_cell()}, (deferred - plain) / plain"
            out.append(goal(f"{SCRIPT}.no_saving_expected", name, -r.saving / r.plain_peak))
        for arm, planned, counted in (("plain", r.planned_plain, r.plain_peak),
                                      ("deferred", r.planned_peak, r.deferred_peak)):  # fmt: skip
            if planned:
                name = f"{r.engine} rank {r.rank} {arm}: |planned - measured| / measured"
                out.append(goal(f"{SCRIPT}.plan", name, abs(planned - counted) / counted))
    for t in times:
        if t.clip == "dense":
            name = f"{t.engine} rank {t.rank}: dense-only clip, deferred / plain"
            ratio = paired_ratio(t.deferred_s, t.plain_s)
            shown = f"{fmt_ratio(ratio)} (smoke test)" if smoke else None
            out.append(goal(f"{SCRIPT}.dense_time", name, None if smoke else ratio, shown))
    return out


def measured_and_planned(cfg: Config) -> list[MemoryRow]:
    """Each rank's memory rows, with the plan of its engine beside them."""
    planned = {engine: planned_peaks(cfg, engine) for engine in cfg.engines}
    return [
        replace(row, planned_plain=planned[row.engine].get("standard", 0),
                planned_peak=planned[row.engine].get(DEFERRED, 0))
        for row in (MemoryRow(**r) for rank in per_rank(cfg, memory_job) for r in rank)
    ]  # fmt: skip


def run_plan(cfg: Config) -> Output:
    """`--plan`: memory only, the plan graded against the counted peak (no time rounds)."""
    memory = measured_and_planned(cfg)
    return Output(tables=[plan_table(memory), memory_table(memory, cfg)],
                  goals=[g for g in goals(memory, [], cfg) if "planned" in g.name],
                  records=[asdict(r) for r in memory])  # fmt: skip


def run(cfg: Config) -> Output:
    memory = measured_and_planned(cfg)
    times = [TimeRow(**r) for rank in per_rank(cfg, time_job) for r in rank] if cfg.rounds else []
    tables = memory_tables([memory_table(memory, cfg), plan_table(memory)], cfg)
    tables += [time_table(times, cfg)] if times else []
    records = [asdict(r) for r in memory] + [asdict(t) for t in times]
    name = results_name(cfg, timed=bool(times))  # memory only (no rounds): no time ratio to call a smoke test
    return Output(tables=tables, goals=goals(memory, times, cfg), records=records, script=name)


def _run_timeline(cfg: Config) -> Output:
    from benchmarks import deferred_timeline  # it imports this module

    return deferred_timeline.run_timeline(cfg)


# The timeline runs DDP alone, whatever --engines says: the engines do not name its results (None).
TIMELINE = Mode(flag="--timeline", script="distributed_timeline",
                question="When does each expert gradient's all-reduce run in the deferred step, per rank?",
                default=Config(rounds=0), quick=replace(QUICK, rounds=0),
                run=memory_only("distributed_timeline", _run_timeline, None))  # fmt: skip


PLAN = Mode(flag="--plan", script="distributed_plan",
            question="How close is `sonar-fx plan --parallel ENGINE --world 2` to the measured 2-rank step?",
            default=Config(rounds=0, engines=ENGINES), quick=replace(QUICK, rounds=0, engines=ENGINES),
            run=memory_only("distributed_plan", run_plan, ENGINES))  # fmt: skip
MODES = (TIMELINE, PLAN)


def main(argv: list[str] | None = None) -> None:
    engines = Override(field="engines", choices=ENGINES, many=True, help="engines to run (default: ddp ep)")
    shape = Override(field="shape", choices=sorted(SHAPES), help="the model shape (default: olmoe-cpu)")
    common.main(
        SCRIPT, __doc__, argv, run=run, default=Config(), quick=QUICK, overrides=[engines, shape], modes=MODES
    )


if __name__ == "__main__":
    main()
