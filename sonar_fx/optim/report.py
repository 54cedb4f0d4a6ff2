"""`SonarOptimizer.report()`: what Sonar found and did, as one plain dict (JSON-ready, for logs and tests).

It reads the optimizer's stats, tracker and clipper; it never changes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sonar_fx.optim.optimizer import SonarOptimizer


def report(opt: SonarOptimizer) -> dict[str, Any]:
    """Expert tensors, update counts by path, compiles and fallbacks, skips and abandoned steps."""
    s, t = opt.stats, opt.tracker
    return {
        "expert_layers": len(opt.experts.layers),
        "expert_tensors": len(opt.experts.params),
        "granularity": opt.granularity,
        "optimizer": opt.cfg.name,
        "expert_rule": opt.expert_rule.name,
        "expert_clip": opt.cfg.expert_clip,
        "grad_norms": opt.grad_norms(),
        "compiler": opt.compiler,
        "nonfinite": opt.nonfinite,
        "updates_in_graph": s.updates["graph"],
        "updates_by_hook": s.updates["hook"],
        "update_calls": s.update_calls,
        "graphs_compiled": s.graphs_compiled,
        "graphs_from_cache": s.graphs_from_cache,
        "updates_inserted": s.updates_inserted,
        "recompiles": s.recompiles,
        "fallbacks": list(s.fallbacks),
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
