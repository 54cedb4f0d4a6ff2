"""Question: where does the time of Sonar's update go, next to the same update done the plain way?

Pairs of arms that do the same arithmetic on the same tensors (olmoe-cpu, bf16, batch 2 by default):
- compiled: Sonar's pass (inductor) and standard_no_expert_clip compiled with the same compiler;
- eager: Sonar's hooks and the hand-written expert hooks of PyTorch's tutorial (`benchmarks.handwritten`);
and each Sonar arm twice more: with its saving guard off (a no-op meter, no untracked-tensor check), for
the guard's cost, and with the non-finite check and the logged expert norms off (nonfinite="ignore"),
which does exactly the twin's work. Timed rounds first (interleaved, paired ratios), then profiled
rounds: every step of every arm under torch.profiler (CPU), arms interleaved, and per step the self CPU
time and call count of the ops an update is made of (the fused kernel, norms, copies, the non-finite
flag's ops). Reported: median [IQR] per step over the profiled rounds. Never asserts a timing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.arms import Arm, HandwrittenHooksArm
from benchmarks.common import Goal, Table, grade
from benchmarks.handwritten import METHOD as HANDWRITTEN
from benchmarks.workload import SHAPES, Workload
from sonar_fx.api import Compiler
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import (
    ArmResult,
    Spread,
    fmt_ratio,
    measure_arm,
    paired_ratio,
    ratio,
    run_rounds,
    side_by_side,
)
from sonar_fx.memory import native_stderr_silenced
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.runtime.meter import ExpertGradMeter
from sonar_fx.workload import make_batches

SCRIPT = "hot_path"
UNCHECKED = "no non-finite check, no norms"
OPS = (
    "aten::_fused_adamw_",
    "aten::linalg_vector_norm",
    "aten::copy_",
    "aten::isfinite",
    "aten::_foreach_add_",
    "aten::_foreach_sub_",
    "aten::aminmax",
    "sonar_fx::expert_update_",
)
"""Ops reported (self CPU time), and the update op itself (its total, children included)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    workload: Workload = field(default_factory=Workload)
    modes: tuple[str, ...] = ("compiled", "eager")
    compiler: Compiler = "inductor"
    warmup: int = 2
    rounds: int = 15
    """Timed rounds (interleaved)."""
    profiled_rounds: int = 5
    """Rounds under the profiler, after the timed ones."""
    lr: float = 1e-3
    max_grad_norm: float = 1.0


QUICK = Config(shape="olmoe-micro", warmup=1, rounds=3, profiled_rounds=2)


@dataclass
class ProfiledArm(ArmResult):
    """An arm's timings (wall and process CPU time per timed step) and, per profiled step, each op's
    self CPU milliseconds and calls."""

    cpu_s: list[float] = field(default_factory=list)
    """Process CPU seconds of each timed step: on a shared machine, time spent waiting for a core does
    not count (`time.process_time`, as `benchmarks.endurance` measures)."""

    op_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    op_calls: dict[str, list[int]] = field(default_factory=lambda: {op: [] for op in OPS})


def arms_for(cfg: Config) -> list[tuple[str, Callable[[torch.nn.Module, AdamWConfig], TrainingMethod]]]:
    arms: list[tuple[str, Callable[[torch.nn.Module, AdamWConfig], TrainingMethod]]] = []
    if "compiled" in cfg.modes:
        compiled = Execution(compiler=cfg.compiler)
        sonar = Arm(method="sonar", execution=compiled)
        twin = Arm(method="standard_no_expert_clip", execution=compiled)
        arms += [(sonar.label, sonar.build), (f"{sonar.label}, guard off", partial(_guard_off, sonar))]
        arms.append((f"{sonar.label}, {UNCHECKED}", partial(_unchecked, sonar)))
        arms.append((twin.label, twin.build))
    if "eager" in cfg.modes:
        sonar = Arm(method="sonar")
        arms += [(sonar.label, sonar.build), (f"{sonar.label}, guard off", partial(_guard_off, sonar))]
        arms.append((f"{sonar.label}, {UNCHECKED}", partial(_unchecked, sonar)))
        reference = HandwrittenHooksArm()
        arms.append((reference.label, reference.build))
    return arms


def _guard_off(arm: Arm, model: torch.nn.Module, cfg: AdamWConfig) -> TrainingMethod:
    """Sonar without its run-time guard: a meter that counts nothing, no untracked-tensor check."""
    method = arm.build(model, cfg)
    assert isinstance(method.optimizer, SonarOptimizer)
    method.optimizer.meter = _NoMeter()
    method.optimizer.untracked = None
    return method


def _unchecked(arm: Arm, model: torch.nn.Module, cfg: AdamWConfig) -> TrainingMethod:
    """Sonar doing only the twin's work: no non-finite check, no logged expert norms."""
    method = arm.build(model, cfg)
    assert isinstance(method.optimizer, SonarOptimizer)
    method.optimizer.nonfinite = "ignore"
    method.optimizer.clipper.track_norms = False
    return method


class _NoMeter(ExpertGradMeter):
    def appeared(self, param: torch.Tensor, nbytes: int) -> None:
        return None

    def freed(self, param: torch.Tensor) -> None:
        return None


def profiled_step(result: ProfiledArm, method: TrainingMethod, batch: Any) -> None:
    prof = profile(activities=[ProfilerActivity.CPU])
    with native_stderr_silenced():  # kineto prints a line on start and stop
        prof.start()
    try:
        method.train_step(batch)
    finally:
        with native_stderr_silenced():
            prof.stop()
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        if event.key in OPS:
            own = event.cpu_time_total if event.key.startswith("sonar_fx::") else event.self_cpu_time_total
            totals[event.key] += own / 1e3
            calls[event.key] += event.count
    for op in OPS:
        result.op_ms[op].append(totals[op])
        result.op_calls[op].append(calls[op])


