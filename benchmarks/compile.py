"""Question: how much compile time does the Sonar pass add to torch.compile?

Compiled standard vs Sonar's compiled pass, with inductor and with aot_eager (same pass, no codegen),
from a cold cache every time (a fresh inductor cache directory and no FX-graph or AOTAutograd cache
hits), so neither arm is served a graph the other compiled. Compile overhead = the first train step
(forward and backward compiles, wherever an arm does them, and the optimizer step) minus a steady
step's median. Arms alternate order between repeats; the spread is over repeats. Then regional
compilation (`sonar_fx.compile(..., regional=True)`: each repeated decoder block compiled once) against
whole-model compilation of the pass, at L = 4 and 16 blocks: compile time and graph counts.

`--endurance`: 2,000 steps of a tiny OLMoE (`olmoe-micro`, fp32) with Sonar, eager hooks and the
compiled pass (aot_eager, inductor), under an LR that changes every step (an LR read at compile time
would recompile or go stale). Arms run one after another, so the process's resident memory (RSS, after
every step) is one arm's. After a warm-up: the RSS slope, the transient bytes of the first and last
step, compiles after warm-up (dynamo frames, graphs, `SonarOptimizer.report()["recompiles"]`) and the
step-time drift (last quarter over first, in process CPU time, which waiting for a core on a shared
machine does not inflate, and in wall time).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache  # private, but the supported way to get a cold cache

from benchmarks import common
from benchmarks.arms import Arm
from benchmarks.common import Goal, Mode, Output, Table, failed, goal, mib, worst
from benchmarks.workload import SHAPES, ModelShape, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import ArmResult, Spread, measure_arm, run_rounds, short_error, side_by_side
from sonar_fx.memory import measure_peak, process_rss_bytes
from sonar_fx.methods import Execution, TrainingMethod, build_method
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import Batch, make_batches

SCRIPT = "compile_overhead"
"""Results name of the compile-time run (`--endurance` writes `endurance`)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    workload: Workload = field(default_factory=Workload)
    compilers: tuple[str, ...] = ("inductor", "aot_eager")
    methods: tuple[str, ...] = ("standard", "sonar")
    """Compiled under each compiler: the baseline, and Sonar with its pass."""
    repeats: int = 2
    steady_steps: int = 3
    regional_layers: tuple[int, ...] = (4, 16)
    """Decoder blocks of the regional vs whole-model rows (the pass, one cold run each)."""
    regional_compiler: str = "inductor"


# A smoke run: the micro model, aot_eager (the same pass, no codegen), one repeat, one regional depth.
QUICK = Config(shape="olmoe-micro", compilers=("aot_eager",), repeats=1, steady_steps=2, regional_layers=(2,),
               regional_compiler="aot_eager")  # fmt: skip


def cold_run(build: Callable[[], TrainingMethod], data: list[Batch]) -> dict[str, Any]:
    """Build under a fresh dynamo state and inductor cache, then time the first step by phase and the
    steady steps after it; graph counts are this run's."""
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    with fresh_cache():
        method = build()
        t0 = time.perf_counter()
        loss = method.model(**data[0]).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        method.optimizer_step()
        t3 = time.perf_counter()
        steady = []
        for b in data[1:]:
            s = time.perf_counter()
            method.train_step(b)
            steady.append(time.perf_counter() - s)
    report = method.optimizer.report() if isinstance(method.optimizer, SonarOptimizer) else {}
    median = Spread.of(steady).median
    return {
        "first_forward_s": t1 - t0,
        "first_backward_s": t2 - t1,
        "first_optimizer_s": t3 - t2,
        "steady_step_s": median,
        "compile_s": (t3 - t0) - median,
        "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs_before,
        "graphs_compiled": report.get("graphs_compiled"),
        "updates_inserted": report.get("updates_inserted"),
        "fallbacks": report.get("fallbacks", []),
    }


def run(cfg: Config) -> Output:
    records, regional = run_compile(cfg), run_regional(cfg)
    tables = [table(records)] + ([regional_table(regional, cfg.regional_compiler)] if regional else [])
    return Output(tables=tables, records=[*records, *({"section": "regional", **r} for r in regional)])


