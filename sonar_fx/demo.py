"""`sonar-fx demo` (`make demo`): Sonar-MoE against its baselines on one tiny model, on this machine.

For: training `tiny-olmoe` (resized, see `DEMO_SHAPE`) on the built-in instruction set under standard
training (global clip), standard_no_expert_clip (Sonar's exact twin), Sonar with eager hooks, Sonar's
hooks on a compiled model, the compiled pass and the compiled twin; and the ordinary recipe (one clip
over every parameter, each batch as 2 micro-batches) under standard training and under Sonar's deferred
schedule; then printing the paper-style table, checking that each Sonar arm's expert weights are
bitwise equal to its twin's (`TWINS`), and writing demo.json and demo.png. The arms are measured by
`sonar_fx.measure`, all alive at once: warm-up and one profiled memory step each, then timed rounds in
which every arm takes one step, in rotating order, so a burst of load on a shared machine lands on
every arm alike and step-time ratios are paired per round.
Never: claim a GPU number (CPU timings are ratios within one run), or drive training through anything
but `sonar_fx.methods.build_method` and an LR schedule.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tabulate import tabulate
from torch import nn
from tqdm import tqdm

from sonar_fx.api import Compiler
from sonar_fx.config import AdamWConfig, ExpertClip
from sonar_fx.environment import Environment
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.measure import ArmResult, fmt_ratio, measure_arm, ratio, run_rounds, side_by_side
from sonar_fx.memory import process_peak_rss_bytes, state_bytes
from sonar_fx.methods import Execution, TrainingMethod, build_method
from sonar_fx.models import build_model
from sonar_fx.trainer.config import ConfigError
from sonar_fx.trainer.schedule import WarmupCosine
from sonar_fx.workload import Batch, held_out_loss, make_batches

DEMO_SHAPE = dict(hidden_size=128, intermediate_size=256, num_experts=64, num_hidden_layers=4)
"""tiny-olmoe with 64 experts of width 256 in 4 layers: 96 MiB of fp32 expert gradients against a few
MiB of batch-2 activations, so (as for OLMoE-1B-7B, whose expert gradients are 12.9 GB in bf16) expert
gradients dominate a step's transient memory and Sonar's saving is visible."""
WARMUP_STEPS = 2
"""Untimed steps per arm before its memory step (the first one compiles)."""
MiB = 2**20


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    method: str
    execution: Execution = field(default_factory=Execution)
    """Compiled arms run under the demo's `--compiler` (`under`), whatever compiler is written here."""
    micro_batches: int = 1
    """Each step's batch taken as this many micro-batches, their gradients accumulated (loss / count)."""
    expert_clip: ExpertClip = None
    """The config's: "global" has Sonar's deferred step clip by the norm over every parameter."""
    baseline: str = "standard"
    """The arm its memory and time are compared with (the deferred arm: standard with its recipe)."""

    def under(self, compiler: Compiler) -> Arm:
        """This arm with its compiled execution on `compiler` (eager arms stay eager)."""
        if not self.execution.compiled:
            return self
        return replace(self, execution=replace(self.execution, compiler=compiler))


_COMPILED = Execution(compiler="inductor")
ARMS = (
    Arm("standard", "standard (global clip)", "standard"),
    Arm("no_expert_clip", "standard_no_expert_clip", "standard_no_expert_clip"),
    Arm("sonar_eager", "sonar, eager hooks", "sonar"),
    Arm("sonar_hooks_compiled", "sonar, hooks on a compiled model", "sonar",
        Execution(compiler="inductor", sonar_pass=False)),
    Arm("no_expert_clip_compiled", "standard_no_expert_clip, compiled", "standard_no_expert_clip", _COMPILED),
    Arm("sonar_compiled", "sonar, compiled pass", "sonar", _COMPILED),
    # The ordinary recipe: a clip over every parameter and gradient accumulation, kept exact by the
    # deferred schedule (eager: SonarTrainer's default, and no compile time).
    Arm("standard_accum", "standard (global clip), 2 micro-batches", "standard", micro_batches=2),
    Arm("sonar_deferred", "sonar deferred (global clip), 2 micro-batches", "sonar_deferred", micro_batches=2,
        expert_clip="global", baseline="standard_accum"),
)  # fmt: skip
BASELINE = "standard"
# (sonar arm, its exact twin): same data, seed and init, so expert weights must be bitwise equal.
TWINS = (
    ("sonar_eager", "no_expert_clip"),
    ("sonar_hooks_compiled", "no_expert_clip_compiled"),
    ("sonar_compiled", "no_expert_clip_compiled"),
    ("sonar_deferred", "standard_accum"),
)
MEMORY_LEGEND = {
    "state_mib": "weights + gradients still alive + optimizer states at the start of the measured step",
    "step_transient_mib": "peak tensor bytes one step allocates above its start (profiler allocator events)",
    "peak_mib": "step peak = state_mib + step_transient_mib (the paper's absolute peaks include the state)",
    "process_rss_high_water_mib": "the whole process's resident-memory high-water mark (ru_maxrss): Python, "
    "torch, compiled code and every arm alive at once; shown on the progress bar, not an arm's figure",
}


