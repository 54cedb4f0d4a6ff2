"""The runtime layer: what runs while backward runs, found from the tensors it is handed.

`registry` binds each expert parameter to the optimizer that owns it (weakly, both ways);
`update_op` is the in-graph op `torch.ops.sonar_fx.expert_update_` that the graph pass inserts, and
`engine` asks autograd's engine, as it runs, whether the backward in progress wants that update;
`defer_op` is `torch.ops.sonar_fx.expert_defer_`, the deferred schedule's hand-over of a gradient's
operands; `hooks` are the post-accumulate-grad hooks of the eager path. Nothing here is decided at compile
time: a compiled graph that dynamo reuses for another module (another block, model or copy) updates
the tensors it was handed, through their owner. This layer imports torch only; it never imports the
passes, the backend or training code.
"""

from sonar_fx.runtime.defer_op import EXPERT_DEFER_OP
from sonar_fx.runtime.hooks import register_expert_hooks
from sonar_fx.runtime.registry import ExpertOwner, UnboundExpertError, bind, owner_of
from sonar_fx.runtime.update_op import EXPERT_UPDATE_OP

__all__ = [
    "EXPERT_DEFER_OP",
    "EXPERT_UPDATE_OP",
    "ExpertOwner",
    "UnboundExpertError",
    "bind",
    "owner_of",
    "register_expert_hooks",
]
