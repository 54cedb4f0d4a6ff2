"""`sonar-fx demo` (`make demo`): Sonar-MoE against its baselines on one tiny model, on this machine.

For: fine-tuning `tiny-olmoe` (resized, see `DEMO_SHAPE`) on the built-in instruction set under
standard training (global clip), standard_no_expert_clip (Sonar's exact twin), Sonar with eager
hooks, Sonar's hooks on a compiled model, the compiled pass, and the compiled twin; then printing
the paper-style table, checking that Sonar's expert weights are bitwise equal to its twin's, and
writing demo.json and demo.png. Never: claim a GPU number; CPU timings are ratios within one run.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tabulate import tabulate
from tqdm import tqdm

from sonar_fx.experts.discovery import discover_experts
from sonar_fx.methods import Execution
from sonar_fx.trainer import RunResult, TrainConfig, train

DEMO_SHAPE = dict(hidden_size=128, intermediate_size=256, num_experts=64, num_hidden_layers=4)
"""tiny-olmoe with 64 experts of width 256 in 4 layers: 96 MiB of fp32 expert gradients against a few
MiB of batch-2 activations, so (as for OLMoE-1B-7B, whose expert gradients are 12.9 GB in bf16) expert
gradients dominate a step's transient memory and Sonar's saving is visible."""


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    method: str
    compiled: bool
    sonar_pass: bool = True


ARMS = (
    Arm("standard", "standard (global clip)", "standard", False),
    Arm("no_expert_clip", "standard_no_expert_clip", "standard_no_expert_clip", False),
    Arm("sonar_eager", "sonar, eager hooks", "sonar", False),
    Arm("sonar_hooks_compiled", "sonar, hooks on a compiled model", "sonar", True, sonar_pass=False),
    Arm("no_expert_clip_compiled", "standard_no_expert_clip, compiled", "standard_no_expert_clip", True),
    Arm("sonar_compiled", "sonar, compiled pass", "sonar", True),
)
BASELINE = "standard"
# (sonar arm, its exact twin): same data, seed and init, so expert weights must be bitwise equal.
TWINS = (
    ("sonar_eager", "no_expert_clip"),
    ("sonar_hooks_compiled", "no_expert_clip_compiled"),
    ("sonar_compiled", "no_expert_clip_compiled"),
)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The demo's settings; every arm shares them."""

    out: str = "runs/demo"
    """Folder for demo.json, demo.png and one run folder per arm."""
    compiler: Literal["inductor", "aot_eager"] = "inductor"
    """Compiler of the compiled arms (aot_eager: the same graphs and pass, no codegen, faster start)."""
    steps: int = 100
    batch_size: int = 2
    """The paper's batch size."""
    lr: float = 3e-3
    """High for fine-tuning, right for a model trained from scratch in a few minutes."""
    warmup: int = 10
    min_lr: float = 3e-4
    held_out: int = 64
    """Enough supervised tokens (~1,000) to show the fall; evaluated before, halfway and after."""
    seed: int = 42
    progress: bool = True
    min_loss_drop: float = 0.25
    """The demo fails unless every arm's held-out loss falls by at least this fraction."""
    model_overrides: dict[str, Any] = field(default_factory=lambda: dict(DEMO_SHAPE))
    """tiny-olmoe's shape (tests shrink it)."""
    arms: tuple[str, ...] = tuple(arm.key for arm in ARMS)
    """Which arms to run (tests run the eager ones)."""


def run_demo(cfg: DemoConfig) -> int:
    """Run every arm, print the table and verdicts, write demo.json and demo.png; 0 when all is well."""
    out = Path(cfg.out)
    started = time.perf_counter()
    summaries, weights, errors = _run_arms(cfg, out, started)
    verdicts = [_twin_verdict(a, b, weights, errors) for a, b in TWINS if {a, b} <= set(cfg.arms)]
    report = _report(cfg, summaries, errors, verdicts, time.perf_counter() - started)
    print("\n" + report["table"])
    for line in [*report["notes"], *(v["text"] for v in verdicts)]:
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    if summaries:
        _chart(summaries, out / "demo.png", cfg)
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'} ({report['wall_s']:.0f}s)")
    problems = [f"{_label(k)} failed" for k in errors]
    problems += [v["text"] for v in verdicts if v["equal"] is False]
    problems += [
        f"{_label(k)}: held-out loss fell by less than {cfg.min_loss_drop:.0%}"
        for k in _unlearned(summaries, cfg)
    ]
    for problem in problems:
        print(f"DEMO FAILED: {problem}")
    return 1 if problems else 0


