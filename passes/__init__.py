"""Sonar graph passes (shipped as `sonar_fx.passes`): pure FX code over AOTAutograd graphs.

`find_expert_grads` locates expert weight-gradient producers and the aliases of each weight;
`expert_update_pass` inserts the in-backward updates after them. This package imports torch and its
own modules only; the update op it inserts is named through `torch.ops` (registered by
`sonar_fx.runtime`).
"""

from sonar_fx.passes.find_expert_grads import ExpertGrad, classify, find_expert_grads
from sonar_fx.passes.insert_updates import expert_update_pass, insert_update, last_reader, update_op

__all__ = [
    "ExpertGrad",
    "classify",
    "expert_update_pass",
    "find_expert_grads",
    "insert_update",
    "last_reader",
    "update_op",
]
