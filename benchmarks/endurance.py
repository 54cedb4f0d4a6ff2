"""Question: does a long Sonar run stay healthy: flat memory, no recompiles, steady step time?

2,000 steps of a tiny OLMoE (`olmoe-micro`, fp32) with Sonar, under an LR schedule that changes the LR
every step (an LR read at compile time would recompile or go stale), in each execution: eager hooks,
the compiled pass with aot_eager and with inductor. Arms run one after another, each alone, so the
process's resident memory (RSS, sampled after every step) belongs to one arm. After a warm-up (the
first steps compile and allocate optimizer state) it reports:
- RSS: the least-squares slope over the remaining steps (KiB per 1,000 steps) and its growth;
- the transient bytes of one step right after warm-up and of the last step (`sonar_fx.measure`);
- compiles after warm-up: dynamo frame compiles, graphs, and `SonarOptimizer.report()["recompiles"]`;
- step time: the median of the last quarter of the steps over that of the first quarter, in CPU time
  (`time.process_time`: on a shared machine, time spent waiting for a core does not count, so load
  from other processes moves it far less than wall time) and in wall time.
JSON and a PNG (RSS and step time over the steps). Never asserts; the goals say what was met.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from benchmarks import common
from benchmarks.arms import Arm
from benchmarks.common import Goal, Table, grade, mib, worst
from benchmarks.workload import SHAPES
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import ArmResult, Spread, measure_arm, run_rounds, side_by_side
from sonar_fx.memory import measure_peak, process_rss_bytes
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import Batch, make_batches

SCRIPT = "endurance"
MAX_SLOPE_KIB = 1024.0
"""Goal: RSS grows by less than 1 MiB per 1,000 steps after warm-up (a leak of one small tensor or a
few Python objects per step would exceed it)."""
MAX_DRIFT = 0.2
"""Goal: the last quarter's median step CPU time within 20% of the first quarter's."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-micro"
    dtype: str = "float32"
    batch: int = 2
    seq: int = 32
    steps: int = 2000
    warmup: int = 100
    """Steps before RSS, time and compile counts are read as the baseline (the first one compiles)."""
    arms: tuple[Arm, ...] = (
        Arm(method="sonar"),
        Arm(method="sonar", execution=Execution(compiler="aot_eager")),
        Arm(method="sonar", execution=Execution(compiler="inductor")),
    )
    lr: float = 1e-3


QUICK = Config(steps=40, warmup=10, arms=(Arm(method="sonar", execution=Execution(compiler="aot_eager")),))


@dataclass(kw_only=True)
class Endurance(ArmResult):
    """One arm's long run: `ArmResult`'s figures and the per-step series."""

    rss_bytes: list[int] = field(default_factory=list)
    """Process RSS after each timed step."""
    cpu_step_s: list[float] = field(default_factory=list)
    """CPU time of this process in each timed step (`step_s` is wall time)."""
    last_step_peak_bytes: int = 0
    """Transient bytes of the last step (`peak_bytes` is the step right after warm-up)."""
    frames_compiled_after_warmup: int = 0
    graphs_after_warmup: int = 0
    sonar: dict[str, Any] = field(default_factory=dict)
    """`SonarOptimizer.report()` at the end (recompiles, graphs_compiled, updates by path)."""


def run(cfg: Config) -> list[Endurance]:
    batches = make_batches(cfg.steps, cfg.batch, cfg.seq)
    results = []
    for arm in cfg.arms:
        label = f"{arm.label} ({arm.execution.compiler})" if arm.execution.compiled else arm.label
        print(f"  {label}: {cfg.steps} steps", flush=True)
        torch._dynamo.reset()
        result = Endurance(label=label)
        try:
            with side_by_side():
                _run_arm(result, arm, cfg, batches)
        except Exception as err:  # reported in the table; the other arms still run
            result.fail(err)
        results.append(result)
    torch._dynamo.reset()
    return results


def _run_arm(result: Endurance, arm: Arm, cfg: Config, batches: list[Batch]) -> None:
    model = SHAPES[cfg.shape].build(getattr(torch, cfg.dtype))
    method = arm.build(model, AdamWConfig(lr=cfg.lr))
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
        for opt in method.optimizers
    ]

    cpu: list[float] = []

    def step(batch: Batch) -> None:
        started = time.process_time()
        method.train_step(batch)
        cpu.append(time.process_time() - started)
        for sched in schedulers:
            sched.step()  # a new LR every step: must never recompile

    measure_arm(result, step, batches[: cfg.warmup - 1], batches[cfg.warmup - 1])
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    run_rounds(
        [(result, step)],
        batches[cfg.warmup : -1],
        after_round=lambda r: result.rss_bytes.append(process_rss_bytes()),
    )
    if result.error is None:
        _, last = measure_peak(lambda: step(batches[-1]))
        result.last_step_peak_bytes = last.peak_bytes
    result.cpu_step_s = cpu[cfg.warmup : cfg.warmup + len(result.step_s)]  # the timed rounds' steps
    result.frames_compiled_after_warmup = counters["frames"]["total"] - frames
    result.graphs_after_warmup = counters["stats"]["unique_graphs"] - graphs
    result.sonar = _report(method)


def _report(method: TrainingMethod) -> dict[str, Any]:
    if not isinstance(method.optimizer, SonarOptimizer):
        return {}
    report = method.optimizer.report()
    return {k: report[k] for k in ("recompiles", "graphs_compiled", "updates_in_graph", "updates_by_hook")}