class DemoConfigError(ConfigError):
    """A demo setting is out of range; the message names the flag and its minimum (the command line
    exits 2 with it, as for any `ConfigError`)."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The demo's settings; every arm shares them."""

    out: str = "runs/demo"
    """Folder for demo.json and demo.png."""
    compiler: Literal["inductor", "aot_eager"] = "inductor"
    """Compiler of the compiled arms (aot_eager: the same graphs and pass, no codegen, faster start)."""
    steps: int = 100
    """Steps per arm: warm-up, one memory step, then timed rounds."""
    batch_size: int = 2
    """The paper's batch size."""
    seq: int = 256
    """Tokens per sequence (packed windows of the instruction set: every token is supervised)."""
    lr: float = 3e-3
    """High for fine-tuning, right for a model trained from scratch in a few minutes."""
    warmup: int = 10
    """LR warm-up steps (then cosine down to `min_lr`)."""
    min_lr: float = 3e-4
    held_out: int = 4
    """Held-out windows of batch_size x seq tokens, evaluated before, halfway and after."""
    seed: int = 42
    progress: bool = True
    min_loss_drop: float = 0.25
    """The demo fails unless every arm's held-out loss falls by at least this fraction."""
    model_overrides: dict[str, Any] = field(default_factory=lambda: dict(DEMO_SHAPE))
    """tiny-olmoe's shape (tests shrink it)."""
    arms: tuple[str, ...] = tuple(arm.key for arm in ARMS)
    """Which arms to run (tests run the eager ones)."""

    def __post_init__(self) -> None:
        least = WARMUP_STEPS + 2  # warm-up, the memory step and at least one timed round
        if self.steps < least:
            raise DemoConfigError(
                f"--steps {self.steps}: the demo needs at least {least} steps per arm ({WARMUP_STEPS} "
                "warm-up, 1 memory step, 1 timed)",
                flag="--steps",
            )
        if self.held_out < 1:
            raise DemoConfigError(f"held_out={self.held_out}: evaluate on at least 1 held-out window")
        unknown = set(self.arms) - {arm.key for arm in ARMS}
        if unknown:
            raise DemoConfigError(f"unknown arms {sorted(unknown)}: pick from {[a.key for a in ARMS]}")
        split = max(arm.micro_batches for arm in ARMS if arm.key in self.arms)
        if self.batch_size % split:
            raise DemoConfigError(
                f"batch_size={self.batch_size}: an arm takes each batch as {split} micro-batches; use a "
                f"multiple of {split}"
            )


@dataclass
class _Run:
    """One arm while the demo runs it."""

    arm: Arm
    model: nn.Module
    method: TrainingMethod
    schedulers: list[torch.optim.lr_scheduler.LambdaLR]
    result: ArmResult
    losses: list[float] = field(default_factory=list)
    evals: dict[int, float] = field(default_factory=dict)
    state_bytes: int = 0

    def step(self, batch: Batch) -> None:
        n = self.arm.micro_batches
        micro = [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)] if n > 1 else batch
        loss = float(self.method.train_step(micro))  # float() synchronises: the time is the whole step
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {len(self.losses) + 1}")
        for sched in self.schedulers:
            sched.step()
        self.losses.append(loss)


