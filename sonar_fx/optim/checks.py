"""What `SonarOptimizer` refuses, naming the fix: settings that cannot hold their promise together, and an
expert update whose tensor, gradient or state would make it train differently from the twin it equals.
It only checks; it never changes a tensor or a setting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.nonfinite import NONFINITE


def refuse_unsupported(
    cfg: OptimizerConfig,
    expert_rule: str,
    granularity: str,
    accumulation: Any,
    schedule: str = "in_backward",
) -> None:
    """Combinations that would train differently from what they promise, refused naming the fix."""
    if schedule == "deferred" and accumulation is not None:
        raise SonarUsageError(
            "schedule='deferred' with accumulation='per_microbatch': the deferred schedule accumulates "
            "exactly, any number of backwards per step, as standard training does. Drop accumulation=."
        )
    if cfg.expert_clip == "global" and accumulation is not None:
        raise SonarUsageError(
            "expert_clip='global' with accumulation='per_microbatch': the global norm of one micro-batch is "
            "not the norm of the step's gradient. Use expert_clip='per_tensor' or None to accumulate."
        )
    if granularity == "per_expert" and expert_rule.endswith("bit"):
        raise SonarUsageError(
            "granularity='per_expert' with low-bit states: torchao quantizes a whole tensor in blocks, not "
            "one expert slice at a time. Use granularity='batched' or state_bits=32."
        )


def check_tensor(
    name: str, param: Tensor, grad: Tensor | None, state: dict[str, Any], *, in_backward: bool = True
) -> None:
    """Refuse an expert update that would train differently from what it promises (fp16 weights, a
    gradient in another dtype or device, a model cast or moved after its state was made). fp16 weights
    are refused only for an update in backward (`in_backward`): the deferred schedule updates at
    `step()`, after a GradScaler's verdict, as torch's optimizer does. `grad` None: no gradient yet."""
    if param.dtype == torch.float16 and in_backward:
        raise SonarUsageError(
            f"{name} is float16: fp16 weights need a GradScaler, whose unscale and inf check would run "
            "after Sonar has already applied the update in backward. Train in bf16 or fp32."
        )
    if grad is not None and (grad.dtype != param.dtype or grad.device != param.device):
        raise SonarUsageError(
            f"{name}: gradient is {grad.dtype} on {grad.device} but the parameter is {param.dtype} on "
            f"{param.device}; Sonar updates weights in their own dtype. Keep expert weights and their "
            "gradients in one dtype (e.g. model.to(torch.bfloat16)), without fp32 master copies."
        )
    moment = next((v for v in state.values() if isinstance(v, Tensor) and v.dim()), None)
    if moment is not None and (moment.dtype, moment.device) != (param.dtype, param.device):
        raise SonarUsageError(
            f"{name} is now {param.dtype} on {param.device} but its optimizer state is "
            f"{moment.dtype} on {moment.device}: the model was cast or moved "
            "(model.half(), model.to(...)) after training started. Cast or move the model before "
            "the first step, or load a checkpoint into a model already on its final device and dtype."
        )


def refuse_fp16_autocast(devices: set[str]) -> None:
    """Raise for a backward whose forward ran under float16 autocast on `devices` (none: nothing to
    refuse). fp16 needs a GradScaler, whose scaled gradients Sonar would apply to the experts inside
    backward, before the scaler could unscale them or skip the step."""
    if devices:
        raise SonarUsageError(
            f"the forward ran under float16 autocast ({', '.join(sorted(devices))}): fp16 needs a "
            "GradScaler, and Sonar updates the experts inside backward from the scaled gradients, before "
            "GradScaler can unscale them or skip a step with inf. Use bf16 autocast (no scaler), or "
            "sonar_fx.compile(..., schedule='deferred'), which updates the experts at step()."
        )


def refuse_second_step() -> None:
    """No gradient arrived since the last `step()`: torch would apply the same gradients again, but
    Sonar's expert gradients are gone (applied in backward), so only the dense tensors would step."""
    raise SonarUsageError(
        "optimizer.step() was called again with no backward since the last step(): the dense gradients "
        "are the ones already applied, and the experts have no gradient left (Sonar applied it in "
        "backward), so only the dense tensors would step a second time. Call zero_grad() and "
        "loss.backward() before every step()."
    )