def rss_slope(rss: list[int]) -> float:
    """Least-squares slope of RSS over the steps, in bytes per step."""
    n = len(rss)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(rss) / n
    cov = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(rss))
    return cov / sum((i - mean_x) ** 2 for i in range(n))


def drift(step_s: list[float]) -> Spread | None:
    """Median step time of the last quarter over that of the first quarter (as a one-value Spread)."""
    q = len(step_s) // 4
    if q < 1:
        return None
    first, last = Spread.of(step_s[:q]), Spread.of(step_s[-q:])
    return Spread.of([last.median / first.median])


def table(results: list[Endurance], cfg: Config) -> Table:
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.label, f"failed: {r.error}", *["-"] * 8])
            continue
        cpu, wall = drift(r.cpu_step_s), drift(r.step_s)
        rows.append([
            r.label, f"{mib(r.rss_bytes[0]):.0f} -> {mib(r.rss_bytes[-1]):.0f}",
            f"{rss_slope(r.rss_bytes) * 1000 / 1024:+.0f}",
            f"{mib(r.peak_bytes):.3f} / {mib(r.last_step_peak_bytes):.3f}",
            str(r.frames_compiled_after_warmup), str(r.graphs_after_warmup),
            str(r.sonar.get("recompiles", "-")), Spread.of([t * 1e3 for t in r.cpu_step_s]).fmt(1),
            r.step_ms.fmt(1), f"{_x(cpu)} CPU, {_x(wall)} wall",
        ])  # fmt: skip
    headers = [
        "arm", "RSS MiB after warm-up -> end", "RSS slope KiB/1k steps", "step transient MiB first / last",
        "frame compiles after warm-up", "graphs after warm-up", "sonar recompiles", "step CPU ms",
        "step wall ms", "last / first quarter",
    ]  # fmt: skip
    note = (
        f"{SHAPES[cfg.shape].describe()}, {cfg.dtype}, batch {cfg.batch} x seq {cfg.seq}, {cfg.steps} steps, "
        f"LR changed every step (cosine); after {cfg.warmup} warm-up steps. Arms run one after another. RSS "
        "slope: least squares over the steps after warm-up. Step CPU / wall ms: median [IQR] of those steps "
        "(CPU: this process's CPU time, which waiting for a core on a shared machine does not add to); "
        "last / first quarter: ratio of the median step times of the last and first quarters."
    )
    return Table(title="Endurance", headers=headers, rows=rows, note=note)


def _x(spread: Spread | None) -> str:
    return "-" if spread is None else f"{spread.median:.2f}x"


def goals(results: list[Endurance]) -> list[Goal]:
    out = []
    for r in results:
        slope = rss_slope(r.rss_bytes) * 1000 / 1024 if r.ok else None
        compiles = r.frames_compiled_after_warmup + r.sonar.get("recompiles", 0) if r.ok else None
        d = drift(r.cpu_step_s) if r.ok else None
        out += [
            _goal(f"{r.label}: RSS flat after warm-up", f"< {MAX_SLOPE_KIB:.0f} KiB per 1k steps",
                  slope, "{:+.0f} KiB", grade(None if slope is None else abs(slope), MAX_SLOPE_KIB, "<")),
            _goal(f"{r.label}: no recompiles", "0 frame compiles and sonar recompiles after warm-up",
                  compiles, "{}", grade(compiles, 0, "<=")),
            _goal(f"{r.label}: step time stable", f"CPU time, last / first quarter within {MAX_DRIFT:.0%}",
                  None if d is None else d.median, "{:.2f}x",
                  worst(grade(d, 1 + MAX_DRIFT, "<="), grade(d, 1 - MAX_DRIFT, ">="))),
        ]  # fmt: skip
    return out


def _goal(name: str, target: str, value: float | None, fmt: str, status: str) -> Goal:
    """A goal measured as `value` (None: the arm failed, so not measured) and graded by `grade`."""
    measured = "-" if value is None else fmt.format(value)
    return Goal(name=name, target=target, measured=measured, status=status)


def plot(results: list[Endurance], cfg: Config, path: Path) -> bool:
    """RSS and step time over the steps, one line per arm; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_rss, ax_ms) = plt.subplots(1, 2, figsize=(12, 4))
    window = max(1, len(results[0].step_s) // 50) if results else 1
    for r in results:
        if not r.ok:
            continue
        steps = list(range(cfg.warmup + 1, cfg.warmup + 1 + len(r.step_s)))
        (line,) = ax_rss.plot(steps, [mib(b) for b in r.rss_bytes], label=r.label)
        ax_ms.plot(
            steps, _running_median(r.cpu_step_s, window), color=line.get_color(), label=f"{r.label}, CPU"
        )
        ax_ms.plot(steps, _running_median(r.step_s, window), color=line.get_color(), ls=":", label="wall")
    ax_rss.set(xlabel="step", ylabel="process RSS MiB", title="Resident memory after each step")
    ax_ms.set(
        xlabel="step", ylabel=f"step ms (running median of {window + 1})", title="Step time: CPU and wall"
    )
    for ax in (ax_rss, ax_ms):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _running_median(values: list[float], window: int) -> list[float]:
    return [Spread.of(values[max(0, i - window) : i + 1]).median * 1e3 for i in range(len(values))]


def main(argv: list[str] | None = None) -> None:
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK)
    results = run(inv.cfg)
    images = ["endurance.png"] if plot(results, inv.cfg, inv.out / "endurance.png") else []
    inv.finish(
        [table(results, inv.cfg)], goals=goals(results), records=[asdict(r) for r in results], images=images
    )


if __name__ == "__main__":
    main()
