"""Question (paper section 5.5): how do Sonar's memory saving and speedup shrink as the batch grows?

The saving is a fixed number of bytes (all expert gradients but one layer's); activations grow with
the batch, so the saving's share of the peak falls, and the time saved (no expert-gradient clipping,
no end-of-step pass over the expert state) becomes a smaller share of a longer step. Swept on the
OLMoE-shaped CPU model, batch 2 to 32: standard vs Sonar, eager (hooks) and compiled (pass).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import common
from benchmarks.arms import COMPILED, EAGER, Arm, ArmResult, Plan, by_label, run_arms
from benchmarks.common import Table, mib
from benchmarks.workload import SHAPES
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import fmt_ratio, ratio
from sonar_fx.methods import Execution
from sonar_fx.workload import make_batches

SCRIPT = "batch_sweep"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    batches: tuple[int, ...] = (2, 4, 8, 16, 32)
    seq: int = 64
    dtype: str = "bfloat16"
    plan: Plan = field(default_factory=lambda: Plan(warmup=1, rounds=5, held_out_batches=1))
    executions: tuple[Execution, ...] = (EAGER, COMPILED)
    """Eager (Sonar by hooks) and compiled (Sonar's pass), each against standard in the same execution."""
    lr: float = 1e-3


QUICK = Config(batches=(2, 8), plan=Plan(warmup=1, rounds=3, held_out_batches=1))


def arms_for(cfg: Config) -> list[Arm]:
    arms = []
    for ex in cfg.executions:
        arms += [Arm(method="standard", execution=ex), Arm(method="sonar", execution=ex)]
    return arms


def run(cfg: Config) -> tuple[list[dict], list[dict]]:
    import torch

    shape = SHAPES[cfg.shape]
    points, records = [], []
    for batch in cfg.batches:
        print(f"{shape.describe()}, batch {batch} x seq {cfg.seq}", flush=True)
        data = make_batches(cfg.plan.warmup + 1 + cfg.plan.rounds, batch, cfg.seq)
        held_out = make_batches(1, batch, cfg.seq, held_out=True)
        results = run_arms(
            lambda: shape.build(getattr(torch, cfg.dtype)),
            arms_for(cfg), AdamWConfig(lr=cfg.lr), cfg.plan, data, held_out,
        )  # fmt: skip
        points += [_point(batch, ex, results) for ex in cfg.executions]
        records += [{"batch": batch, **asdict(r)} for r in results]
    return points, records


def _point(batch: int, execution: Execution, results: list[ArmResult]) -> dict:
    a = by_label(results)
    base, sonar = (a.get(Arm(method=m, execution=execution).label) for m in ("standard", "sonar"))
    ok = base is not None and sonar is not None and base.ok and sonar.ok
    t = ratio(sonar, base)
    return {
        "batch": batch,
        "execution": execution.label,
        "ok": ok,
        "error": None if ok else next((r.error for r in (base, sonar) if r and r.error), "missing"),
        "standard_peak_mib": mib(base.peak_bytes) if ok and base else None,
        "sonar_peak_mib": mib(sonar.peak_bytes) if ok and sonar else None,
        "standard_total_mib": mib(base.peak_bytes + base.resident_bytes) if ok and base else None,
        "sonar_total_mib": mib(sonar.peak_bytes + sonar.resident_bytes) if ok and sonar else None,
        "predicted_mib": mib(sonar.predicted_saving_bytes) if ok and sonar else None,
        "standard_ms": base.step_ms.fmt(0) if ok and base else None,
        "sonar_ms": sonar.step_ms.fmt(0) if ok and sonar else None,
        "time_ratio": asdict(t) if t else None,
        "time_ratio_text": fmt_ratio(t),
    }


def table(points: list[dict]) -> Table:
    rows = []
    for p in points:
        if not p["ok"]:
            rows.append([p["batch"], p["execution"], f"failed: {p['error']}", *["-"] * 7])
            continue
        saved = p["standard_peak_mib"] - p["sonar_peak_mib"]
        total_change = p["sonar_total_mib"] / p["standard_total_mib"] - 1
        rows.append(
            [
                str(p["batch"]), p["execution"], f"{p['standard_peak_mib']:.1f}",
                f"{p['sonar_peak_mib']:.1f}", f"{saved:.1f} ({saved / p['standard_peak_mib']:.0%})",
                f"{saved / p['predicted_mib']:.0%}", f"{100 * total_change:+.1f}%",
                p["standard_ms"], p["sonar_ms"], p["time_ratio_text"],
            ]
        )  # fmt: skip
    headers = [
        "batch", "execution", "standard peak MiB", "sonar peak MiB", "saved MiB (share of peak)",
        "saved/predicted", "Δ total", "standard ms", "sonar ms", "sonar × standard",
    ]  # fmt: skip
    note = (
        "seq 64; eager: hooks vs eager standard; inductor: the pass vs compiled standard (global clip). "
        "Peaks are a step's transient bytes; Δ total adds weights and optimizer state (as the paper's do)."
    )
    return Table(title="Saving and speedup vs batch size", headers=headers, rows=rows, note=note)


def plot(points: list[dict], path: Path) -> bool:
    """Saving share of the peak and time ratio against the batch size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from matplotlib.ticker import NullLocator

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for ex in dict.fromkeys(p["execution"] for p in points):
        pts = [p for p in points if p["execution"] == ex and p["ok"]]
        xs = [p["batch"] for p in pts]
        share = [100 * (p["standard_peak_mib"] - p["sonar_peak_mib"]) / p["standard_peak_mib"] for p in pts]
        (mem_line,) = ax_mem.plot(xs, share, marker="o", label=f"{ex}: share of step peak")
        total = [100 * (1 - p["sonar_total_mib"] / p["standard_total_mib"]) for p in pts]
        ax_mem.plot(xs, total, marker="s", ls="--", color=mem_line.get_color(), label=f"{ex}: share of total")
        (line,) = ax_time.plot(xs, [p["time_ratio"]["median"] for p in pts], marker="o", label=ex)
        lo = [p["time_ratio"]["q25"] for p in pts]
        hi = [p["time_ratio"]["q75"] for p in pts]
        ax_time.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
    ax_mem.set(xlabel="batch", ylabel="peak memory saved (% of standard)")
    ax_time.set(xlabel="batch", ylabel="sonar / standard step time (IQR band)")
    ax_time.axhline(1.0, color="grey", lw=0.8)
    batch_sizes = sorted({p["batch"] for p in points})
    for ax in (ax_mem, ax_time):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape])
    points, records = run(inv.cfg)
    images = ["batch_sweep.png"] if plot(points, inv.out / "batch_sweep.png") else []
    inv.finish([table(points)], records=[*points, *records], images=images)


if __name__ == "__main__":
    main()
