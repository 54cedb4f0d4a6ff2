"""Question (paper Table 8): what happens to Sonar's memory and time under gradient accumulation?

With A micro-batches per optimizer step, standard training keeps every expert gradient for the whole
step (accumulating into it), while Sonar (opted in with accumulation="per_microbatch") updates the
experts inside every micro-batch's backward: memory stays at one layer of gradients, but the experts
see A updates per step (a different optimizer: see the held-out loss) and the update cost is paid A
times. Measured for A in {1, 2, 4, 8}, micro-batch 2, eager (hooks) and compiled (pass).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchmarks import common
from benchmarks.arms import COMPILED, EAGER, Arm, ArmResult, Plan, by_label, run_arms
from benchmarks.common import Table, mib
from benchmarks.workload import SHAPES
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import fmt_ratio, ratio
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.workload import Batch, make_batches

SCRIPT = "accumulation"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shape: str = "olmoe-cpu"
    steps_of: tuple[int, ...] = (1, 2, 4, 8)
    """A: micro-batches per optimizer step."""
    micro_batch: int = 2
    seq: int = 64
    dtype: str = "bfloat16"
    plan: Plan = field(default_factory=lambda: Plan(warmup=1, rounds=5, held_out_batches=2))
    executions: tuple[Execution, ...] = (EAGER, COMPILED)
    """Eager (Sonar by hooks) and compiled (Sonar's pass), each against standard in the same execution."""
    lr: float = 1e-3


QUICK = Config(steps_of=(1, 4), plan=Plan(warmup=1, rounds=3, held_out_batches=1))


def arms_for(cfg: Config, a: int) -> list[Arm]:
    acc = "per_microbatch" if a > 1 else None
    arms = []
    for ex in cfg.executions:
        arms += [Arm(method="standard", execution=ex), Arm(method="sonar", execution=ex, accumulation=acc)]
    return arms


def accumulated_step(method: TrainingMethod, micro_batches: Sequence[Batch]) -> None:
    """One optimizer step over A micro-batches; the loss is averaged, as accumulation should."""
    for b in micro_batches:
        (method.model(**b).loss / len(micro_batches)).backward()
    method.optimizer_step()


def run(cfg: Config) -> tuple[list[list[str]], list[dict]]:
    import torch

    shape = SHAPES[cfg.shape]
    rows, records = [], []
    for a in cfg.steps_of:
        print(f"{shape.describe()}, A={a} x micro-batch {cfg.micro_batch} x seq {cfg.seq}", flush=True)
        n = cfg.plan.warmup + 1 + cfg.plan.rounds
        flat = make_batches(n * a, cfg.micro_batch, cfg.seq)
        grouped = [flat[i * a : (i + 1) * a] for i in range(n)]
        held_out = make_batches(cfg.plan.held_out_batches, cfg.micro_batch, cfg.seq, held_out=True)
        with warnings.catch_warnings():
            # The per-micro-batch semantics are what this script measures; the warning is for users.
            warnings.filterwarnings("ignore", message="accumulation='per_microbatch'")
            results = run_arms(
                lambda: shape.build(getattr(torch, cfg.dtype)), arms_for(cfg, a), AdamWConfig(lr=cfg.lr),
                cfg.plan, grouped, held_out, step=accumulated_step,
            )  # fmt: skip
        rows += _rows(a, cfg, results)
        records += [{"A": a, **asdict(r)} for r in results]
    return rows, records


def _rows(a: int, cfg: Config, results: list[ArmResult]) -> list[list[str]]:
    named = by_label(results)
    rows = []
    for r in results:
        base = named.get(r.arm.baseline().label)
        if not r.ok or base is None or not base.ok:
            rows.append([str(a), r.label, f"failed: {r.error or 'baseline failed'}", *["-"] * 6])
            continue
        tokens = a * cfg.micro_batch * cfg.seq
        calls = "-" if r.update_calls_per_step is None else str(r.update_calls_per_step)
        change = r.peak_bytes / base.peak_bytes - 1
        rows.append(
            [
                str(a), r.label, f"{mib(r.peak_bytes):.1f}", f"{100 * change:+.1f}%", r.step_ms.fmt(0),
                fmt_ratio(ratio(r, base)), f"{tokens / (r.step_ms.median / 1e3):.0f}", calls,
                f"{r.held_out_loss - base.held_out_loss:+.4f}",
            ]
        )  # fmt: skip
    return rows


def table(rows: list[list[str]]) -> Table:
    headers = [
        "A", "arm", "peak MiB", "Δ peak", "step ms", "× standard", "tokens/s", "expert updates/step",
        "Δ held-out loss",
    ]  # fmt: skip
    note = (
        "One step = A micro-batches (batch 2, seq 64) and one optimizer step; the peak covers all of it. "
        "Δ and × vs standard in the same execution; × is the median of paired per-round ratios [IQR]."
    )
    return Table(title="Gradient accumulation", headers=headers, rows=rows, note=note)


def main(argv: list[str] | None = None) -> None:
    shape = common.Override(field="shape", choices=sorted(SHAPES), help="override the model shape")
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[shape])
    rows, records = run(inv.cfg)
    inv.finish([table(rows)], records=records)


if __name__ == "__main__":
    main()
