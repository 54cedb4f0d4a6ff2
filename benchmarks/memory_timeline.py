"""Question: what does live memory look like through one training step, and where is the peak?

A picture of the claim: standard training piles up every layer's expert gradients through backward
and holds them until the optimizer step; Sonar (eager hooks, and the compiled pass) frees each layer's
gradients as soon as its update is done, so the backward curve carries at most one layer of them.
The curve is the running sum of the profiler's CPU allocator events ([memory] events, the same ones
`sonar_fx.memory.measure_peak` sums) over one step after warm-up, with the forward, backward and
optimizer phases marked by `record_function` ranges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.arms import COMPILED, Arm
from benchmarks.common import Table, mib
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.methods import TrainingMethod
from sonar_fx.workload import make_batches

SCRIPT = "memory_timeline"
PHASES = ("forward", "backward", "optimizer")
MAX_POINTS = 1500


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    workload: Workload = field(default_factory=Workload)
    arms: tuple[Arm, ...] = (
        Arm(method="standard"),
        Arm(method="sonar"),
        Arm(method="sonar", execution=COMPILED),
    )
    warmup: int = 2
    lr: float = 1e-3


QUICK = Config(warmup=1)


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


def run(cfg: Config) -> tuple[list[Timeline], dict[str, float]]:
    shape, w = SHAPES[cfg.shape], cfg.workload
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
    return lines, grads


def plot(lines: list[Timeline], grads: dict[str, float], path: Path) -> bool:
    """One panel per arm, phases shaded; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def table(lines: list[Timeline], grads: dict[str, float]) -> Table:
    rows = []
    for line in lines:
        durations = [f"{b - a:.0f}" for a, b in (line.phases[p] for p in PHASES)]
        rows.append(
            [
                line.label,
                f"{line.peak_mib:.1f}",
                line.peak_phase,
                f"{line.end_of_backward_mib:.1f}",
                *durations,
            ]
        )
    note = (
        f"Expert gradients: {grads['all']:.1f} MiB in all, {grads['one_layer']:.1f} MiB per layer. Live MiB "
        "is above the step's start (weights and optimizer state excluded); phase times include profiling."
    )
    headers = [
        "arm",
        "peak MiB",
        "peak in",
        "live at end of backward MiB",
        "forward ms",
        "backward ms",
        "optimizer ms",
    ]
    return Table(title="Live memory through one step", headers=headers, rows=rows, note=note)


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape])
    lines, grads = run(inv.cfg)
    images = ["memory_timeline.png"] if plot(lines, grads, inv.out / "memory_timeline.png") else []
    inv.finish([table(lines, grads)], records=[asdict(x) for x in lines], images=images)


if __name__ == "__main__":
    main()
