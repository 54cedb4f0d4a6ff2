"""One step under torch.profiler: where the memory and the time of Sonar's update go (`benchmarks.methods`'
`--timeline` and `--profile`).

--timeline: live memory through one step after warm-up, the running sum of the profiler's CPU allocator
events (the [memory] events `sonar_fx.memory.measure_peak` sums), with the forward, backward and
optimizer phases marked by `record_function` ranges: standard training piles up every layer's expert
gradients through backward and holds them to the optimizer step; Sonar (eager hooks, and the compiled
pass) frees each layer's as soon as its update is done.

--profile: pairs of arms that do the same arithmetic on the same tensors (olmoe-cpu, bf16, batch 2):
Sonar's pass (inductor) and standard_no_expert_clip compiled alike; Sonar's eager hooks and the
hand-written expert hooks of PyTorch's tutorial (`benchmarks.handwritten`); and each Sonar arm with its
saving guard off (a no-op meter, no untracked-tensor check) and with the non-finite check and the logged
norms off (nonfinite="ignore": exactly the twin's work). Timed rounds first (interleaved, paired ratios,
wall and process CPU time), then profiled rounds, arms interleaved: per step the self CPU time and call
count of the ops an update is made of. This module never asserts a timing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchmarks.arms import COMPILED, Arm, HandwrittenHooksArm
from benchmarks.common import Goal, Mode, Output, Table, goal, mib
from benchmarks.handwritten import METHOD as HANDWRITTEN
from benchmarks.workload import SHAPES, Workload
from sonar_fx.api import Compiler
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet
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
from sonar_fx.memory import ExpertGradBytes, native_stderr_silenced
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.runtime.meter import ExpertGradMeter
from sonar_fx.workload import make_batches

PHASES = ("forward", "backward", "optimizer")
MAX_POINTS = 1500
UNCHECKED = "no non-finite check, no norms"
OPS = (
    "aten::_fused_adamw_", "aten::linalg_vector_norm", "aten::copy_", "aten::isfinite", "aten::_foreach_add_",
    "aten::_foreach_sub_", "aten::aminmax", "sonar_fx::expert_update_",
)  # fmt: skip
"""Ops reported (self CPU time), and the update op itself (its total, children included)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One --timeline or --profile run."""

    shapes: tuple[str, ...] = ("olmoe-cpu",)
    """The first is used."""
    workload: Workload = field(default_factory=Workload)
    arms: tuple[Arm, ...] = (
        Arm(method="standard"),
        Arm(method="sonar"),
        Arm(method="sonar", execution=COMPILED),
    )
    """--timeline's arms."""
    modes: tuple[str, ...] = ("compiled", "eager")
    """--profile's pairs."""
    compiler: Compiler = "inductor"
    """--profile: the compiled pairs' compiler."""
    warmup: int = 2
    rounds: int = 15
    """--profile: timed rounds (interleaved), then `profiled_rounds` under the profiler."""
    profiled_rounds: int = 5
    lr: float = 1e-3
    max_grad_norm: float = 1.0