def _cpu_timed(result: ProfiledArm, method: TrainingMethod, batch: Any) -> None:
    started = time.process_time()
    method.train_step(batch)
    result.cpu_s.append(time.process_time() - started)


def run(cfg: Config) -> tuple[list[Table], list[Goal], list[dict[str, Any]]]:
    opt = AdamWConfig(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
    w, shape = cfg.workload, SHAPES[cfg.shape]
    print(f"{shape.describe()}, batch {w.batch} x seq {w.seq}, {w.dtype}", flush=True)
    batches = make_batches(cfg.warmup + cfg.rounds + cfg.profiled_rounds, w.batch, w.seq)
    live: list[tuple[ProfiledArm, TrainingMethod]] = []
    with side_by_side():
        for label, build in arms_for(cfg):
            print(f"  {label}: building and warming up", flush=True)
            result = ProfiledArm(label=label)
            method = build(shape.build(w.torch_dtype), opt)
            measure_arm(result, method.train_step, batches[: cfg.warmup], None)
            live.append((result, method))
        timed = batches[cfg.warmup : cfg.warmup + cfg.rounds]
        run_rounds([(r, partial(_cpu_timed, r, m)) for r, m in live], timed)
        for i, batch in enumerate(batches[cfg.warmup + cfg.rounds :]):
            shift = i % len(live)
            for result, method in [*live[shift:], *live[:shift]]:
                if result.error is None:
                    profiled_step(result, method, batch)
    results = [r for r, _ in live]
    return [table(shape.describe(), results)], goals(results), [_record(r) for r in results]


def table(title: str, results: list[ProfiledArm]) -> Table:
    headers = ["op (ms per step [IQR], calls)", *(r.label for r in results)]
    rows = [
        ["step, wall (timed rounds)", *(r.step_ms.fmt(0) if r.ok else f"failed: {r.error}" for r in results)],
        ["step, CPU (timed rounds)", *(_cpu_ms(r) for r in results)],
    ]
    for op in OPS:
        cells = []
        for r in results:
            ms, calls = r.op_ms.get(op) or [0.0], r.op_calls.get(op) or [0]
            spread = Spread.of(ms).fmt(1) if any(ms) else "0"
            cells.append(f"{spread} ({round(sum(calls) / len(calls))})")
        rows.append([op, *cells])
    note = (
        "Self CPU time of each op in one training step under torch.profiler (the update op: its total, "
        "the fused kernel and its other ops inside), median [IQR] over the profiled rounds, and calls per "
        "step; the step rows are the median [IQR] of the unprofiled, interleaved timed rounds, in wall "
        "time and in process CPU time (which waiting for a core on a shared machine does not inflate)."
    )
    return Table(title=title, headers=headers, rows=rows, note=note)


def goals(results: list[ProfiledArm]) -> list[Goal]:
    by = {r.label: r for r in results}
    pairs = [
        ("compiled pass vs its equal-work twin", "sonar · compiled pass",
         "standard_no_expert_clip · compiled", 0.97),
        ("eager hooks vs hand-written expert hooks", "sonar · eager hooks",
         f"{HANDWRITTEN} · eager hooks", 1.00),
        ("saving guard's cost, compiled pass", "sonar · compiled pass",
         "sonar · compiled pass, guard off", 1.01),
        ("saving guard's cost, eager hooks", "sonar · eager hooks", "sonar · eager hooks, guard off", 1.01),
        ("compiled pass doing the twin's work vs the twin", f"sonar · compiled pass, {UNCHECKED}",
         "standard_no_expert_clip · compiled", 0.97),
        ("eager hooks doing the tutorial's work vs hand-written", f"sonar · eager hooks, {UNCHECKED}",
         f"{HANDWRITTEN} · eager hooks", 1.00),
    ]  # fmt: skip
    out = []
    for name, a, b, limit in pairs:
        wall, cpu = ratio(by.get(a), by.get(b)), _cpu_ratio(by.get(a), by.get(b))
        measured = f"CPU {fmt_ratio(cpu)}, wall {fmt_ratio(wall)}"
        target, status = f"<= {limit:.2f}x", grade(cpu, limit, "<=")
        out.append(Goal(name=f"{name} (CPU time)", target=target, measured=measured, status=status))
    return out


def _cpu_ratio(a: ProfiledArm | None, b: ProfiledArm | None) -> Spread | None:
    if a is None or b is None or not (a.ok and b.ok) or len(a.cpu_s) != len(b.cpu_s):
        return None
    return paired_ratio(a.cpu_s, b.cpu_s)


def _cpu_ms(r: ProfiledArm) -> str:
    return Spread.of([t * 1e3 for t in r.cpu_s]).fmt(0) if r.ok and r.cpu_s else "-"


def _record(r: ProfiledArm) -> dict[str, Any]:
    return asdict(r)


def main(argv: list[str] | None = None) -> None:
    overrides = [
        common.Override(field="shape", choices=sorted(SHAPES), help="the model shape"),
        common.Override(field="modes", choices=["compiled", "eager"], help="which pairs", many=True),
    ]
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=overrides)
    tables, goal_list, records = run(inv.cfg)
    inv.finish(tables, goals=goal_list, records=records)


if __name__ == "__main__":
    main()