def run_demo(cfg: DemoConfig) -> int:
    """Run every arm, print the table and verdicts, write demo.json and demo.png; 0 when all is well."""
    out = Path(cfg.out)
    started = time.perf_counter()
    runs = _train(cfg, started)
    verdicts = [_twin_verdict(runs[a], runs[b]) for a, b in TWINS if {a, b} <= set(runs)]
    report = _report(cfg, runs, verdicts, time.perf_counter() - started)
    print("\n" + report["table"])
    for line in [*report["notes"], *(v["text"] for v in verdicts)]:
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    _chart(runs, out / "demo.png", cfg)
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'} ({report['wall_s']:.0f}s)")
    problems = [f"{r.arm.label} failed: {r.result.error}" for r in runs.values() if r.result.error]
    problems += [v["text"] for v in verdicts if v["equal"] is False]
    problems += [
        f"{r.arm.label}: held-out loss fell by less than {cfg.min_loss_drop:.0%}"
        for r in runs.values()
        if r.result.error is None and not _learned(r, cfg)
    ]
    for problem in problems:
        print(f"DEMO FAILED: {problem}")
    return 1 if problems else 0


def _train(cfg: DemoConfig, started: float) -> dict[str, _Run]:
    """Build every arm, warm it up and measure its memory, then time all of them in rounds."""
    batches = make_batches(cfg.steps, cfg.batch_size, cfg.seq, seed=cfg.seed)
    held_out = make_batches(cfg.held_out, cfg.batch_size, cfg.seq, seed=cfg.seed, held_out=True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch._dynamo.reset()
    runs: dict[str, _Run] = {}
    try:
        # Inductor's parallel CPU reductions would otherwise blur the bitwise comparison of the twins.
        torch.use_deterministic_algorithms(True)
        with side_by_side():
            for i, arm in enumerate(a for a in ARMS if a.key in cfg.arms):
                elapsed = time.perf_counter() - started
                tqdm.write(
                    f"[{i + 1}/{len(cfg.arms)}] {arm.label}: build, warm up, memory step ({elapsed:.0f}s in)"
                )
                runs[arm.key] = _build(cfg, arm.under(cfg.compiler))
                _warm_up(runs[arm.key], batches, held_out)
            _timed_rounds(cfg, list(runs.values()), batches[WARMUP_STEPS + 1 :], held_out)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch._dynamo.reset()  # the compiled graphs hold these models
    return runs


def _build(cfg: DemoConfig, arm: Arm) -> _Run:
    model = build_model("tiny-olmoe", dtype=torch.float32, seed=cfg.seed, **cfg.model_overrides)
    opt = AdamWConfig(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)
    opt = replace(opt, expert_clip=arm.expert_clip)
    method = build_method(arm.method, model, opt, execution=arm.execution)
    shape = WarmupCosine(cfg.warmup, cfg.steps, cfg.min_lr / cfg.lr)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, shape) for o in method.optimizers]
    return _Run(arm, model, method, schedulers, ArmResult(label=arm.label))


def _warm_up(run: _Run, batches: list[Batch], held_out: list[Batch]) -> None:
    """Held-out loss before training, the warm-up steps, then one profiled step for memory."""
    run.evals[0] = held_out_loss(run.model, held_out)
    measure_arm(run.result, run.step, batches[:WARMUP_STEPS], batches[WARMUP_STEPS])
    # Between steps no gradient is held: what the measured step started with.
    run.state_bytes = state_bytes(run.model, run.method.optimizers)
    failed = f"; FAILED: {run.result.error}" if run.result.error else ""
    compiles = " (compilation included)" if run.arm.execution.compiled else ""
    tqdm.write(f"    first step {run.result.first_step_s:.1f}s{compiles}{failed}")


def _timed_rounds(cfg: DemoConfig, runs: list[_Run], batches: list[Batch], held_out: list[Batch]) -> None:
    """Interleaved rounds over the remaining steps; held-out loss halfway (untimed) and at the end."""
    done_before = WARMUP_STEPS + 1
    halfway = max(cfg.steps // 2, done_before + 1)
    tqdm.write(f"timing {len(batches)} rounds: every arm takes one step per round, in rotating order")
    bar = tqdm(total=len(batches), desc="timed rounds (every arm one step each)", disable=not cfg.progress,
               dynamic_ncols=True, mininterval=0.5)  # fmt: skip

    def after_round(r: int) -> None:
        done = done_before + r + 1
        if done in (halfway, cfg.steps):
            for run in runs:
                if run.result.error is None:
                    run.evals[done] = held_out_loss(run.model, held_out)
        base = next((run for run in runs if run.arm.key == BASELINE and run.losses), None)
        postfix = {"loss (standard)": f"{base.losses[-1]:.3f}"} if base else {}
        # The process's high-water mark, every arm included: not a per-arm step peak (see the table).
        postfix["process RSS high-water"] = f"{process_peak_rss_bytes() / MiB:.0f}MiB"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)

    with bar:
        run_rounds([(run.result, run.step) for run in runs], batches, after_round=after_round)