def run_compile(cfg: Config) -> list[dict[str, Any]]:
    shape, w = SHAPES[cfg.shape], cfg.workload
    data = make_batches(1 + cfg.steady_steps, w.batch, w.seq)
    records = []
    for compiler in cfg.compilers:
        arms = [Arm(method=m, execution=Execution(compiler=compiler)) for m in cfg.methods]  # type: ignore[arg-type]
        for rep in range(cfg.repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                print(f"  {compiler}: {arm.label}, repeat {rep + 1}/{cfg.repeats}", flush=True)
                build = partial(_build, arm, shape, w)
                records.append({"compiler": compiler, "repeat": rep, "arm": arm.label, **_cold(build, data)})
    torch._dynamo.reset()
    return records


def _build(arm: Arm, shape: ModelShape, w: Workload) -> TrainingMethod:
    return arm.build(shape.build(w.torch_dtype), AdamWConfig(lr=1e-3))


def run_regional(cfg: Config) -> list[dict[str, Any]]:
    """Whole-model vs regional compile of the pass (cold cache) at each of `regional_layers`."""
    data = make_batches(1 + cfg.steady_steps, cfg.workload.batch, cfg.workload.seq)
    records = []
    for layers in cfg.regional_layers:
        for regional in (False, True):
            print(f"  {cfg.regional_compiler} pass, L={layers}, regional={regional}", flush=True)
            build = partial(_regional, cfg, dataclasses.replace(SHAPES[cfg.shape], layers=layers), regional)
            records.append({"layers": layers, "regional": regional, **_cold(build, data)})
    torch._dynamo.reset()
    return records


def _regional(cfg: Config, shape: ModelShape, regional: bool) -> TrainingMethod:
    model = shape.build(cfg.workload.torch_dtype)
    # regional=True turns the KV cache off; so here for both rows, to compile the same model.
    getattr(model, "config").use_cache = False  # noqa: B009 (typed Module | Tensor)
    return build_method(
        "sonar", model, AdamWConfig(lr=1e-3), compiler=cfg.regional_compiler, regional=regional
    )


def _cold(build: Callable[[], TrainingMethod], data: list[Batch]) -> dict[str, Any]:
    try:
        return cold_run(build, data)
    except Exception as err:  # reported in the table; the other runs still run
        return {"error": short_error(err)}


def table(records: list[dict[str, Any]]) -> Table:
    headers = ["compiler", "arm", "compile s", "× standard", "first forward s", "first backward s",
               "steady step ms", "pass rewrote"]  # fmt: skip
    rows = []
    keys = sorted({(r["compiler"], r["arm"]) for r in records}, key=lambda k: (k[0], "sonar" in k[1]))
    baseline: dict[str, float] = {}
    for compiler, arm in keys:
        runs = [r for r in records if (r["compiler"], r["arm"]) == (compiler, arm)]
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append(failed([compiler, arm], runs[0]["error"], len(headers)))
            continue
        comp = Spread.of([r["compile_s"] for r in ok])
        baseline.setdefault(compiler, comp.median)
        graphs = ok[-1]["graphs_compiled"]
        rows.append([
            compiler, arm, comp.fmt(1), f"{comp.median / baseline[compiler]:.2f}x",
            f"{statistics.median(r['first_forward_s'] for r in ok):.1f}",
            f"{statistics.median(r['first_backward_s'] for r in ok):.1f}",
            f"{1e3 * statistics.median(r['steady_step_s'] for r in ok):.0f}",
            "-" if graphs is None else f"{graphs} graphs, {ok[-1]['updates_inserted']} updates",
        ])  # fmt: skip
    note = (
        "Cold cache every run. compile s: first step minus the steady step's median (median [IQR] over "
        "repeats). The standard arms compile the backward graph lazily, at the first backward; with "
        "inductor the sonar pass compiles it during the first forward (so compiler failures reach the "
        "eager-hook fallback), which moves that time from its first backward s to its first forward s. "
        "With aot_eager both arms compile the backward lazily."
    )
    return Table(title="Compile time with and without the pass", headers=headers, rows=rows, note=note)


def regional_table(records: list[dict[str, Any]], compiler: str = "inductor") -> Table:
    headers = ["blocks L", "compile", "compile s", "× whole model", "dynamo graphs", "pass rewrote",
               "steady step ms"]  # fmt: skip
    rows = []
    whole: dict[int, float] = {}
    for r in records:
        how = "regional" if r["regional"] else "whole model"
        if "error" in r:
            rows.append(failed([r["layers"], how], r["error"], len(headers)))
            continue
        if not r["regional"]:
            whole[r["layers"]] = r["compile_s"]
        base = whole.get(r["layers"])
        rows.append([
            str(r["layers"]), how, f"{r['compile_s']:.1f}",
            "-" if base is None else f"{r['compile_s'] / base:.2f}x",
            str(r["dynamo_graphs"]), f"{r['graphs_compiled']} graphs, {r['updates_inserted']} updates",
            f"{1e3 * r['steady_step_s']:.0f}",
        ])  # fmt: skip
    note = (
        f"Sonar's compiled pass, {compiler}, cold cache, one run each. Regional: each decoder block compiled "
        "once and the graph reused for all L blocks, so its compile time should not grow with L. dynamo "
        "graphs: graphs captured in the run; pass rewrote: backward graphs the pass rewrote."
    )
    return Table(title="Regional vs whole-model compilation", headers=headers, rows=rows, note=note)


# ------------------------------------------------------------------------------------ --endurance


@dataclass(frozen=True, kw_only=True)
class EnduranceConfig:
    """One --endurance run."""

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


ENDURANCE_QUICK = EnduranceConfig(
    steps=40, warmup=10, arms=(Arm(method="sonar", execution=Execution(compiler="aot_eager")),)
)


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


def run_endurance(cfg: EnduranceConfig) -> Output:
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
    return Output(tables=[endurance_table(results, cfg)], goals=endurance_goals(results),
                  records=[asdict(r) for r in results],
                  figures={"endurance.png": partial(draw_endurance, results, cfg)})  # fmt: skip


def _run_arm(result: Endurance, arm: Arm, cfg: EnduranceConfig, batches: list[Batch]) -> None:
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
    result.sonar = _sonar_report(method)


def _sonar_report(method: TrainingMethod) -> dict[str, Any]:
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


def endurance_table(results: list[Endurance], cfg: EnduranceConfig) -> Table:
    headers = ["arm", "RSS MiB after warm-up -> end", "RSS slope KiB/1k steps",
               "step transient MiB first / last", "frame compiles after warm-up", "graphs after warm-up",
               "sonar recompiles", "step CPU ms", "step wall ms", "last / first quarter"]  # fmt: skip
    rows = []
    for r in results:
        if not r.ok:
            rows.append(failed([r.label], r.error, len(headers)))
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


def endurance_goals(results: list[Endurance]) -> list[Goal]:
    """RSS flat after warm-up (a leak of one small tensor or a few Python objects per step would show),
    no recompiles, the step CPU time of the last quarter within 20% of the first quarter's."""
    out = []
    for r in results:
        slope = rss_slope(r.rss_bytes) * 1000 / 1024 if r.ok else None
        compiles = r.frames_compiled_after_warmup + r.sonar.get("recompiles", 0) if r.ok else None
        d = drift(r.cpu_step_s) if r.ok else None
        stable = goal("endurance.drift_high", f"{r.label}: step time stable", d, _x(d) if d else "-")
        low = goal("endurance.drift_low", stable.name, d).status
        out += [
            goal("endurance.rss_slope", f"{r.label}: RSS flat after warm-up",
                 None if slope is None else abs(slope), "-" if slope is None else f"{slope:+.0f} KiB"),
            goal("endurance.recompiles", f"{r.label}: no recompiles", compiles,
                 "-" if compiles is None else str(compiles)),
            dataclasses.replace(stable, status=worst(stable.status, low)),
        ]  # fmt: skip
    return out


def draw_endurance(results: list[Endurance], cfg: EnduranceConfig, plt: Any) -> Any:
    """RSS and step time over the steps, one line per arm."""
    fig, (ax_rss, ax_ms) = plt.subplots(1, 2, figsize=(12, 4))
    window = max(1, len(results[0].step_s) // 50) if results else 1
    for r in results:
        if not r.ok:
            continue
        steps = list(range(cfg.warmup + 1, cfg.warmup + 1 + len(r.step_s)))
        (line,) = ax_rss.plot(steps, [mib(b) for b in r.rss_bytes], label=r.label)
        color = line.get_color()
        ax_ms.plot(steps, _running_median(r.cpu_step_s, window), color=color, label=f"{r.label}, CPU")
        ax_ms.plot(steps, _running_median(r.step_s, window), color=color, ls=":", label="wall")
    ax_rss.set(xlabel="step", ylabel="process RSS MiB", title="Resident memory after each step")
    ax_ms.set(
        xlabel="step", ylabel=f"step ms (running median of {window + 1})", title="Step time: CPU and wall"
    )
    for ax in (ax_rss, ax_ms):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _running_median(values: list[float], window: int) -> list[float]:
    return [Spread.of(values[max(0, i - window) : i + 1]).median * 1e3 for i in range(len(values))]


MODES = [
    Mode(flag="--endurance", script="endurance", default=EnduranceConfig(), quick=ENDURANCE_QUICK,
         run=run_endurance, question="Question: does a long Sonar run stay healthy: flat memory, no "
         "recompiles, steady step time?"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    common.main(SCRIPT, __doc__, argv, run=run, default=Config(), quick=QUICK, overrides=[shape], modes=MODES)


if __name__ == "__main__":
    main()