def _run_arms(
    cfg: DemoConfig, out: Path, started: float
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Train every selected arm in turn: summaries, expert weights of the twins, and errors by arm."""
    summaries: dict[str, dict[str, Any]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, str] = {}
    twin_keys = {k for pair in TWINS for k in pair}
    arms = [arm for arm in ARMS if arm.key in cfg.arms]
    for i, arm in enumerate(arms, start=1):
        compiler = cfg.compiler if arm.compiled else "eager"
        elapsed = time.perf_counter() - started
        tqdm.write(f"\n[{i}/{len(arms)}] {arm.label} (compiler {compiler}), {elapsed:.0f}s in")
        torch._dynamo.reset()  # each arm compiles its own model; no graph or guard carries over
        try:
            result = train(_arm_config(cfg, arm, out))
        except Exception as exc:  # an arm that cannot run is reported in the table, not hidden
            errors[arm.key] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            tqdm.write(f"[{i}/{len(arms)}] {arm.label} FAILED: {errors[arm.key]}")
            continue
        summaries[arm.key] = result.summary
        if arm.key in twin_keys:
            weights[arm.key] = _expert_weights(result)
        del result  # frees the model and optimizer states before the next arm
    return summaries, weights, errors


def _arm_config(cfg: DemoConfig, arm: Arm, out: Path) -> TrainConfig:
    return TrainConfig(
        model="tiny-olmoe",
        model_overrides=cfg.model_overrides,
        method=arm.method,
        execution=Execution(compiler=cfg.compiler if arm.compiled else "eager", sonar_pass=arm.sonar_pass),
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        warmup=cfg.warmup,
        min_lr=cfg.min_lr,
        seed=cfg.seed,
        held_out=cfg.held_out,
        eval_every=max(1, cfg.steps // 2),
        dtype="fp32",  # CPU bf16 grouped GEMMs are 10-70x slower; the bitwise claim holds in both
        device="cpu",
        out=str(out / arm.key),
        overwrite=True,  # each demo run replaces the arm's previous run
        checkpoint=False,
        pad_to_max_len=True,  # every arm runs the same shapes, so the timings compare like with like
        deterministic=True,  # inductor's parallel CPU reductions would blur the bitwise comparison
        progress=cfg.progress,
    )


def _expert_weights(result: RunResult) -> dict[str, torch.Tensor]:
    return {
        t.name: t.param.detach().clone() for layer in discover_experts(result.model) for t in layer.tensors
    }


def _twin_verdict(
    a: str, b: str, weights: dict[str, dict[str, torch.Tensor]], errors: dict[str, str]
) -> dict[str, Any]:
    la, lb = _label(a), _label(b)
    if a not in weights or b not in weights:
        missing = ", ".join(_label(k) for k in (a, b) if k in errors)
        return {"arms": [a, b], "equal": None, "text": f"{la} vs {lb}: not compared ({missing} failed)"}
    wa, wb = weights[a], weights[b]
    same = [n for n in wa if torch.equal(wa[n], wb[n])]
    equal = len(same) == len(wa)
    if equal:
        verdict = f"BITWISE EQUAL ({len(wa)} of {len(wa)} expert tensors)"
    else:
        worst = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
        differ = len(wa) - len(same)
        verdict = f"NOT bitwise equal ({differ} of {len(wa)} expert tensors differ, max |diff| {worst:.3g})"
    return {"arms": [a, b], "equal": equal, "text": f"{la} vs {lb}: expert weights {verdict}"}


def _label(key: str) -> str:
    return next(arm.label for arm in ARMS if arm.key == key)


def _report(
    cfg: DemoConfig,
    summaries: dict[str, dict[str, Any]],
    errors: dict[str, str],
    verdicts: list,
    wall_s: float,
) -> dict[str, Any]:
    rows = [_row(cfg, arm, summaries, errors) for arm in ARMS if arm.key in cfg.arms]
    headers = ["arm", "compiler", "peak MiB", "vs standard", "step transient MiB", "step ms", "vs standard",
               "tokens/s", "held-out loss"]  # fmt: skip
    table = tabulate([r["cells"] for r in rows], headers=headers, disable_numparse=True)
    first = next(iter(summaries.values()), None)
    notes = [
        "peak MiB = weights + optimizer states + the step's transient peak (profiler allocator events, one "
        "step after warm-up); step ms = median after warm-up; tokens/s = median of supervised tokens/s.",
        "CPU timings are ratios within one run on a shared machine, not GPU claims (under torch.compile, "
        "fp32 expert layers run transformers' per-expert fallback loop instead of a grouped GEMM).",
    ]
    if first is not None:
        notes.append(f"data hash {first['data']['hash'][:16]} (every arm: {_same_hash(summaries)}).")
    return {
        "config": asdict(cfg),
        "model": {"name": "tiny-olmoe", "overrides": cfg.model_overrides},
        "table": table,
        "rows": [r["data"] for r in rows],
        "bitwise": verdicts,
        "errors": errors,
        "notes": notes,
        "wall_s": wall_s,
        "versions": first["versions"] if first else None,
        "hardware": first["hardware"] if first else None,
    }


def _row(
    cfg: DemoConfig, arm: Arm, summaries: dict[str, dict[str, Any]], errors: dict[str, str]
) -> dict[str, Any]:
    compiler = cfg.compiler if arm.compiled else "eager"
    if arm.key not in summaries:
        reason = errors.get(arm.key, "not run")
        return {"cells": [arm.label, compiler, f"failed: {reason[:60]}", *[""] * 6], "data": {"arm": arm.key}}
    s, base = summaries[arm.key], summaries.get(BASELINE)
    peak_mib = s["memory"]["peak_bytes"] / 2**20
    data = {
        "arm": arm.key, "label": arm.label, "method": arm.method, "compiler": s["config"]["compiler"],
        "sonar_pass": arm.sonar_pass, "peak_mib": peak_mib,
        "step_transient_mib": s["memory"]["step_transient_bytes"] / 2**20,
        "state_mib": s["memory"]["state_bytes"] / 2**20, "median_step_ms": s["median_step_ms"],
        "tokens_per_s": s["supervised_tokens_per_s"], "held_out_loss": s["held_out_loss"],
        "held_out_loss_initial": s["held_out_loss_initial"], "held_out_curve": s["held_out_curve"],
    }  # fmt: skip
    if base is not None:
        data["peak_change"] = peak_mib / (base["memory"]["peak_bytes"] / 2**20) - 1
        data["step_ms_change"] = s["median_step_ms"] / base["median_step_ms"] - 1
    cells = [
        arm.label, data["compiler"], f"{peak_mib:.1f}", _pct(data.get("peak_change")),
        f"{data['step_transient_mib']:.1f}", f"{s['median_step_ms']:.1f}", _pct(data.get("step_ms_change")),
        f"{s['supervised_tokens_per_s'] or 0:.0f}",
        f"{s['held_out_loss_initial']:.3f} -> {s['held_out_loss']:.4f}",
    ]  # fmt: skip
    return {"cells": cells, "data": data}


def _pct(change: float | None) -> str:
    return "" if change is None else f"{change * 100:+.1f}%"


def _same_hash(summaries: dict[str, dict[str, Any]]) -> str:
    hashes = {s["data"]["hash"] for s in summaries.values()}
    return "same data" if len(hashes) == 1 else f"{len(hashes)} DIFFERENT hashes"


def _unlearned(summaries: dict[str, dict[str, Any]], cfg: DemoConfig) -> list[str]:
    """Arms whose held-out loss did not fall clearly."""
    keep = 1 - cfg.min_loss_drop
    return [k for k, s in summaries.items() if not s["held_out_loss"] < keep * s["held_out_loss_initial"]]


def _chart(summaries: dict[str, dict[str, Any]], path: Path, cfg: DemoConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the PNG file
    import matplotlib.pyplot as plt

    arms = [arm for arm in ARMS if arm.key in summaries]
    labels = [arm.label.replace(", ", "\n") for arm in arms]
    state = [summaries[a.key]["memory"]["state_bytes"] / 2**20 for a in arms]
    transient = [summaries[a.key]["memory"]["step_transient_bytes"] / 2**20 for a in arms]
    fig, (ax_mem, ax_ms, ax_loss) = plt.subplots(1, 3, figsize=(18, 5.5))
    ax_mem.barh(labels, state, label="weights + optimizer states")
    ax_mem.barh(labels, transient, left=state, label="step transient peak")
    ax_mem.set_xlabel("MiB")
    ax_mem.set_title("Peak memory of a training step")
    ax_mem.legend(loc="lower right", fontsize=8)
    ax_mem.invert_yaxis()
    ax_ms.barh(labels, [summaries[a.key]["median_step_ms"] for a in arms], color="tab:gray")
    ax_ms.set_xlabel("median step ms (CPU)")
    ax_ms.set_title(f"Step time ({cfg.compiler} for compiled arms)")
    ax_ms.set_yticklabels([])
    ax_ms.invert_yaxis()
    for a in arms:
        curve = summaries[a.key]["held_out_curve"]
        ax_loss.plot([int(k) for k in curve], list(curve.values()), marker="o", label=a.label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("held-out loss")
    ax_loss.set_title("Held-out loss")
    ax_loss.legend(fontsize=8)
    shape = ", ".join(f"{k}={v}" for k, v in cfg.model_overrides.items())
    fig.suptitle(f"Sonar-MoE demo: tiny-olmoe ({shape}), fp32, batch {cfg.batch_size}, {cfg.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
