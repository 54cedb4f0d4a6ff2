"""Question (paper Table 8, and the deferred schedule): what do accumulation and the clip scope cost?

With A micro-batches per optimizer step, standard training keeps every expert gradient for the whole
step. Two ways for Sonar, each against standard training with the same clip in the same execution:
- accumulation="per_microbatch" (in-backward schedule): memory stays at one layer of gradients, but the
  experts see A updates per step (a different optimizer: see the held-out loss);
- schedule="deferred": operands kept in backward, each expert gradient computed at step(): exact
  standard semantics (one update per step, and with clip scope "all" one global norm over every
  parameter), at the memory of one expert gradient plus the kept operands.
Clip scope "dense" compares with standard_no_expert_clip, "all" with standard (global clip); under
"all" at A=1 the in-backward schedule's exact route (expert_clip="global": forward and backward
twice) runs too. Measured for A in {1, 4, 8}, micro-batch 2, eager and compiled, 15 timed rounds.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchmarks import common
from benchmarks.arms import COMPILED, EAGER, Arm, ArmResult, Plan, by_label, run_arms
from benchmarks.common import Goal, Table, grade, mib
from benchmarks.workload import SHAPES
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import Spread, fmt_ratio, ratio
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.workload import Batch, make_batches

SCRIPT = "accumulation"
BASELINE = {"dense": "standard_no_expert_clip", "all": "standard"}


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    steps_of: tuple[int, ...] = (1, 4, 8)
    """A: micro-batches per optimizer step."""
    clips: tuple[str, ...] = ("dense", "all")
    """Clip scopes: one global norm over the dense gradients, or over every gradient."""
    micro_batch: int = 2
    seq: int = 64
    dtype: str = "bfloat16"
    plan: Plan = field(default_factory=lambda: Plan(warmup=1, rounds=15, held_out_batches=2))
    executions: tuple[Execution, ...] = (EAGER, COMPILED)
    """Eager and compiled (Sonar's pass), each against standard in the same execution."""
    lr: float = 1e-3


QUICK = Config(steps_of=(1, 4), plan=Plan(warmup=1, rounds=3, held_out_batches=1))


def arms_for(cfg: Config, a: int, clip: str) -> list[Arm]:
    arms = []
    for ex in cfg.executions:
        arms += [Arm(method=BASELINE[clip], execution=ex), Arm(method="sonar_deferred", execution=ex)]
        if clip == "dense":
            arms.append(Arm(method="sonar", execution=ex, accumulation="per_microbatch" if a > 1 else None))
        elif a == 1:  # expert_clip="global" in backward: two passes, and no accumulation
            arms.append(Arm(method="sonar", execution=ex))
    return arms


def accumulated_step(method: TrainingMethod, micro_batches: Sequence[Batch]) -> None:
    """One optimizer step over A micro-batches; the loss is averaged, as accumulation should."""
    if len(micro_batches) == 1:
        method.train_step(micro_batches[0])  # expert_clip="global" in backward takes a closure
        return
    for b in micro_batches:
        (method.model(**b).loss / len(micro_batches)).backward()
    method.optimizer_step()


def run(cfg: Config) -> tuple[list[list[str]], list[dict]]:
    import torch

    shape = SHAPES[cfg.shape]
    rows, records = [], []
    for clip in cfg.clips:
        opt_cfg = AdamWConfig(lr=cfg.lr, max_grad_norm=1.0, expert_clip="global" if clip == "all" else None)
        for a in cfg.steps_of:
            print(f"{shape.describe()}, clip {clip}, A={a} x micro-batch {cfg.micro_batch} x seq {cfg.seq}")
            n = cfg.plan.warmup + 1 + cfg.plan.rounds
            flat = make_batches(n * a, cfg.micro_batch, cfg.seq)
            grouped = [flat[i * a : (i + 1) * a] for i in range(n)]
            held_out = make_batches(cfg.plan.held_out_batches, cfg.micro_batch, cfg.seq, held_out=True)
            with warnings.catch_warnings():
                # The per-micro-batch semantics are what this script measures; the warning is for users.
                warnings.filterwarnings("ignore", message="accumulation='per_microbatch'")
                results = run_arms(
                    lambda: shape.build(getattr(torch, cfg.dtype)), arms_for(cfg, a, clip), opt_cfg,
                    cfg.plan, grouped, held_out, step=accumulated_step,
                )  # fmt: skip
            rows += _rows(a, clip, cfg, results)
            records += [{"A": a, "clip": clip, **asdict(r)} for r in results]
    return rows, records


def baseline_of(r: ArmResult, named: dict[str, ArmResult], clip: str) -> ArmResult | None:
    return named.get(Arm(method=BASELINE[clip], execution=r.arm.execution).label)


def expected_saving(r: ArmResult) -> int:
    """What Sonar should save against its baseline: all expert-gradient bytes but one layer's, less the
    deferred schedule's kept operands."""
    return r.predicted_saving_bytes - (r.kept_operand_bytes or 0)


def _rows(a: int, clip: str, cfg: Config, results: list[ArmResult]) -> list[list[str]]:
    named = by_label(results)
    rows = []
    for r in results:
        base = baseline_of(r, named, clip)
        if not r.ok or base is None or not base.ok:
            rows.append([str(a), clip, r.label, f"failed: {r.error or 'baseline failed'}", *["-"] * 7])
            continue
        tokens = a * cfg.micro_batch * cfg.seq
        calls = "-" if r.update_calls_per_step is None else str(r.update_calls_per_step)
        saved = base.peak_bytes - r.peak_bytes
        is_base = r is base
        rows.append(
            [
                str(a), clip, r.label, f"{mib(r.peak_bytes):.1f}",
                "-" if is_base else f"{mib(saved):.1f} / {mib(expected_saving(r)):.1f}",
                "-" if r.kept_operand_bytes is None else f"{mib(r.kept_operand_bytes):.2f}",
                r.step_ms.fmt(0), fmt_ratio(ratio(r, base)), f"{tokens / (r.step_ms.median / 1e3):.0f}",
                calls, f"{r.held_out_loss - base.held_out_loss:+.4f}",
            ]
        )  # fmt: skip
    return rows


def table(rows: list[list[str]]) -> Table:
    headers = [
        "A", "clip", "arm", "peak MiB", "saved / expected MiB", "kept operands MiB", "step ms",
        "× baseline", "tokens/s", "expert updates/step", "Δ held-out loss",
    ]  # fmt: skip
    note = (
        "One step = A micro-batches (batch 2, seq 64) and one optimizer step; the peak is the step's "
        "transient (weights and optimizer states excluded). The baseline is standard training with the "
        "same clip in the same execution (clip dense: standard_no_expert_clip; all: standard). Expected "
        "saving: all expert-gradient bytes but one layer's, less the kept operands. × is the median of "
        "paired per-round ratios [IQR]."
    )
    return Table(title="Gradient accumulation and clip scope", headers=headers, rows=rows, note=note)


def goals(records: list[dict]) -> list[Goal]:
    """The deferred schedule's targets (issue: memory >= 90% of expected at A=4; time: all-parameter
    clip <= 1.10x standard at A=1 and A=4, dense clip at A=4 <= 1.03x standard accumulation)."""
    out = []
    for ex, base_ex in (("eager", "eager"), ("compiled pass", "compiled")):
        for clip, a, limit in (("all", 1, 1.10), ("dense", 4, 1.03), ("all", 4, 1.10)):
            r = _find(records, a, clip, f"sonar_deferred · {ex}")
            base = _find(records, a, clip, f"{BASELINE[clip]} · {base_ex}")
            spread = _spread(r, base)
            out.append(
                Goal(
                    name=f"deferred, clip {clip}, A={a}, {ex}: time vs {BASELINE[clip]}",
                    target=f"<= {limit:.2f}x",
                    measured=fmt_ratio(spread),
                    status=grade(spread, limit, "<="),
                )
            )
            if a == 4:
                frac = None
                if r and base and r["predicted_saving_bytes"]:
                    frac = (base["peak_bytes"] - r["peak_bytes"]) / (
                        r["predicted_saving_bytes"] - (r["kept_operand_bytes"] or 0)
                    )
                out.append(
                    Goal(
                        name=f"deferred, clip {clip}, A=4, {ex}: memory saved",
                        target=">= 90% of expected",
                        measured="-" if frac is None else f"{frac:.0%}",
                        status=grade(frac, 0.9, ">="),
                    )
                )
    return out


def _find(records: list[dict], a: int, clip: str, label: str) -> dict | None:
    hit = [r for r in records if r["A"] == a and r["clip"] == clip and r["label"] == label]
    return hit[0] if hit and hit[0].get("error") is None else None


def _spread(r: dict | None, base: dict | None) -> Spread | None:
    if r is None or base is None or len(r["step_s"]) != len(base["step_s"]):
        return None
    from sonar_fx.measure import paired_ratio

    return paired_ratio(r["step_s"], base["step_s"])


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    clips = common.Override(field="clips", choices=["dense", "all"], many=True, help="clip scopes to run")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape, clips])
    rows, records = run(inv.cfg)
    found = goals(records)
    inv.finish([table(rows), common.goals_table(found)], goals=found, records=records)


if __name__ == "__main__":
    main()
