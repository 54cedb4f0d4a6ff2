"""Which runs of `benchmarks.distributed_deferred` are measurements, and where each writes its results.

For: keeping a smoke test (`--quick`: the micro model, a shorter recipe, 2 rounds) and a partial run
(`--engines fsdp2`) from ever writing over the measured results the docs show (results/<script>/), and
labelling a smoke test's every table as one. Never measures anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from benchmarks.common import Output, Table
from benchmarks.distributed_arms import SMOKE_SHAPES, Config
from benchmarks.workload import SHAPES

SCRIPT = "distributed_deferred"


MEASURED_ROUNDS = 15
"""Paired rounds the project reports a time ratio from (fewer: a smoke test)."""


def smoke_test(cfg: Config, *, timed: bool = True) -> str | None:
    """Why `cfg`'s run measures nothing (None: it is a measurement): the micro model, whose step is
    Python, hooks and gloo's latency rather than the expert GEMMs and collectives a time ratio compares
    (and whose memory is not the benchmark model's); another recipe than the measured one (`--quick`'s
    shorter sequences and fewer micro-batches); for time ratios (`timed`), too few paired rounds for
    a median and IQR on a shared machine (a memory-only run, `--plan` or `--timeline`, has none)."""
    why = []
    if cfg.shape in SMOKE_SHAPES:
        model = "whose step is Python and gloo latency, not GEMMs" if timed else "a model to run the code on"
        why.append(f"{SHAPES[cfg.shape].describe()}, {model}")
    measured = Config()
    if _recipe(cfg) != _recipe(measured):
        why.append(f"{_recipe_text(cfg)} (the measured recipe: {_recipe_text(measured)})")
    if timed and cfg.rounds < MEASURED_ROUNDS:
        why.append(f"{cfg.rounds} paired rounds (a measurement takes {MEASURED_ROUNDS})")
    return "; ".join(why) or None


def _recipe(cfg: Config) -> tuple[object, ...]:
    return cfg.dtype, cfg.world, cfg.batch, cfg.seq, cfg.accum


def _recipe_text(cfg: Config) -> str:
    return f"batch {cfg.batch} x seq {cfg.seq} x {cfg.accum} micro-batches, {cfg.dtype}, {cfg.world} ranks"


SMOKE_TITLE = ": a SMOKE TEST, not a measurement"


def labelled_smoke(table: Table, why: str, shows: str) -> Table:
    """`table` titled a smoke test, its note opening with why (`smoke_test`) and what it shows."""
    return replace(table, title=table.title + SMOKE_TITLE, note=f"SMOKE TEST: {why}. {shows} {table.note}")


def results_name(
    cfg: Config,
    script: str = SCRIPT,
    engines: tuple[str, ...] | None = Config().engines,
    *,
    timed: bool = True,
) -> str | None:
    """Where a run of `script` that is not its default one writes (None: results/<script>): another
    choice of engines than `engines` (`--engines fsdp2`; None: the run's engines do not name it), another
    model shape (`--shape olmoe-cpu-8e`) and a smoke test (`smoke_test`, `timed` as there: `--quick`,
    `*_smoke`, never shown in the docs) never overwrite the default run's results."""
    name = script if engines is None or cfg.engines == engines else "_".join((script, *cfg.engines))
    if cfg.shape not in (Config().shape, *SMOKE_SHAPES):
        name += f"_{cfg.shape}"
    if smoke_test(cfg, timed=timed) is not None:
        name += "_smoke"
    return None if name == script else name


def memory_only(
    script: str, run: Callable[[Config], Output], engines: tuple[str, ...] | None
) -> Callable[[Config], Output]:
    """A memory-only mode's run (`--plan`, `--timeline`): a smoke test (`smoke_test(timed=False)`:
    `--quick`) has every table labelled so and writes <script>_smoke, never over the measured results;
    another choice of engines than `engines` writes its own (`results_name`)."""

    def named(cfg: Config) -> Output:
        output = run(cfg)
        tables = memory_tables(output.tables, cfg)
        return replace(output, tables=tables, script=results_name(cfg, script, engines, timed=False))

    return named


def memory_tables(tables: list[Table], cfg: Config) -> list[Table]:
    """A run's memory tables, each labelled a smoke test where `cfg` is one (`smoke_test(timed=False)`)."""
    why = smoke_test(cfg, timed=False)
    if why is None:
        return tables
    shows = "It shows that the code paths ran; the measured run is the same command without --quick."
    return [labelled_smoke(t, why, shows) for t in tables]
