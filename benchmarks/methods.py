"""Question (paper Table 1): what does each training method cost in memory and time, eager and compiled?

Every method (standard, standard_no_expert_clip, oib_all, sonar, sonar_per_expert, and the hand-written
expert hooks of PyTorch's tutorial as the eager hooks' equal-work reference) runs on CPU models
shaped like OLMoE (E=64, top-8) and Granite (E=40, top-8), bf16, batch 2, in three execution modes:
the eager model (Sonar and oib_all by post-accumulate-grad hooks), the torch.compile'd model with the
same hooks (they fire only after the whole compiled backward, so Sonar's saving is expected to vanish)
and the compiled pass (updates inside the backward graph; the compiled standard arms are its
baseline). Reported: peak step memory and its change, measured vs predicted saving, median step time
and its paired ratio vs standard, tokens/s and held-out loss after the same steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial

from benchmarks import common
from benchmarks.arms import (
    COMPILED,
    EAGER,
    HOOKS_ON_COMPILED,
    Arm,
    ArmResult,
    HandwrittenHooksArm,
    Plan,
    by_label,
    run_arms,
)
from benchmarks.common import Goal, Table, grade, mib
from benchmarks.handwritten import METHOD as HANDWRITTEN
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.measure import Spread, fmt_ratio, ratio
from sonar_fx.methods import METHODS, Execution, Method
from sonar_fx.workload import make_batches

SCRIPT = "methods"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    shapes: tuple[str, ...] = ("olmoe-cpu", "granite-cpu")
    """Keys of `benchmarks.workload.SHAPES`."""
    workload: Workload = field(default_factory=Workload)
    plan: Plan = field(default_factory=lambda: Plan(warmup=2, rounds=20))
    methods: tuple[str, ...] = METHODS
    executions: tuple[Execution, ...] = (EAGER, HOOKS_ON_COMPILED, COMPILED)
    """Eager (Sonar by hooks), compiled with Sonar's hooks, compiled with the pass; methods other than
    Sonar run compiled once, whichever of the compiled executions comes first."""
    lr: float = 1e-3
    """Large enough that a randomly initialised model learns visibly in a dozen steps."""
    max_grad_norm: float = 1.0
    """Active on these models (their gradient norm is above it), so the clipping variants differ."""


QUICK = Config(shapes=("olmoe-cpu",), plan=Plan(warmup=1, rounds=4, held_out_batches=2))


def arms_for(cfg: Config) -> list[Arm]:
    arms: dict[str, Arm] = {}
    for execution in cfg.executions:
        for method in cfg.methods:
            # Hooks vs pass is Sonar's choice; every other method has one compiled arm.
            plain = Execution(compiler=execution.compiler)
            arm = Arm(method=method, execution=execution if Method.named(method).sonar else plain)
            arms.setdefault(arm.label, arm)
        if not execution.compiled and "sonar" in cfg.methods:
            reference = HandwrittenHooksArm()  # Sonar's eager hooks' equal-work reference
            arms.setdefault(reference.label, reference)
    return list(arms.values())


def run(cfg: Config) -> tuple[list[Table], list[Goal], list[dict]]:
    opt = AdamWConfig(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
    w = cfg.workload
    tables, goals, records = [], [], []
    for shape_name in cfg.shapes:
        shape = SHAPES[shape_name]
        print(f"{shape.describe()}, batch {w.batch} x seq {w.seq}, {w.dtype}", flush=True)
        n = cfg.plan.warmup + 1 + cfg.plan.rounds
        batches = make_batches(n, w.batch, w.seq)
        held_out = make_batches(cfg.plan.held_out_batches, w.batch, w.seq, held_out=True)
        build = partial(shape.build, w.torch_dtype)
        results = run_arms(build, arms_for(cfg), opt, cfg.plan, batches, held_out)
        tables.append(table(shape.describe(), results, w))
        goals += shape_goals(shape.name, results)
        records += [{"shape": shape.name, **asdict(r)} for r in results]
    return tables, goals, records


def table(title: str, results: list[ArmResult], w: Workload) -> Table:
    named = by_label(results)
    rows = []
    for r in results:
        base = named.get(r.arm.baseline().label)
        if not r.ok:
            rows.append([r.label, f"failed: {r.error}", *["-"] * 10])
        elif base is None or not base.ok:
            rows.append([r.label, f"{mib(r.peak_bytes):.1f}", *["-"] * 3, r.step_ms.fmt(0), *["-"] * 5])
        else:
            rows.append(_row(r, base, w))
    headers = [
        "arm", "peak MiB", "Δ peak", "total MiB (Δ)", "saved / predicted MiB", "step ms", "× standard",
        "tokens/s", "held-out loss", "Δ loss", "expert update calls/step",
    ]  # fmt: skip
    note = (
        "Peak: transient bytes of one train step after warm-up (profiler allocator events); total adds "
        "the weights and optimizer state (the paper's peaks include them). Δ and × are vs standard "
        "(global clip) in the same execution: eager for eager arms, compiled for compiled ones; × is the "
        "median of per-round paired ratios [IQR]. step ms: median [IQR]. saved/predicted: (standard "
        "peak - arm peak) / (all expert-gradient bytes - one layer's)."
    )
    return Table(title=title, headers=headers, rows=rows, note=note)


def _row(r: ArmResult, base: ArmResult, w: Workload) -> list[str]:
    return [
        r.label,
        f"{mib(r.peak_bytes):.1f}",
        f"{100 * (r.peak_bytes / base.peak_bytes - 1):+.1f}%",
        _total(r, base),
        _saved_fraction(r, base),
        r.step_ms.fmt(0),
        fmt_ratio(ratio(r, base)),
        f"{w.tokens / (r.step_ms.median / 1e3):.0f}",
        f"{r.held_out_loss:.4f}",
        f"{r.held_out_loss - base.held_out_loss:+.4f}",
        _updates(r),
    ]


def _total(r: ArmResult, base: ArmResult) -> str:
    total, base_total = r.resident_bytes + r.peak_bytes, base.resident_bytes + base.peak_bytes
    return f"{mib(total):.0f} ({100 * (total / base_total - 1):+.1f}%)"


def _saved_fraction(r: ArmResult, base: ArmResult | None) -> str:
    if base is None or not base.ok or r is base or not r.predicted_saving_bytes:
        return "-"
    saved, predicted = base.peak_bytes - r.peak_bytes, r.predicted_saving_bytes
    return f"{mib(saved):.1f} / {mib(predicted):.1f} ({saved / predicted:.0%})"


def _updates(r: ArmResult) -> str:
    if r.update_calls_per_step is None:
        return "-"
    paths = ", ".join(f"{n} tensors by {p}" for p, n in sorted(r.update_paths.items()))
    return f"{r.update_calls_per_step} ({paths})" + (" FALLBACK" if r.fallbacks else "")


def shape_goals(shape: str, results: list[ArmResult]) -> list[Goal]:
    a = by_label(results)
    std_e, std_c = a.get("standard · eager"), a.get("standard · compiled")
    nec_c = a.get("standard_no_expert_clip · compiled")
    sonar_e, sonar_h, sonar_p = (
        a.get("sonar · eager hooks"),
        a.get("sonar · compiled + hooks"),
        a.get("sonar · compiled pass"),
    )
    goals = [
        _saving_goal(f"{shape}: memory saved, eager hooks", sonar_e, std_e),
        _saving_goal(f"{shape}: memory saved, compiled pass", sonar_p, std_c),
        _time_goal(f"{shape}: compiled pass vs compiled standard", ratio(sonar_p, std_c), 0.85),
        _time_goal(
            f"{shape}: compiled pass vs compiled standard_no_expert_clip", ratio(sonar_p, nec_c), 0.97
        ),
        _time_goal(
            f"{shape}: eager hooks vs hand-written expert hooks",
            ratio(sonar_e, a.get(f"{HANDWRITTEN} · eager hooks")),
            1.0,
        ),
        _time_goal(f"{shape}: compiled pass vs sonar eager hooks", ratio(sonar_p, sonar_e), 0.9),
    ]
    hooks = _fraction(sonar_h, std_c)
    goals.append(
        Goal(
            name=f"{shape}: hooks on a compiled model lose the saving (the pass keeps it)",
            target="hooks < 50%, pass >= 95% of predicted",
            measured=f"hooks {_pct(hooks)}, pass {_pct(_fraction(sonar_p, std_c))}",
            status=grade(hooks, 0.5, "<"),
        )
    )
    for mode, label in (("eager", "eager hooks"), ("pass", "compiled pass")):
        per = ratio(a.get(f"sonar_per_expert · {label}"), a.get(f"sonar · {label}"))
        goals.append(
            Goal(
                name=f"{shape}: per-expert slower than batched, {mode}",
                target="> 1.00x",
                measured=fmt_ratio(per),
                status=grade(per, 1.0, ">"),
            )
        )
    return goals


def _fraction(r: ArmResult | None, base: ArmResult | None) -> float | None:
    if r is None or base is None or not (r.ok and base.ok) or not r.predicted_saving_bytes:
        return None
    return (base.peak_bytes - r.peak_bytes) / r.predicted_saving_bytes


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0%}"


def _saving_goal(name: str, r: ArmResult | None, base: ArmResult | None) -> Goal:
    f = _fraction(r, base)
    return Goal(name=name, target=">= 95% of predicted", measured=_pct(f), status=grade(f, 0.95, ">="))


def _time_goal(name: str, spread: Spread | None, limit: float) -> Goal:
    status = grade(spread, limit, "<=")
    return Goal(name=name, target=f"<= {limit:.2f}x", measured=fmt_ratio(spread), status=status)


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
