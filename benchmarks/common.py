"""The benchmark harness: environment header, grading, tables, results I/O and the command line.

Every script states the hardware, the torch version and the load of the machine it ran on, reports a
spread (median, quartiles: `sonar_fx.measure.Spread`) for every timing, prints its tables with tabulate
and writes them, with the raw measurements, to `results/<script>/results.json`, from which
`benchmarks.readme` regenerates the docs. This module never builds models, trains or measures; see
`workload`, `arms` and `sonar_fx.measure`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import operator
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from tabulate import tabulate

from benchmarks.goals import GOALS, Want
from sonar_fx.environment import Environment
from sonar_fx.measure import SIDE_BY_SIDE, Spread, fmt_ratio

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RESULTS_DIR = Path("results")
C = TypeVar("C", bound="DataclassInstance")
"""A script's frozen `Config` dataclass."""
Draw = Callable[[Any], Any]
"""`draw(pyplot)` returns a matplotlib figure."""


@dataclass(frozen=True, kw_only=True)
class Table:
    """One printed and stored table: every cell is already formatted from a measurement."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""
    """What the columns mean, shown under the table."""

    def render(self, fmt: str = "simple") -> str:
        return tabulate(self.rows, headers=self.headers, tablefmt=fmt, disable_numparse=True)


def failed(cells: Sequence[Any], error: str | None, width: int) -> list[str]:
    """A row of `width` cells for an arm that did not measure: `cells`, its error, then dashes."""
    return [*map(str, cells), f"failed: {error}", *["-"] * (width - len(cells) - 1)]


def mib(nbytes: float) -> float:
    return nbytes / 2**20


_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}  # fmt: skip
NOT_MEASURED = "not measured"
GOALS_NOTE = (
    "A timing goal is graded on the interquartile range of its repeated measurement: met or MISSED only "
    "when the whole range lies on one side of the goal, otherwise noise (the range is shown)."
)


def grade(measured: Spread | float | None, goal: float, want: Want) -> str:
    """The one grading rule of every benchmark: "met", "MISSED", "noise (IQR a-b)" or "not measured".

    A repeated measurement (a `Spread`, e.g. a paired time ratio) is graded only when the run's noise
    allows it: "met" when its whole interquartile range satisfies `want goal`, "MISSED" when none of
    it does, and otherwise "noise" with the range, since on a loaded shared host the median alone
    would grade the load rather than the code. A single value (bytes, a count, a fraction of bytes)
    is exact and graded as it is. None (the arm failed or did not run) is "not measured".
    """
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return NOT_MEASURED
    ok = _COMPARE[want]
    if not isinstance(measured, Spread):
        return "met" if ok(measured, goal) else "MISSED"
    q25, q75 = measured.q25, measured.q75
    if ok(q25, goal) and ok(q75, goal):
        return "met"
    if not ok(q25, goal) and not ok(q75, goal):
        return "MISSED"
    return f"noise (IQR {q25:.3g}-{q75:.3g})"


def worst(*statuses: str) -> str:
    """A goal made of several grades (a band with two ends): MISSED over noise over not measured."""
    for prefix in ("MISSED", "noise", NOT_MEASURED):
        for s in statuses:
            if s.startswith(prefix):
                return s
    return "met"


@dataclass(frozen=True, kw_only=True)
class Goal:
    """A target, measured (never asserted: timings belong in benchmarks, not tests)."""

    name: str
    target: str
    measured: str
    status: str
    """`grade`'s verdict: "met", "MISSED", "noise (IQR a-b)" or "not measured"."""

    @property
    def met(self) -> bool | None:
        """True or False when graded; None when not measured or within the noise."""
        return {"met": True, "MISSED": False}.get(self.status)


def goal(key: str, name: str, measured: Spread | float | None, shown: str | None = None) -> Goal:
    """The goal `key` of `benchmarks.goals`, graded by `grade`: `shown` is the measured cell (default: a
    Spread as a time ratio, a number to 3 digits, "-" when not measured)."""
    t = GOALS[key]
    if shown is None:
        shown = fmt_ratio(measured) if measured is None or isinstance(measured, Spread) else f"{measured:.3g}"
    return Goal(name=name, target=t.target, measured=shown, status=grade(measured, t.threshold, t.want))