def refuse_changed_grads(names: list[str], max_grad_norm: float | None, experts_updated: bool) -> None:
    """Dense gradients were written after backward and before `step()` (a `clip_grad_norm_` of the
    user's own, as habit), while Sonar clips them itself: the second clip is not a no-op."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    after = (
        " The experts of this step were already updated in backward: call optimizer.abandon_step() (or "
        "restore the last checkpoint) before going on."
        if experts_updated
        else ""
    )
    raise SonarUsageError(
        f"dense gradients changed between backward and step() ({shown}): a clip_grad_norm_ of your own? "
        f"Sonar already clips them at step() (max_grad_norm={max_grad_norm}), and a second clip is not a "
        "no-op. Drop your clip, or compile with max_grad_norm=None and clip yourself (expert .grad stays "
        "None, so clip_grad_norm_(model.parameters()) then clips the dense gradients only, as the method "
        "does); for a clip over ALL parameters, schedule='deferred'." + after
    )


def _observes_only(hook: Callable[..., Any]) -> bool:
    """torch's memory tools (`torch.distributed._tools`: MemTracker, which the planner runs) hook every
    parameter to account its gradient; they never change it, so an update that skips them is exact."""
    return getattr(hook, "__module__", "").startswith("torch.distributed._tools")


_UNSEEN_BECAUSE = {
    "graph": "a compiled graph consumes this gradient and updates the tensor inside the graph",
    "deferred": "schedule='deferred' computes this gradient at step(), from operands kept in backward",
}


def refuse_unseen_grad_hooks(params: Iterable[Tensor], name_of: Callable[[Tensor], str], path: str) -> None:
    """Raise naming the first tensor of `params` that holds a gradient hook of the user's (`register_hook`)
    when autograd never hands that tensor's gradient to it: a compiled graph consumes the gradient (the
    hook then receives None), or the deferred schedule computes it at `step()` (the hook never runs).
    `path` ("graph" or "deferred") says which; the fix: the eager in-backward path (the hook runs first)."""
    for p in params:
        hooks = [h for h in (p._backward_hooks or {}).values() if not _observes_only(h)]
        if hooks:
            hook = hooks[0]
            raise SonarUsageError(
                f"{name_of(p)} has a gradient hook of yours ({getattr(hook, '__qualname__', repr(hook))}, "
                f"registered with register_hook): {_UNSEEN_BECAUSE[path]}, so the hook would not change the "
                "update. Use sonar_fx.compile(..., compiler='eager') with the in-backward schedule, where "
                "the hook runs on the gradient before its update (exact), or remove the hook "
                "(handle.remove()) and scale the loss instead."
            )


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings as an update reads them (every key but "params"); tensors copied, so
    a value changed in place later is seen as changed."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in group.items() if k != "params"}


def refuse_changed_hyperparameters(used: dict[str, Any], group: dict[str, Any]) -> None:
    """The expert group's settings changed after this step's expert updates and before `step()` (the LR
    set in `param_groups` right before `optimizer.step()`, as habit): the experts moved with the old
    values and the dense tensors would move with the new ones. Raised before any dense tensor moves."""
    now = hyperparameters(group)
    changed = [k for k in sorted(used.keys() | now.keys()) if not _same(used.get(k), now.get(k))]
    if not changed:
        return
    shown = ", ".join(f"{k}: {used.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
    raise SonarUsageError(
        f"the experts' param group changed between backward and step() ({shown}): Sonar updated the "
        "experts inside backward with the old value, and the dense tensors would step with the new one. "
        "Set the LR (or any setting) before the forward, e.g. at the top of the loop, or step a torch LR "
        "scheduler after optimizer.step(); schedule='deferred' updates the experts at step() and takes a "
        "value set after backward. The experts of this step already moved: call optimizer.abandon_step() "
        "(or restore the last checkpoint) before going on; no dense tensor moved."
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def check_options(*, granularity: str, accumulation: str | None, nonfinite: str, schedule: str) -> None:
    """`SonarOptimizer`'s keyword options, each one of its choices."""
    choices: dict[str, tuple[Any, ...]] = {
        "granularity": ("batched", "per_expert"),
        "accumulation": (None, "per_microbatch"),
        "nonfinite": NONFINITE,
        "schedule": ("in_backward", "deferred"),
    }
    given = dict(granularity=granularity, accumulation=accumulation, nonfinite=nonfinite, schedule=schedule)
    for option, value in given.items():
        if value not in choices[option]:
            expected = " or ".join(map(repr, choices[option]))
            raise ValueError(f"{option}={value!r}: expected {expected}.")
