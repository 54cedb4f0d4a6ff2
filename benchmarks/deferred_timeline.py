"""Question: when does each expert gradient's all-reduce run in the deferred step, on each rank?

`python -m benchmarks.distributed_deferred --timeline`: live memory through one deferred step on DDP
(clip over every parameter: the norm pass, then the update pass), on each of 2 gloo ranks, the running
sum of the profiler's CPU allocator events (`benchmarks.profiles.timeline`, the single-process
`--timeline`'s), with each expert gradient's all-reduce marked from its start to its wait: the step
computes the next gradient while it runs (`sonar_fx.optim.deferred_pipeline`). The marks wrap the
reduction's handles (instrumentation only: the same collectives, in the same order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import Output, Table, mib
from benchmarks.distributed_arms import Config, build, steps_of
from benchmarks.distributed_deferred import per_rank
from benchmarks.profiles import timeline
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.memory import ExpertGradBytes


class _Marked:
    """A started reduction, marked in the profiler from its start to its wait (`in_flight:<name>`)."""

    def __init__(self, started: Any, name: str) -> None:
        self.started, self.in_flight = started, started.in_flight
        self.mark = record_function(f"in_flight:{name}")
        self.mark.__enter__()

    def wait(self) -> torch.Tensor:
        grad = self.started.wait()
        self.mark.__exit__(None, None, None)
        return grad


def _mark_reductions(reduction: Any) -> None:
    """Mark each expert gradient's reduction at step() in the profiler (instrumentation only)."""
    at_step = reduction.at_step

    def marked() -> Callable[[str, torch.Tensor], _Marked]:
        reduce = at_step()
        return lambda name, grad: _Marked(reduce(name, grad), name)

    reduction.at_step = marked


def _mark_computes(store: Any) -> None:
    """Mark each expert gradient's computation from its kept operands (`computing`)."""
    compute = store.gradient

    def marked(param: torch.Tensor, **kwargs: Any) -> Any:
        with record_function("computing"):
            return compute(param, **kwargs)

    store.gradient = marked


def timeline_job(cfg: Config, engine: str) -> list[dict[str, Any]]:
    """Live memory through one deferred step (clip over all) on this rank, and each expert gradient's
    reduction from its start to its wait."""
    arm = build(cfg, engine, True, "all")
    steps = steps_of(cfg, cfg.warmup + 1, seed=1)
    for micro in steps[:-1]:
        arm.train(micro)
    _mark_reductions(arm.sonar.distributed)
    _mark_computes(arm.sonar.deferred)
    micro = steps[-1]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench.forward"):  # the micro-batches under no_sync()
            for b in micro[:-1]:
                with arm.run.no_sync():  # type: ignore[operator]
                    arm.run(**b).loss.backward()
        with record_function("bench.backward"):  # the last, synced micro-batch
            arm.run(**micro[-1]).loss.backward()
        with record_function("bench.optimizer"):
            arm.step()
    line = timeline(f"rank {dist.get_rank()}: deferred {engine}, clip all", prof)
    events = list(prof.profiler.kineto_results.events())
    t0 = min(e.start_ns() for e in events if e.name().startswith("bench."))
    flights = _spans(events, "in_flight:", t0)
    computes = _spans(events, "computing", t0)
    grads = ExpertGradBytes.of(ExpertSet.discover(arm.model).layers)
    return [{"engine": engine, "rank": dist.get_rank(), "line": asdict(line), "flights": flights,
             "computes": computes,
            "one_tensor_mib": mib(max(p.numel() * p.element_size() for p in arm.experts)),
            "all_mib": mib(grads.total)}]  # fmt: skip


def _spans(events: list[Any], prefix: str, t0: int) -> list[tuple[float, float]]:
    """(start ms, end ms) of the profiler's ranges named `prefix...`, from `t0` (ns), in order."""
    return sorted(((e.start_ns() - t0) / 1e6, (e.end_ns() - t0) / 1e6) for e in events
                  if e.name().startswith(prefix))  # fmt: skip


def draw_timelines(records: list[dict[str, Any]], plt: Any) -> Any:
    """One panel per rank: live memory (step plot), the step's phases shaded, each all-reduce in flight."""
    fig, axes = plt.subplots(len(records), 1, figsize=(10, 2.8 * len(records)), squeeze=False)
    phase_names = {"forward": "micro-batches 1..A-1 (no_sync)", "backward": "last micro-batch",
                   "optimizer": "step()"}  # fmt: skip
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    for ax, rec in zip(axes[:, 0], records, strict=True):
        line = rec["line"]
        for phase, (a, b) in line["phases"].items():
            ax.axvspan(a, b, color=colors[phase], alpha=0.10, label=phase_names[phase])
        ax.plot(line["t_ms"], line["live_mib"], color="black", lw=1, drawstyle="steps-post")
        top = max(line["live_mib"]) * 1.05
        for k, (a, b) in enumerate(rec["flights"]):
            y = top * (0.92 if k % 2 else 0.97)
            ax.plot([a, b], [y, y], color="tab:red", lw=3, solid_capstyle="butt",
                    label="an expert gradient's all-reduce, start to wait" if k == 0 else None)  # fmt: skip
        for k, (a, b) in enumerate(rec["computes"]):
            ax.plot([a, b], [top * 0.86] * 2, color="tab:blue", lw=3, solid_capstyle="butt",
                    label="an expert gradient computed (kept operands)" if k == 0 else None)  # fmt: skip
        ax.axhline(2 * rec["one_tensor_mib"], color="tab:purple", ls=":", lw=0.8, label="two expert tensors")
        ax.set_title(f"{line['label']}: peak {line['peak_mib']:.1f} MiB", fontsize=10)
        ax.set_ylabel("live MiB")
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", fontsize=8, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def run_timeline(cfg: Config) -> Output:
    records = [r for rank in per_rank(replace(cfg, engines=("ddp",)), timeline_job) for r in rank]
    rows = [[f"rank {r['rank']}", f"{r['line']['peak_mib']:.1f}", f"{2 * r['one_tensor_mib']:.1f}",
             str(len(r["flights"]))] for r in records]  # fmt: skip
    note = (
        "Live memory through one deferred step on DDP (clip over every parameter: a norm pass and an update "
        "pass), per rank; red bars: each expert gradient's all-reduce from its start to its wait, during "
        "which the next gradient is computed. Figure: distributed_timeline.png."
    )
    table = Table(title="Deferred step timeline", headers=["rank", "peak MiB", "two expert tensors MiB",
                  "all-reduces"], rows=rows, note=note)  # fmt: skip
    return Output(tables=[table], records=records,
                  figures={"distributed_timeline.png": partial(draw_timelines, records)})  # fmt: skip
