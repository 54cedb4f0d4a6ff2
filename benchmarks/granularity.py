"""Question (paper Table 3): what do per-expert updates (2EL kernel calls) cost against batched ones (2L)?

Both granularities keep at most one layer of expert gradients alive, so memory should match; the
per-expert ablation launches E times more fused-AdamW calls on slices of the batched tensors. Measured
on the OLMoE- and Granite-shaped CPU models, with eager hooks and with the compiled pass, beside
standard_no_expert_clip (Sonar's exact twin without in-backward updates) for scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial

from benchmarks import common
from benchmarks.arms import COMPILED, EAGER, Arm, ArmResult, Plan, by_label, run_arms
from benchmarks.common import Goal, Table, grade, mib
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import fmt_ratio, ratio
from sonar_fx.methods import Execution
from sonar_fx.workload import make_batches

SCRIPT = "granularity"
ROWS = (("standard_no_expert_clip", "-"), ("sonar", "batched"), ("sonar_per_expert", "per expert"))
"""(method, granularity column) of each table row, per execution."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shapes: tuple[str, ...] = ("olmoe-cpu", "granite-cpu")
    workload: Workload = field(default_factory=Workload)
    plan: Plan = field(default_factory=lambda: Plan(warmup=2, rounds=10, held_out_batches=1))
    executions: tuple[Execution, ...] = (EAGER, COMPILED)
    """Eager (Sonar by hooks) and/or compiled (Sonar's pass)."""
    lr: float = 1e-3


QUICK = Config(shapes=("olmoe-cpu",), plan=Plan(warmup=1, rounds=4, held_out_batches=1))


def arms_for(cfg: Config) -> list[Arm]:
    return [Arm(method=method, execution=execution) for execution in cfg.executions for method, _ in ROWS]


def run(cfg: Config) -> tuple[list[Table], list[Goal], list[dict]]:
    w = cfg.workload
    rows, goals, records = [], [], []
    for name in cfg.shapes:
        shape = SHAPES[name]
        print(f"{shape.describe()}, batch {w.batch} x seq {w.seq}", flush=True)
        batches = make_batches(cfg.plan.warmup + 1 + cfg.plan.rounds, w.batch, w.seq)
        held_out = make_batches(cfg.plan.held_out_batches, w.batch, w.seq, held_out=True)
        results = run_arms(
            partial(shape.build, w.torch_dtype),
            arms_for(cfg), AdamWConfig(lr=cfg.lr), cfg.plan, batches, held_out,
        )  # fmt: skip
        for execution in cfg.executions:
            rows += _rows(name, execution, results)
            goals.append(_goal(name, execution, results))
        records += [{"shape": name, **asdict(r)} for r in results]
    headers = [
        "shape", "execution", "granularity", "update calls/step", "peak MiB", "step ms", "× batched",
        "× no_expert_clip",
    ]  # fmt: skip
    note = (
        "update calls: fused-AdamW launches on expert tensors per step (2L batched, 2EL per expert). "
        "× columns: median of per-round paired step-time ratios [IQR]; step ms: median [IQR]."
    )
    return (
        [Table(title="Batched vs per-expert updates", headers=headers, rows=rows, note=note)],
        goals,
        records,
    )


def _rows(shape: str, execution: Execution, results: list[ArmResult]) -> list[list[str]]:
    a = by_label(results)
    arms = {method: Arm(method=method, execution=execution) for method, _ in ROWS}
    batched, twin = a.get(arms["sonar"].label), a.get(arms["standard_no_expert_clip"].label)
    rows = []
    for method, gran in ROWS:
        r, how = a.get(arms[method].label), _how(arms[method])
        if r is None or not r.ok:
            rows.append([shape, how, gran, f"failed: {r.error if r else 'missing'}", *["-"] * 4])
            continue
        calls = "-" if r.update_calls_per_step is None else str(r.update_calls_per_step)
        rows.append(
            [
                shape, how, gran, calls, f"{mib(r.peak_bytes):.1f}", r.step_ms.fmt(0),
                fmt_ratio(ratio(r, batched)), fmt_ratio(ratio(r, twin)),
            ]
        )  # fmt: skip
    return rows


def _how(arm: Arm) -> str:
    """The execution column: the arm's label without its method ("eager hooks", "compiled pass")."""
    return arm.label.split(" · ", 1)[1]


def _goal(shape: str, execution: Execution, results: list[ArmResult]) -> Goal:
    a = by_label(results)
    sonar, per_expert = (Arm(method=m, execution=execution) for m in ("sonar", "sonar_per_expert"))
    per = ratio(a.get(per_expert.label), a.get(sonar.label))
    return Goal(
        name=f"{shape}: per-expert slower than batched, {_how(sonar)}",
        target="> 1.00x (paper, GPU: +20% OLMoE, +72% Granite)",
        measured=fmt_ratio(per),
        status=grade(per, 1.0, ">"),
    )


def main(argv: list[str] | None = None) -> None:
    overrides = [
        common.Override(field="shapes", choices=sorted(SHAPES), help="override the model shapes", many=True),
        common.Override(
            field="executions",
            choices=[e.label for e in Config().executions],
            many=True,
            help="override the executions",
            parse=Execution.from_label,
        ),
    ]
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=overrides)
    tables, goals, records = run(inv.cfg)
    inv.finish(tables, goals=goals, records=records)


if __name__ == "__main__":
    main()
