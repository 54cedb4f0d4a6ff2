"""Eager Sonar-MoE: one post-accumulate-grad hook per batched expert tensor (the paper's method).

Each hook applies the owner's update as soon as the tensor's gradient is complete and frees it, so at
most one layer of expert gradients is alive. Under the compiled pass the same hooks are the safety
net for gradients computed outside any compiled graph (a hook finds no gradient, and does nothing,
for a tensor whose gradient the graph consumed). The hook holds no reference to its owner: it looks
the owner up when it fires, so a dropped optimizer is freed and its tensors train as plain tensors.
Each hook reports its gradient to the owner's meter (`meter`): alive when the hook starts, freed by it.
Under the deferred schedule a hook moves the gradient out of `.grad` into the owner's kept
contributions (`sonar_fx.optim.deferred`): it joins its backward's sum where it arrived, and `.grad`
is empty for the next backward's, as autograd's accumulation needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from sonar_fx.runtime.registry import owner_of


def register_expert_hooks(params: Iterable[Tensor]) -> list[RemovableHandle]:
    """Hook every tensor in `params`, frozen ones included; returns the handles (remove them to detach).

    torch refuses a hook on a tensor that does not require grad, but a frozen expert may be unfrozen
    later (and the original, hooked while trainable, keeps its hook through a freeze): a frozen tensor
    is made trainable just long enough to take its hook, so a copy or an unpickled model is hooked
    exactly as the model it was made from."""
    handles = []
    for p in params:
        frozen = not p.requires_grad
        if frozen:
            p.requires_grad_(True)
        try:
            handles.append(p.register_post_accumulate_grad_hook(update_and_free))
        finally:
            if frozen:
                p.requires_grad_(False)
    return handles


def update_and_free(param: Tensor) -> None:
    """The hook: update `param` through its owner, then free its gradient."""
    if param.grad is None:
        return  # the compiled graph consumed this gradient (it returned None) and updated in-graph
    owner = owner_of(param)
    if owner is None:
        return  # no live owner: the gradient stays in .grad, as for any plain tensor
    if getattr(owner, "schedule", None) == "deferred":  # applied at step(), in the order autograd sums
        owner.keep_whole_(param)  # alive until then: counted, and the saving guard says why
        return
    meter = owner.meter
    meter.appeared(param, param.grad.nbytes)  # AccumulateGrad ran just now: it appeared just now
    try:
        owner.update_expert_(param, param.grad, path="hook")
        param.grad = None
    finally:
        meter.freed(param)
