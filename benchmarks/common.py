"""The benchmark harness: environment header, spread statistics, tables, results I/O and the CLI.

Every script states the hardware, the torch version and the load of the machine it ran on, reports a
spread (median, quartiles: `sonar_fx.measure.Spread`) for every timing, prints its tables with tabulate
and writes them, with the raw measurements, to `results/<script>/results.json`, from which
`benchmarks.readme` regenerates the README. This module never builds models, trains or measures; see
`workload`, `arms` and `sonar_fx.measure`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from tabulate import tabulate

from sonar_fx.environment import Environment
from sonar_fx.measure import SIDE_BY_SIDE

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RESULTS_DIR = Path("results")
C = TypeVar("C", bound="DataclassInstance")
"""A script's frozen `Config` dataclass."""


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


@dataclass(frozen=True, kw_only=True)
class Goal:
    """A target from the issue, measured (never asserted: timings belong in benchmarks, not tests)."""

    name: str
    target: str
    measured: str
    met: bool | None
    """None when it could not be measured (an arm failed or did not run)."""


def goals_table(goals: Sequence[Goal]) -> Table:
    mark = {True: "met", False: "MISSED", None: "not measured"}
    rows = [[g.name, g.target, g.measured, mark[g.met]] for g in goals]
    return Table(title="Goals", headers=["goal", "target", "measured", "status"], rows=rows)


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything a script writes to results/<script>/results.json."""

    script: str
    command: str
    """The command line that produced this file, shown beside its tables in the README."""
    env: Environment
    config: dict[str, Any]
    tables: list[Table]
    goals: list[Goal] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    """Raw measurements (per-step times, byte counts) for anyone recomputing the tables."""
    images: list[str] = field(default_factory=list)
    """PNG files written beside results.json (names relative to it)."""


def emit(report: Report, out_dir: Path) -> Path:
    """Print the report's tables and write results.json; returns its path."""
    print(f"\n# {report.script}: {report.command}\n# {report.env.line()}")
    tables = [*report.tables, goals_table(report.goals)] if report.goals else report.tables
    for table in tables:
        print(f"\n## {table.title}\n{table.render()}")
        if table.note:
            print(table.note)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(dataclasses.asdict(report), indent=1, default=_jsonable) + "\n")
    print(f"\nwrote {path}" + "".join(f", {out_dir / name}" for name in report.images))
    return path


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


def parser(script: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every script shares: --quick, --out, --threads, --seed."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{script}", description=(doc or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (fewer steps and configurations)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: results)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's). On a shared machine 1 keeps timings stable.",
    )
    p.add_argument("--seed", type=int, default=0)
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


def command(script: str, argv: Sequence[str] | None = None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", f"benchmarks.{script}", *args])


@dataclass(frozen=True, kw_only=True)
class Override:
    """A script's own flag that, when given, replaces one field of its Config (`--shape` -> `shape`)."""

    field: str
    """The Config field; the flag is `--<field>`."""
    choices: Sequence[str]
    help: str
    many: bool = False
    """Takes one or more values (nargs="+"), stored as a tuple."""
    parse: Callable[[str], Any] = str
    """Turns a chosen value into the field's (`Execution.from_label` for executions)."""

    def add_to(self, p: argparse.ArgumentParser) -> None:
        nargs = "+" if self.many else None
        p.add_argument(f"--{self.field}", nargs=nargs, choices=self.choices, help=self.help)

    def apply(self, cfg: C, args: argparse.Namespace) -> C:
        value = getattr(args, self.field)
        if not value:
            return cfg
        parsed = tuple(map(self.parse, value)) if self.many else self.parse(value)
        return dataclasses.replace(cfg, **{self.field: parsed})


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
        """The folder results.json and any PNG go to: `--out` / script."""
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
        )  # fmt: skip
        return emit(report, self.out)


def start(
    script: str,
    doc: str | None,
    argv: Sequence[str] | None,
    *,
    default: C,
    quick: C,
    overrides: Sequence[Override] = (),
) -> Invocation[C]:
    """The shared preamble of a CPU script: parse the shared options and `overrides`, apply the
    process-wide settings, pick `quick` or `default` and override its fields, note the environment."""
    p = parser(script, doc)
    for o in overrides:
        o.add_to(p)
    args = p.parse_args(argv)
    setup(args)
    cfg = quick if args.quick else default
    for o in overrides:
        cfg = o.apply(cfg, args)
    return Invocation(script=script, command=command(script, argv), args=args, cfg=cfg, env=Environment.now())


def mib(nbytes: float) -> float:
    return nbytes / 2**20