def goal_status(goal: dict[str, Any]) -> str:
    """A stored goal's status cell (results written before `status` existed carry `met`)."""
    if "status" in goal:
        return goal["status"]
    return {True: "met", False: "MISSED", None: NOT_MEASURED}[goal.get("met")]


def goals_table(goals: Sequence[Goal]) -> Table:
    rows = [[g.name, g.target, g.measured, g.status] for g in goals]
    return Table(title="Goals", headers=["goal", "target", "measured", "status"], rows=rows, note=GOALS_NOTE)


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything a script writes to results/<script>/results.json."""

    script: str
    command: str
    """The command line that produced this file, shown beside its tables in the docs."""
    env: Environment
    config: dict[str, Any]
    tables: list[Table]
    goals: list[Goal] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    """Raw measurements (per-step times, byte counts) for anyone recomputing the tables."""
    images: list[str] = field(default_factory=list)
    """PNG files written beside results.json (names relative to it)."""
    load_avg_end: tuple[float, float, float] | None = None
    """The host's 1/5/15-minute load when the run finished (`env.load_avg` is at its start): with the
    processor (`env.host`) it says how far the run's timings can be trusted."""


def emit(report: Report, out_dir: Path) -> Path:
    """Print the report's tables (its goals last) and write results.json; returns its path."""
    end = "" if report.load_avg_end is None else ", load at the end " + _load(report.load_avg_end)
    print(f"\n# {report.script}: {report.command}\n# {report.env.line()}{end}")
    for table in [*report.tables, *([goals_table(report.goals)] if report.goals else [])]:
        print(f"\n## {table.title}\n{table.render()}" + (f"\n{table.note}" if table.note else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(dataclasses.asdict(report), indent=1, default=_jsonable) + "\n")
    print(f"\nwrote {path}" + "".join(f", {out_dir / name}" for name in report.images))
    return path


def _load(load_avg: Sequence[float]) -> str:
    return "/".join(f"{x:.1f}" for x in load_avg)


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def load_reports(results_dir: Path) -> dict[str, dict[str, Any]]:
    """results/<script>/results.json files by script name, as plain dicts."""
    found = {}
    for path in sorted(results_dir.glob("*/results.json")):
        data = json.loads(path.read_text())
        found[data.get("script", path.parent.name)] = data
    return found


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every script shares: --quick, --out, --threads (`module`: "benchmarks.methods")."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (fewer steps and configurations)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: results)")
    threads = "torch intra-op threads (default: torch's). On a shared machine 1 keeps timings stable."
    p.add_argument("--threads", type=int, default=None, help=threads)
    return p


def setup(args: argparse.Namespace) -> None:
    """Process-wide settings every script needs before it builds anything."""
    if args.threads:
        torch.set_num_threads(args.threads)
    # transformers' grouped_mm dispatch calls an lru_cache'd version check under dynamo: benign, and
    # repeated for every compiled arm it would bury the tables.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    # Several compiled arms of one model class live side by side, for the whole process (scripts that
    # do not wrap their arms in `side_by_side` too).
    for name, value in SIDE_BY_SIDE.items():
        setattr(torch._dynamo.config, name, value)


def command(module: str, argv: Sequence[str] | None = None) -> str:
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


@dataclass(frozen=True, kw_only=True)
class Override:
    """A script's own flag that, when given, replaces one field of its Config (`--shape` -> `shape`)."""

    field: str
    choices: Sequence[str]
    help: str
    many: bool = False
    """Takes one or more values (nargs="+"), stored as a tuple."""
    parse: Callable[[str], Any] = str
    """Turns a chosen value into the field's (`Execution.from_label` for executions)."""

    def add_to(self, p: argparse.ArgumentParser) -> None:
        p.add_argument(
            f"--{self.field}", nargs="+" if self.many else None, choices=self.choices, help=self.help
        )

    def apply(self, cfg: C, args: argparse.Namespace) -> C:
        value = getattr(args, self.field)
        if not value:
            return cfg
        if not hasattr(cfg, self.field):
            raise SystemExit(f"--{self.field} does not apply to this run (its Config has no {self.field})")
        parsed = tuple(map(self.parse, value)) if self.many else self.parse(value)
        return dataclasses.replace(cfg, **{self.field: parsed})


