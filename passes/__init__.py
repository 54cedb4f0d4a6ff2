"""Sonar graph passes (shipped as `sonar_fx.passes`): pure FX code over AOTAutograd graphs.

`find_expert_grads` locates expert weight-gradient producers and the aliases of each weight;
`expert_update_pass` inserts the in-backward updates after them. Nothing here imports training code.
"""

from sonar_fx.passes.find_expert_grads import ExpertGrad, classify, find_expert_grads
from sonar_fx.passes.insert_updates import PLACEMENTS, Placement, counters, expert_update_pass

__all__ = [
    "PLACEMENTS",
    "ExpertGrad",
    "Placement",
    "classify",
    "counters",
    "expert_update_pass",
    "find_expert_grads",
]