# ------------------------------------------------------------------------------------ --timeline


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Live tensor bytes through one step of one arm (times in ms from the step's start)."""

    label: str
    t_ms: list[float]
    live_mib: list[float]
    phases: dict[str, tuple[float, float]]
    """Phase name -> (start ms, end ms)."""
    peak_mib: float
    peak_phase: str
    end_of_backward_mib: float
    """Live bytes when backward returns: what stays alive into the optimizer step."""


def profile_step(method: TrainingMethod, batch: dict[str, torch.Tensor]) -> Any:
    """Profile one step with its phases marked; returns the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench.forward"):
            loss = method.model(**batch).loss
        with record_function("bench.backward"):
            loss.backward()
        with record_function("bench.optimizer"):
            method.optimizer_step()
    return prof


def timeline(label: str, prof: Any) -> Timeline:
    """Running sum of the CPU [memory] events of `prof`, with the phases it recorded."""
    events = list(prof.profiler.kineto_results.events())
    marks = {e.name().removeprefix("bench."): e for e in events if e.name().startswith("bench.")}
    t0 = min(e.start_ns() for e in marks.values())
    phases = {p: ((marks[p].start_ns() - t0) / 1e6, (marks[p].end_ns() - t0) / 1e6) for p in PHASES}
    mem = [e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    mem.sort(key=lambda e: e.start_ns())
    t_ms, live_mib, live = [0.0], [0.0], 0
    for e in mem:
        live += e.nbytes()
        t_ms.append((e.start_ns() - t0) / 1e6)
        live_mib.append(mib(live))
    peak_i = max(range(len(live_mib)), key=live_mib.__getitem__)
    peak_phase = next((p for p, (a, b) in phases.items() if a <= t_ms[peak_i] <= b), "between phases")
    bwd_end = phases["backward"][1]
    end_bwd = next((v for t, v in zip(reversed(t_ms), reversed(live_mib), strict=True) if t <= bwd_end), 0.0)
    t_ms, live_mib = _downsample(t_ms, live_mib, MAX_POINTS)
    return Timeline(
        label=label, t_ms=t_ms, live_mib=live_mib, phases=phases, peak_mib=max(live_mib),
        peak_phase=peak_phase, end_of_backward_mib=end_bwd,
    )  # fmt: skip


def _downsample(t: list[float], v: list[float], n: int) -> tuple[list[float], list[float]]:
    """At most ~2n points, keeping each bucket's minimum and maximum so no peak is lost."""
    if len(t) <= 2 * n:
        return t, v
    step = len(t) / n
    out_t, out_v = [], []
    for k in range(n):
        lo, hi = int(k * step), min(int((k + 1) * step), len(t))
        idx = sorted({min(range(lo, hi), key=v.__getitem__), max(range(lo, hi), key=v.__getitem__)})
        out_t += [t[i] for i in idx]
        out_v += [v[i] for i in idx]
    return out_t, out_v


def run_timeline(cfg: Config) -> Output:
    shape, w = SHAPES[cfg.shapes[0]], cfg.workload
    data = make_batches(cfg.warmup + 1, w.batch, w.seq)
    lines, grads = [], {}
    for arm in cfg.arms:
        print(f"  {arm.label}", flush=True)
        model = shape.build(w.torch_dtype)
        expert_grads = ExpertGradBytes.of(ExpertSet.discover(model).layers)
        grads = {"one_layer": mib(expert_grads.one_layer), "all": mib(expert_grads.total)}
        method = arm.build(model, AdamWConfig(lr=cfg.lr))
        for b in data[: cfg.warmup]:
            method.train_step(b)
        lines.append(timeline(arm.label, profile_step(method, data[cfg.warmup])))
        del method, model
        torch._dynamo.reset()
    return Output(tables=[timeline_table(lines, grads)], records=[asdict(x) for x in lines],
                  figures={"memory_timeline.png": partial(draw_timeline, lines, grads)})  # fmt: skip


def draw_timeline(lines: list[Timeline], grads: dict[str, float], plt: Any) -> Any:
    """One panel per arm, phases shaded."""
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    fig, axes = plt.subplots(len(lines), 1, figsize=(10, 2.6 * len(lines)), sharey=True, squeeze=False)
    for ax, line in zip(axes[:, 0], lines, strict=True):
        for phase, (a, b) in line.phases.items():
            ax.axvspan(a, b, color=colors[phase], alpha=0.12, label=phase)
        # Live bytes only change at allocator events: a step plot, never a slope between them.
        ax.plot(line.t_ms, line.live_mib, color="black", lw=1, drawstyle="steps-post")
        ax.axhline(grads["all"], color="tab:red", ls="--", lw=0.8, label="all expert grads")
        ax.axhline(grads["one_layer"], color="tab:purple", ls=":", lw=0.8, label="one layer of expert grads")
        ax.set_title(f"{line.label}: peak {line.peak_mib:.1f} MiB ({line.peak_phase})", fontsize=10)
        ax.set_ylabel("live MiB")
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", fontsize=8, ncol=5)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def timeline_table(lines: list[Timeline], grads: dict[str, float]) -> Table:
    rows = [
        [line.label, f"{line.peak_mib:.1f}", line.peak_phase, f"{line.end_of_backward_mib:.1f}",
         *(f"{b - a:.0f}" for a, b in (line.phases[p] for p in PHASES))]
        for line in lines
    ]  # fmt: skip
    note = (
        f"Expert gradients: {grads['all']:.1f} MiB in all, {grads['one_layer']:.1f} MiB per layer. Live MiB "
        "is above the step's start (weights and optimizer state excluded); phase times include profiling."
    )
    headers = ["arm", "peak MiB", "peak in", "live at end of backward MiB", "forward ms", "backward ms",
               "optimizer ms"]  # fmt: skip
    return Table(title="Live memory through one step", headers=headers, rows=rows, note=note)


# ------------------------------------------------------------------------------------ --profile


@dataclass
class ProfiledArm(ArmResult):
    """An arm's timings (wall and process CPU time per timed step) and, per profiled step, each op's
    self CPU milliseconds and calls."""

    cpu_s: list[float] = field(default_factory=list)
    """Process CPU seconds of each timed step: on a shared machine, time spent waiting for a core does
    not count (`time.process_time`)."""
    op_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    op_calls: dict[str, list[int]] = field(default_factory=lambda: {op: [] for op in OPS})


Build = Callable[[torch.nn.Module, AdamWConfig], TrainingMethod]


def profile_arms(cfg: Config) -> list[tuple[str, Build]]:
    arms: list[tuple[str, Build]] = []
    compiled = Execution(compiler=cfg.compiler)
    for mode in ("compiled", "eager"):
        if mode not in cfg.modes:
            continue
        sonar = Arm(method="sonar", execution=compiled if mode == "compiled" else Execution())
        twin = Arm(method="standard_no_expert_clip", execution=compiled)
        arms += [(sonar.label, sonar.build), (f"{sonar.label}, guard off", partial(_guard_off, sonar)),
                 (f"{sonar.label}, {UNCHECKED}", partial(_unchecked, sonar))]  # fmt: skip
        reference = twin if mode == "compiled" else HandwrittenHooksArm()
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
    def appeared(self, param: object, nbytes: int) -> None:
        return None

    def freed(self, param: object) -> None:
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


def run_profile(cfg: Config) -> Output:
    opt = AdamWConfig(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
    w, shape = cfg.workload, SHAPES[cfg.shapes[0]]
    print(f"{shape.describe()}, batch {w.batch} x seq {w.seq}, {w.dtype}", flush=True)
    batches = make_batches(cfg.warmup + cfg.rounds + cfg.profiled_rounds, w.batch, w.seq)
    live: list[tuple[ProfiledArm, TrainingMethod]] = []
    with side_by_side():
        for label, build in profile_arms(cfg):
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
    tables = [profile_table(shape.describe(), results)]
    return Output(tables=tables, goals=profile_goals(results), records=[asdict(r) for r in results])


def profile_table(title: str, results: list[ProfiledArm]) -> Table:
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


def profile_goals(results: list[ProfiledArm]) -> list[Goal]:
    by = {r.label: r for r in results}
    pass_, hooks, twin = "sonar · compiled pass", "sonar · eager hooks", "standard_no_expert_clip · compiled"
    pairs = [
        ("compiled pass vs its equal-work twin", "pass_vs_twin", pass_, twin),
        ("eager hooks vs hand-written expert hooks", "hooks_vs_handwritten", hooks,
         f"{HANDWRITTEN} · eager hooks"),
        ("saving guard's cost, compiled pass", "guard", pass_, f"{pass_}, guard off"),
        ("saving guard's cost, eager hooks", "guard", hooks, f"{hooks}, guard off"),
        ("compiled pass doing the twin's work vs the twin", "pass_vs_twin", f"{pass_}, {UNCHECKED}", twin),
        ("eager hooks doing the tutorial's work vs hand-written", "hooks_vs_handwritten",
         f"{hooks}, {UNCHECKED}", f"{HANDWRITTEN} · eager hooks"),
    ]  # fmt: skip
    out = []
    for name, key, a, b in pairs:
        wall, cpu = ratio(by.get(a), by.get(b)), _cpu_ratio(by.get(a), by.get(b))
        out.append(
            goal(
                f"hot_path.{key}", f"{name} (CPU time)", cpu, f"CPU {fmt_ratio(cpu)}, wall {fmt_ratio(wall)}"
            )
        )
    return out


def _cpu_ratio(a: ProfiledArm | None, b: ProfiledArm | None) -> Spread | None:
    if a is None or b is None or not (a.ok and b.ok) or len(a.cpu_s) != len(b.cpu_s):
        return None
    return paired_ratio(a.cpu_s, b.cpu_s)


def _cpu_ms(r: ProfiledArm) -> str:
    return Spread.of([t * 1e3 for t in r.cpu_s]).fmt(0) if r.ok and r.cpu_s else "-"


# --quick: the micro model, compiled with aot_eager (the same pass without inductor's codegen).
MICRO = Config(shapes=("olmoe-micro",), warmup=1, compiler="aot_eager")
MODES = [
    Mode(flag="--timeline", script="memory_timeline", run=run_timeline,
         question="Question: what does live memory look like through one training step, and where is the "
         "peak?",
         default=Config(), quick=replace(MICRO, arms=tuple(a.under("aot_eager") for a in Config().arms))),
    Mode(flag="--profile", script="hot_path", run=run_profile,
         question="Question: where does the time of Sonar's update go, next to the same update done the "
         "plain way?",
         default=Config(), quick=replace(MICRO, rounds=2, profiled_rounds=2)),
]  # fmt: skip
