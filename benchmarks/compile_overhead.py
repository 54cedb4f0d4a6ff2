"""Question: how much compile time does the Sonar pass add to torch.compile?

Compiled standard vs Sonar's compiled pass, with inductor and with aot_eager (same pass, no codegen),
from a cold cache every time (a fresh inductor cache directory and no FX-graph or AOTAutograd cache
hits), so neither arm is served a graph the other compiled. Compile overhead = the first train step
(forward and backward compiles, wherever an arm does them, and the optimizer step) minus a steady
step's median. Arms alternate order between repeats; the spread is over repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.utils import fresh_cache  # private, but the supported way to get a cold cache

from benchmarks import common
from benchmarks.arms import Arm
from benchmarks.common import Table
from benchmarks.workload import SHAPES, ModelShape, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import Spread
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import Batch, make_batches

SCRIPT = "compile_overhead"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    workload: Workload = field(default_factory=Workload)
    compilers: tuple[str, ...] = ("inductor", "aot_eager")
    methods: tuple[tuple[str, str], ...] = (("standard", "compiled"), ("sonar", "pass"))
    """(method, mode) pairs: the compiled baseline and the pass."""
    repeats: int = 2
    steady_steps: int = 3


QUICK = Config(compilers=("inductor",), repeats=1, steady_steps=2)


def measure_once(arm: Arm, shape: ModelShape, w: Workload, data: list[Batch]) -> dict[str, Any]:
    """One cold compile: phase times of the first step, then steady steps."""
    torch._dynamo.reset()
    with fresh_cache():
        model = shape.build(w.torch_dtype)
        method = arm.build(model, AdamWConfig(lr=1e-3))
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
    return {
        "arm": arm.label,
        "first_forward_s": t1 - t0,
        "first_backward_s": t2 - t1,
        "first_optimizer_s": t3 - t2,
        "steady_step_s": statistics.median(steady),
        "compile_s": (t3 - t0) - statistics.median(steady),
        "graphs_compiled": report.get("graphs_compiled"),
        "updates_inserted": report.get("updates_inserted"),
        "fallbacks": report.get("fallbacks", []),
    }


def run(cfg: Config) -> list[dict[str, Any]]:
    shape, w = SHAPES[cfg.shape], cfg.workload
    data = make_batches(1 + cfg.steady_steps, w.batch, w.seq)
    records = []
    for compiler in cfg.compilers:
        arms = [Arm(method=m, mode=mode, compiler=compiler) for m, mode in cfg.methods]  # type: ignore[arg-type]
        for rep in range(cfg.repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                print(f"  {compiler}: {arm.label}, repeat {rep + 1}/{cfg.repeats}", flush=True)
                try:
                    rec = measure_once(arm, shape, w, data)
                except Exception as err:  # reported in the table; the other arms still run
                    rec = {"arm": arm.label, "error": f"{type(err).__name__}: {err}"[:300]}
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


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape])
    records = run(inv.cfg)
    inv.finish([table(records)], records=records)


if __name__ == "__main__":
    main()