def _learned(run: _Run, cfg: DemoConfig) -> bool:
    final = run.evals.get(cfg.steps)
    return final is not None and final < (1 - cfg.min_loss_drop) * run.evals[0]


def _expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {t.name: t.param.detach() for t in ExpertSet.discover(model).tensors}


def _twin_verdict(a: _Run, b: _Run) -> dict[str, Any]:
    keys, la, lb = [a.arm.key, b.arm.key], a.arm.label, b.arm.label
    if a.result.error or b.result.error:
        missing = ", ".join(r.arm.label for r in (a, b) if r.result.error)
        return {"arms": keys, "equal": None, "text": f"{la} vs {lb}: not compared ({missing} failed)"}
    wa, wb = _expert_weights(a.model), _expert_weights(b.model)
    same = [n for n in wa if torch.equal(wa[n], wb[n])]
    equal = len(same) == len(wa)
    if equal:
        verdict = f"BITWISE EQUAL ({len(wa)} of {len(wa)} expert tensors)"
    else:
        worst = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
        differ = len(wa) - len(same)
        verdict = f"NOT bitwise equal ({differ} of {len(wa)} expert tensors differ, max |diff| {worst:.3g})"
    return {"arms": keys, "equal": equal, "text": f"{la} vs {lb}: expert weights {verdict}"}


def _report(cfg: DemoConfig, runs: dict[str, _Run], verdicts: list, wall_s: float) -> dict[str, Any]:
    rows = [_row(cfg, run, runs.get(run.arm.baseline)) for run in runs.values()]
    headers = ["arm", "compiler", "state MiB", "step transient MiB", "step peak MiB", "vs baseline",
               "step ms", "× baseline", "tokens/s", "held-out loss"]  # fmt: skip
    table = tabulate([r["cells"] for r in rows], headers=headers, disable_numparse=True)
    rss = process_peak_rss_bytes() / MiB
    notes = [
        "state = weights + optimizer states between steps; step transient = the most tensor bytes one step "
        "allocates above that (profiler allocator events, one step after warm-up); step peak = state + "
        "step transient. baseline: the deferred arm's is standard with its recipe (global clip, 2 "
        "micro-batches), the run it equals bitwise; every other arm's is standard (global clip).",
        f"Not the same figure: the progress bar's process RSS high-water ({rss:.0f} MiB at the end) is the "
        "whole process with every arm alive at once.",
        "step ms: median [IQR] of the timed rounds; × baseline: median [IQR] of per-round paired ratios "
        "(every arm steps once per round, in rotating order). CPU timings are ratios within one run on a "
        "shared machine, not GPU claims (under torch.compile, fp32 expert layers run transformers' "
        "per-expert fallback loop instead of a grouped GEMM).",
    ]
    return {
        "config": asdict(cfg),
        "model": {"name": "tiny-olmoe", "overrides": cfg.model_overrides},
        "table": table,
        "rows": [r["data"] for r in rows],
        "memory_legend": MEMORY_LEGEND,
        "process_rss_high_water_mib": rss,
        "bitwise": verdicts,
        "errors": {k: r.result.error for k, r in runs.items() if r.result.error},
        "notes": notes,
        "wall_s": wall_s,
        **Environment.now("cpu").summary(),
    }


