"""Question: how much compile time does the Sonar pass add to torch.compile?

Compiled standard vs Sonar's compiled pass, with inductor and with aot_eager (same pass, no codegen),
from a cold cache every time (a fresh inductor cache directory and no FX-graph or AOTAutograd cache
hits), so neither arm is served a graph the other compiled. Compile overhead = the first train step
(forward and backward compiles, wherever an arm does them, and the optimizer step) minus a steady
step's median. Arms alternate order between repeats; the spread is over repeats.

Regional compilation (`sonar_fx.compile(..., regional=True)`: each repeated decoder block compiled once,
one graph reused for all L blocks) against whole-model compilation of the pass, inductor, cold cache,
at L = 4 and L = 16 blocks: compile time and graph counts (dynamo graphs captured, backward graphs the
pass rewrote). Rows say "not available" where `sonar_fx.compile` has no `regional` option.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache  # private, but the supported way to get a cold cache

import sonar_fx
from benchmarks import common
from benchmarks.arms import Arm
from benchmarks.common import Table
from benchmarks.workload import SHAPES, ModelShape, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import Spread, short_error
from sonar_fx.methods import Execution, TrainingMethod, build_method
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import Batch, make_batches

SCRIPT = "compile_overhead"


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


QUICK = Config(compilers=("inductor",), repeats=1, steady_steps=2, regional_layers=(2,))


def measure_once(arm: Arm, shape: ModelShape, w: Workload, data: list[Batch]) -> dict[str, Any]:
    """One cold compile of `arm`: phase times of the first step, then steady steps."""
    return {
        "arm": arm.label,
        **cold_run(lambda: arm.build(shape.build(w.torch_dtype), AdamWConfig(lr=1e-3)), data),
    }


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


def regional_available() -> bool:
    """Whether this sonar_fx has `compile(..., regional=True)` (one graph per repeated block)."""
    return "regional" in inspect.signature(sonar_fx.compile).parameters


def run_regional(cfg: Config) -> list[dict[str, Any]]:
    """Whole-model vs regional compile of the pass (cold cache) at each of `regional_layers`."""
    if not cfg.regional_layers:
        return []
    if not regional_available():
        print("  regional: sonar_fx.compile has no regional= option here; rows marked not available")
        return [
            {"layers": n, "regional": r, "error": "not available"}
            for n in cfg.regional_layers
            for r in (False, True)
        ]
    w = cfg.workload
    data = make_batches(1 + cfg.steady_steps, w.batch, w.seq)
    records = []
    for layers in cfg.regional_layers:
        shape = dataclasses.replace(SHAPES[cfg.shape], layers=layers)
        for regional in (False, True):
            print(
                f"  {cfg.regional_compiler} pass, L={layers}, {'regional' if regional else 'whole model'}",
                flush=True,
            )

            def build(shape: ModelShape = shape, regional: bool = regional) -> TrainingMethod:
                model = shape.build(w.torch_dtype)
                # regional=True turns the KV cache off; so here for both rows, to compile the same model.
                getattr(model, "config").use_cache = False  # noqa: B009 (typed Module | Tensor)
                opt = AdamWConfig(lr=1e-3)
                return build_method("sonar", model, opt, compiler=cfg.regional_compiler, regional=regional)

            try:
                rec = cold_run(build, data)
            except Exception as err:  # reported in the table; the other rows still run
                rec = {"error": short_error(err)}
            records.append({"layers": layers, "regional": regional, **rec})
    torch._dynamo.reset()
    return records


def run(cfg: Config) -> list[dict[str, Any]]:
    shape, w = SHAPES[cfg.shape], cfg.workload
    data = make_batches(1 + cfg.steady_steps, w.batch, w.seq)
    records = []
    for compiler in cfg.compilers:
        arms = [Arm(method=m, execution=Execution(compiler=compiler)) for m in cfg.methods]  # type: ignore[arg-type]
        for rep in range(cfg.repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                print(f"  {compiler}: {arm.label}, repeat {rep + 1}/{cfg.repeats}", flush=True)
                try:
                    rec = measure_once(arm, shape, w, data)
                except Exception as err:  # reported in the table; the other arms still run
                    rec = {"arm": arm.label, "error": short_error(err)}
                records.append({"compiler": compiler, "repeat": rep, **rec})
    torch._dynamo.reset()
    return records


def table(records: list[dict[str, Any]]) -> Table:
    rows = []
    keys = sorted({(r["compiler"], r["arm"]) for r in records}, key=lambda k: (k[0], "sonar" in k[1]))
    baseline: dict[str, float] = {}
    for compiler, arm in keys:
        runs = [r for r in records if (r["compiler"], r["arm"]) == (compiler, arm)]
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append([compiler, arm, f"failed: {runs[0]['error']}", *["-"] * 5])
            continue
        comp = Spread.of([r["compile_s"] for r in ok])
        baseline.setdefault(compiler, comp.median)
        graphs = ok[-1]["graphs_compiled"]
        rows.append(
            [
                compiler, arm, comp.fmt(1),
                f"{comp.median / baseline[compiler]:.2f}x",
                f"{statistics.median(r['first_forward_s'] for r in ok):.1f}",
                f"{statistics.median(r['first_backward_s'] for r in ok):.1f}",
                f"{1e3 * statistics.median(r['steady_step_s'] for r in ok):.0f}",
                "-" if graphs is None else f"{graphs} graphs, {ok[-1]['updates_inserted']} updates",
            ]
        )  # fmt: skip
    headers = [
        "compiler", "arm", "compile s", "× standard", "first forward s", "first backward s", "steady step ms",
        "pass rewrote",
    ]  # fmt: skip
    note = (
        "Cold cache every run. compile s: first step minus the steady step's median (median [IQR] over "
        "repeats). The standard arms compile the backward graph lazily, at the first backward; with "
        "inductor the sonar pass compiles it during the first forward (so compiler failures reach the "
        "eager-hook fallback), which moves that time from its first backward s to its first forward s. "
        "With aot_eager both arms compile the backward lazily."
    )
    return Table(title="Compile time with and without the pass", headers=headers, rows=rows, note=note)


def regional_table(records: list[dict[str, Any]], compiler: str = "inductor") -> Table:
    rows = []
    whole: dict[int, float] = {}
    for r in records:
        how = "regional" if r["regional"] else "whole model"
        if "error" in r:
            rows.append([str(r["layers"]), how, f"failed: {r['error']}" if r["error"] != "not available" else
                         "not available (no regional= in sonar_fx.compile)", *["-"] * 5])  # fmt: skip
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
    headers = [
        "blocks L",
        "compile",
        "compile s",
        "× whole model",
        "dynamo graphs",
        "pass rewrote",
        "steady step ms",
    ]
    note = (
        f"Sonar's compiled pass, {compiler}, cold cache, one run each. Regional: each decoder block compiled "
        "once and the graph reused for all L blocks, so its compile time should not grow with L. dynamo "
        "graphs: graphs captured in the run; pass rewrote: backward graphs the pass rewrote."
    )
    return Table(title="Regional vs whole-model compilation", headers=headers, rows=rows, note=note)


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape])
    records = run(inv.cfg)
    regional = run_regional(inv.cfg)
    tables = [table(records)] + ([regional_table(regional, inv.cfg.regional_compiler)] if regional else [])
    inv.finish(tables, records=[*records, *({"section": "regional", **r} for r in regional)])


if __name__ == "__main__":
    main()
