"""`SonarOptimizer.report()`: what Sonar found and did, as one plain dict (JSON-ready, for logs and tests).

It reads the optimizer's stats and step tracker; it never changes them.
"""

from __future__ import annotations

from typing import Any

from sonar_fx.optim.stats import SonarStats
from sonar_fx.optim.step_tracker import StepTracker


def report(
    settings: dict[str, Any], stats: SonarStats, tracker: StepTracker, saving: dict[str, Any]
) -> dict[str, Any]:
    """`settings` (what the optimizer was built with), then update counts by path, compiles and
    fallbacks, `saving` (the saving guard's figures), the step in progress, skips and abandoned steps."""
    s, t = stats, tracker
    return {
        **settings,
        "updates_in_graph": s.updates["graph"],
        "updates_by_hook": s.updates["hook"],
        "updates_deferred": s.updates["deferred"],
        "updates_kept_whole": s.updates["kept"],
        "updates_left_out": s.left_out,
        "update_calls": s.update_calls,
        "graphs_compiled": s.graphs_compiled,
        "graphs_from_cache": s.graphs_from_cache,
        "updates_inserted": s.updates_inserted,
        "recompiles": s.recompiles,
        "fallbacks": list(s.fallbacks),
        **saving,
        "last_step": dict(s.last_step),
        "step_in_progress": {
            "updated": sorted(t.updated),
            "backward_unfinished": t.open_task is not None,
            "interrupted": t.interrupted is not None,
        },
        "skipped_updates": dict(s.skipped_updates),
        "skipped_steps": s.skipped_steps,
        "abandoned_steps": [list(names) for names in s.abandoned_steps],
    }