@dataclass(frozen=True, kw_only=True)
class Output:
    """What one run found: its tables, goals, raw records and pictures."""

    tables: list[Table]
    goals: list[Goal] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    figures: Mapping[str, Draw] = field(default_factory=dict)
    """PNG name -> how to draw it (skipped without matplotlib)."""
    script: str | None = None
    """The results name when it is not the invocation's (a partial run: `optimizers_muon`)."""


@dataclass(frozen=True, kw_only=True)
class Mode:
    """An option of a script that answers a neighbouring question (`--batch-sweep` of `methods`), with its
    own Config, run and results folder."""

    flag: str
    script: str
    """Its results name (results/<script>/, the docs' markers)."""
    question: str
    """Shown above its tables in the docs (the script's own question is its docstring's first line)."""
    default: Any
    quick: Any
    run: Callable[[Any], Output]


@dataclass(frozen=True, kw_only=True)
class Invocation(Generic[C]):
    """One command-line run of a script: its options, its Config and the environment it started in."""

    script: str
    """Report name and results sub-folder (`gpu` writes `gpu_smoke` for its smoke mode)."""
    command: str
    args: argparse.Namespace
    cfg: C
    env: Environment

    @property
    def out(self) -> Path:
        return self.args.out / self.script

    def finish(
        self,
        tables: Sequence[Table],
        *,
        goals: Sequence[Goal] = (),
        records: Sequence[dict[str, Any]] = (),
        images: Sequence[str] = (),
    ) -> Path:
        """Print the tables and write results.json (config, environment and command included)."""
        report = Report(
            script=self.script, command=self.command, env=self.env, config=dataclasses.asdict(self.cfg),
            tables=list(tables), goals=list(goals), records=list(records), images=list(images),
            load_avg_end=tuple(round(x, 2) for x in os.getloadavg()),  # type: ignore[arg-type]
        )  # fmt: skip
        return emit(report, self.out)

    def write(self, output: Output) -> Path:
        """`finish` with `output`, its figures drawn beside results.json."""
        inv = dataclasses.replace(self, script=output.script or self.script)
        images = [name for name, draw in output.figures.items() if _save_figure(inv.out / name, draw)]
        return inv.finish(output.tables, goals=output.goals, records=output.records, images=images)


def _save_figure(path: Path, draw: Draw) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = draw(plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def start(
    script: str,
    doc: str | None,
    argv: Sequence[str] | None,
    *,
    default: C,
    quick: C,
    overrides: Sequence[Override] = (),
    modes: Sequence[Mode] = (),
    module: str | None = None,
) -> Invocation[C]:
    """Parse the shared options, `overrides` and the flag of at most one of `modes` (which then gives the
    results name and the Configs), apply the process-wide settings, pick `quick` or `default` and
    override its fields, note the environment. `module`: the command's (default benchmarks.<script>)."""
    module = module or f"benchmarks.{script}"
    p = parser(module, doc)
    for o in overrides:
        o.add_to(p)
    if modes:  # argparse's --help fails on an empty exclusive group
        group = p.add_mutually_exclusive_group()
    for m in modes:
        group.add_argument(m.flag, dest="mode", action="store_const", const=m, help=m.question)
    args = p.parse_args(argv)
    setup(args)
    mode: Mode | None = getattr(args, "mode", None)
    if mode is not None:
        script, default, quick = mode.script, mode.default, mode.quick
    cfg = quick if args.quick else default
    for o in overrides:
        cfg = o.apply(cfg, args)
    return Invocation(script=script, command=command(module, argv), args=args, cfg=cfg, env=Environment.now())


def main(
    script: str,
    doc: str | None,
    argv: Sequence[str] | None,
    *,
    run: Callable[[Any], Output],
    default: Any,
    quick: Any,
    overrides: Sequence[Override] = (),
    modes: Sequence[Mode] = (),
) -> Path:
    """A script's whole command line: `start`, then `run` (or the chosen mode's) on the Config, `write`."""
    inv = start(script, doc, argv, default=default, quick=quick, overrides=overrides, modes=modes)
    mode: Mode | None = getattr(inv.args, "mode", None)
    return inv.write((mode.run if mode else run)(inv.cfg))