def _row(cfg: DemoConfig, run: _Run, base: _Run | None) -> dict[str, Any]:
    arm, r = run.arm, run.result
    compiler = arm.execution.compiler
    if not r.ok:
        return {"cells": [arm.label, compiler, f"failed: {(r.error or 'no step')[:60]}", *[""] * 7],
                "data": {"arm": arm.key, "error": r.error}}  # fmt: skip
    peak = run.state_bytes + r.peak_bytes
    data: dict[str, Any] = {
        "arm": arm.key, "label": arm.label, "method": arm.method, "compiler": compiler,
        "micro_batches": arm.micro_batches, "expert_clip": arm.expert_clip, "baseline": arm.baseline,
        "sonar_pass": arm.execution.sonar_pass, "peak_mib": peak / MiB,
        "step_transient_mib": r.peak_bytes / MiB,
        "state_mib": run.state_bytes / MiB, "first_step_s": r.first_step_s,
        "step_ms": asdict(r.step_ms), "median_step_ms": r.step_ms.median,
        "tokens_per_s": cfg.batch_size * cfg.seq / (r.step_ms.median / 1e3),
        "held_out_loss": run.evals.get(cfg.steps), "held_out_loss_initial": run.evals[0],
        "held_out_curve": {str(k): v for k, v in sorted(run.evals.items())},
    }  # fmt: skip
    vs_time = ratio(r, base.result) if base is not None else None
    if base is not None and base.result.ok:
        data["peak_change"] = peak / (base.state_bytes + base.result.peak_bytes) - 1
        data["step_time_ratio"] = asdict(vs_time) if vs_time else None
    final = data["held_out_loss"]
    cells = [
        arm.label, compiler, f"{data['state_mib']:.1f}", f"{data['step_transient_mib']:.1f}",
        f"{data['peak_mib']:.1f}", _pct(data.get("peak_change")), r.step_ms.fmt(1), fmt_ratio(vs_time),
        f"{data['tokens_per_s']:.0f}",
        f"{run.evals[0]:.3f} -> " + ("-" if final is None else f"{final:.4f}"),
    ]  # fmt: skip
    return {"cells": cells, "data": data}


def _pct(change: float | None) -> str:
    return "" if change is None else f"{change * 100:+.1f}%"


def _chart(runs: dict[str, _Run], path: Path, cfg: DemoConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the PNG file
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [run for run in runs.values() if run.result.ok]
    labels = [run.arm.label.replace(", ", "\n") for run in ok]
    state = [run.state_bytes / MiB for run in ok]
    transient = [run.result.peak_bytes / MiB for run in ok]
    fig, (ax_mem, ax_ms, ax_loss) = plt.subplots(1, 3, figsize=(18, 5.5))
    ax_mem.barh(labels, state, label="state: weights + optimizer states")
    ax_mem.barh(labels, transient, left=state, label="step transient peak")
    ax_mem.set_xlabel("MiB (step peak = state + step transient); vs baseline beside each bar")
    ax_mem.set_title("Step peak memory (tensor bytes, not process RSS)")
    ax_mem.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    ax_mem.invert_yaxis()
    versus = [_versus_baseline(run, runs) for run in ok]
    for y, (total, (peak, _)) in enumerate(zip(np.add(state, transient), versus, strict=True)):
        ax_mem.text(total, y, f" {peak}", va="center", fontsize=8)
    spreads = [run.result.step_ms for run in ok]
    medians = [s.median for s in spreads]
    errors = [[m - s.q25 for m, s in zip(medians, spreads, strict=True)],
              [s.q75 - m for m, s in zip(medians, spreads, strict=True)]]  # fmt: skip
    ax_ms.barh(labels, medians, xerr=errors, color="tab:gray", capsize=3)
    ax_ms.set_xlabel("step ms (CPU): median, IQR bars; arms interleaved; × baseline beside each bar")
    for y, (s, (_, times)) in enumerate(zip(spreads, versus, strict=True)):
        ax_ms.text(s.q75, y, f" {times}", va="center", fontsize=8)
    for ax in (ax_mem, ax_ms):
        ax.margins(x=0.45)  # room for the text beside the longest bar
    ax_ms.set_title(f"Step time ({cfg.compiler} for compiled arms)")
    ax_ms.set_yticklabels([])
    ax_ms.invert_yaxis()
    for run in ok:
        steps = sorted(run.evals)
        ax_loss.plot(steps, [run.evals[k] for k in steps], marker="o", label=run.arm.label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("held-out loss")
    ax_loss.set_title("Held-out loss")
    ax_loss.legend(fontsize=8)
    shape = ", ".join(f"{k}={v}" for k, v in cfg.model_overrides.items())
    fig.suptitle(f"Sonar-MoE demo: tiny-olmoe ({shape}), fp32, batch {cfg.batch_size} x {cfg.seq}, "
                 f"{cfg.steps} steps")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versus_baseline(run: _Run, runs: dict[str, _Run]) -> tuple[str, str]:
    """`run`'s step peak change and paired time ratio against its baseline, as the table gives them."""
    base = runs.get(run.arm.baseline)
    if base is None or not base.result.ok or base is run:
        return ("baseline" if base is run else "", "")
    peak = (run.state_bytes + run.result.peak_bytes) / (base.state_bytes + base.result.peak_bytes) - 1
    which = "" if run.arm.baseline == BASELINE else " vs standard, same recipe"
    return _pct(peak) + which, fmt_ratio(ratio(run.result, base.result)) + which
