"""`SonarOptimizer`: a real `torch.optim.Optimizer` whose expert group is updated during backward.

Two param groups, so any LR scheduler drives both: "dense" (end-of-step fused AdamW after clipping
the global norm of the dense gradients) and "experts" (updated one batched tensor at a time by
`update_expert_`, called from a hook or from the compiled graph, as soon as its gradient is ready).
The optimizer binds its expert tensors to itself in the runtime registry (weakly), so whatever runs
in backward finds it from the tensor at hand; a deep copy or an unpickled optimizer binds its own
tensors. It never decides where updates run; the eager hooks and the graph pass do.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.optim.adamw import fused_adamw_, grad_like_param, nonfinite_flag
from sonar_fx.optim.errors import NonFiniteGradientError, SonarUsageError
from sonar_fx.optim.stats import SonarStats
from sonar_fx.optim.step_tracker import Accumulation, StepTracker
from sonar_fx.runtime import hooks, registry

Granularity = Literal["batched", "per_expert"]
NonFinite = Literal["raise", "skip", "ignore"]
NONFINITE = ("raise", "skip", "ignore")

__all__ = ["Accumulation", "Granularity", "NonFinite", "SonarOptimizer", "SonarUsageError"]


class SonarOptimizer(torch.optim.Optimizer):
    """AdamW for an MoE model: experts in backward, dense parameters at `step()`."""

    def __init__(
        self,
        dense_params: Sequence[nn.Parameter],
        expert_layers: Sequence[ExpertLayer],
        cfg: AdamWConfig,
        *,
        granularity: Granularity = "batched",
        accumulation: Accumulation = None,
        nonfinite: NonFinite = "raise",
        dense_names: Sequence[str] | None = None,
    ) -> None:
        if granularity not in ("batched", "per_expert"):
            raise ValueError(f"granularity={granularity!r}: expected 'batched' or 'per_expert'.")
        if accumulation not in (None, "per_microbatch"):
            raise ValueError(f"accumulation={accumulation!r}: expected None or 'per_microbatch'.")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}: expected one of {', '.join(map(repr, NONFINITE))}.")
        self.cfg = cfg
        self.granularity = granularity
        self.accumulation = accumulation
        self.nonfinite = nonfinite
        self.expert_layers = list(expert_layers)
        self.dense_names = list(dense_names) if dense_names is not None else None
        self.stats = SonarStats()
        self.compiler = "eager"
        self.distributed: str | None = None
        """The distributed setup that reduces expert gradients before the update (None: one process)."""
        defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        experts = [t.param for layer in expert_layers for t in layer.tensors]
        super().__init__(
            [dict(params=list(dense_params), name="dense"), dict(params=experts, name="experts")], defaults
        )
        self._bind()

    # ----------------------------------------------------------------------------- binding, copies

    def _bind(self) -> None:
        """Own the expert tensors: registry entries and hooks, both released when self is collected."""
        self.tracker = StepTracker(self.accumulation)
        self._skip_flags: dict[str, Tensor] = {}
        self._names = {id(t.param): t.name for layer in self.expert_layers for t in layer.tensors}
        params = [t.param for layer in self.expert_layers for t in layer.tensors]
        for p in params:
            registry.bind(p, self)
        handles = hooks.register_expert_hooks(params)
        weakref.finalize(self, _release, handles)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults, state and param_groups: keep Sonar's own fields, drop
        # what belongs to one process (hooks, the step in progress).
        state = super().__getstate__()
        keep = ("cfg", "granularity", "accumulation", "nonfinite", "expert_layers", "dense_names", "stats")
        state.update({k: self.__dict__[k] for k in keep})
        state.update(compiler=self.compiler, distributed=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._bind()  # a deep copy binds the copied tensors (its model's, when the model was copied)

    # ------------------------------------------------------------------------------------ updates

    @property
    def dense_group(self) -> dict[str, Any]:
        return self.param_groups[0]

    @property
    def expert_group(self) -> dict[str, Any]:
        return self.param_groups[1]

    def _adamw_state(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state[param]
        if not state:
            # Same state tensors as torch.optim.AdamW(fused=True): moments in the param's dtype and
            # layout (bf16 params get bf16 states), the step as a 0-d float32 on its device.
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update_expert_(self, param: Tensor, grad: Tensor, *, path: str) -> None:
        """AdamW on one batched expert tensor, now; the caller frees `grad` afterwards."""
        name = self._names.get(id(param))
        if name is None:
            raise KeyError("update_expert_ got a tensor that is not one of this optimizer's experts.")
        self._check_tensor(name, param, grad)
        if self.tracker.before_update(name):
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        found_inf = self._nonfinite_flag(name, grad)
        group, state = self.expert_group, self._adamw_state(param)
        hyper = dict(
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        if self.granularity == "batched":
            fused_adamw_([param], [grad], [m], [v], [step], found_inf=found_inf, **hyper)
            self.stats.update_calls += 1
        else:
            # The ablation: one kernel call per expert slice, all slices sharing the tensor's step.
            g = grad_like_param(param, grad)
            step.add_(1)
            for e in range(param.shape[0]):
                fused_adamw_(
                    [param[e]], [g[e]], [m[e]], [v[e]], [step], increment_steps=False, found_inf=found_inf,
                    **hyper,
                )  # fmt: skip
            if found_inf is not None:
                step.sub_(found_inf)
            self.stats.update_calls += param.shape[0]
        self.tracker.record(name)
        self.stats.record_update(name, path)

    def _check_tensor(self, name: str, param: Tensor, grad: Tensor) -> None:
        if self.distributed is None and _multi_process():
            raise SonarUsageError(
                f"{name}: torch.distributed runs {torch.distributed.get_world_size()} processes, so this "
                "gradient is this rank's local one and Sonar would update each rank's copy differently. "
                "Sonar's in-backward update does not reduce expert gradients across ranks yet: train on one "
                "process, or keep the experts out of data parallelism."
            )
        if param.dtype == torch.float16:
            raise SonarUsageError(
                f"{name} is float16: fp16 weights need a GradScaler, whose unscale and inf check would run "
                "after Sonar has already applied the update in backward. Train in bf16 or fp32."
            )
        if grad.dtype != param.dtype or grad.device != param.device:
            raise SonarUsageError(
                f"{name}: gradient is {grad.dtype} on {grad.device} but the parameter is {param.dtype} on "
                f"{param.device}; Sonar updates weights in their own dtype. Keep expert weights and their "
                "gradients in one dtype (e.g. model.to(torch.bfloat16)), without fp32 master copies."
            )
        state = self.state.get(param)
        if state and (state["exp_avg"].dtype, state["exp_avg"].device) != (param.dtype, param.device):
            raise SonarUsageError(
                f"{name} is now {param.dtype} on {param.device} but its optimizer state is "
                f"{state['exp_avg'].dtype} on {state['exp_avg'].device}: the model was cast or moved "
                "(model.half(), model.to(...)) after training started. Cast or move the model before "
                "the first step, or load a checkpoint into a model already on its final device and dtype."
            )

    def _nonfinite_flag(self, name: str, grad: Tensor) -> Tensor | None:
        """The kernel's skip flag (device-side, no sync): a non-finite gradient leaves its tensor
        untouched under "raise" and "skip"; which ones were non-finite is read once per backward."""
        if self.nonfinite == "ignore":
            return None
        flag = self._skip_flags[name] = nonfinite_flag(grad)
        return flag

    def _backward_finished(self) -> None:
        """Autograd runs this when a backward that updated experts ends (never when it raised)."""
        self.tracker.open_task = None
        if self.nonfinite != "raise" or not self._skip_flags:
            return
        names = list(self._skip_flags)
        bad = [
            n for n, f in zip(names, torch.stack(list(self._skip_flags.values())).tolist(), strict=True) if f
        ]
        if not bad:
            return
        self.tracker.interrupted = [n for n in self.tracker.updated if n not in bad]
        raise NonFiniteGradientError(
            f"non-finite expert gradients (inf or NaN) in {', '.join(bad[:4])}"
            f"{' ...' if len(bad) > 4 else ''} (nonfinite='raise'): their weights and moments are untouched. "
            f"{len(self.tracker.interrupted)} expert tensor(s) with finite gradients were already updated "
            "in this backward. Call optimizer.abandon_step() to drop the step and go on, restore the last "
            "checkpoint for an exact run, or pass nonfinite='skip' to skip such steps.",
            bad,
        )

    # -------------------------------------------------------------------------------- step, recovery

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Dense parameters: clip their global gradient norm, then fused AdamW. Experts are done."""
        if closure is not None:
            raise SonarUsageError("SonarOptimizer.step() takes no closure: experts update during backward.")
        self.tracker.before_step()
        group = self.dense_group
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        total_norm = None
        if grads and (self.cfg.clips or self.nonfinite != "ignore"):
            total_norm = torch.nn.utils.get_total_norm(grads)
        if self._skip_step(params, total_norm):
            self._end_step()
            return
        if self.cfg.clips and total_norm is not None:
            # get_total_norm + clip_grads_with_norm_ is what clip_grad_norm_ runs: the same bits.
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, total_norm)  # type: ignore[arg-type]
        states = [self._adamw_state(p) for p in params]
        fused_adamw_(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        self._end_step()

    def _skip_step(self, params: list[Tensor], total_norm: Tensor | None) -> bool:
        """Apply the non-finite policy to the dense gradients (and, under "skip", the experts')."""
        if self.nonfinite == "ignore":
            return False
        flags = list(self._skip_flags.values())
        skipped = (
            [n for n, f in zip(self._skip_flags, torch.stack(flags).tolist(), strict=True) if f]
            if flags
            else []
        )
        dense_bad = total_norm is not None and not bool(torch.isfinite(total_norm))
        if dense_bad and self.nonfinite == "raise":
            bad = [self._dense_name(i) for i, p in enumerate(params) if not _finite(p.grad)]
            raise NonFiniteGradientError(
                f"dense gradients hold inf or NaN ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; "
                "nonfinite='raise'); no dense weight or moment was touched. The expert tensors were updated "
                "in backward with finite gradients: call optimizer.abandon_step() to drop this step's dense "
                "gradients, or pass nonfinite='skip' to skip such steps.",
                bad,
            )
        if not (dense_bad or skipped):
            return False
        self.stats.skipped_updates.update(skipped)
        self.stats.skipped_steps += 1
        if self.stats.skipped_steps == 1:
            warnings.warn(
                f"sonar: non-finite gradients, step skipped (nonfinite='skip'; experts skipped: "
                f"{len(skipped)}, dense: {'yes' if dense_bad else 'no'}); report() counts every skip.",
                stacklevel=3,
            )
        for p in params:
            p.grad = None
        return True

    def _nonfinite_names(self) -> list[str]:
        """Expert tensors whose gradient was non-finite since the last step (one sync for all)."""
        if not self._skip_flags:
            return []
        flags = torch.stack(list(self._skip_flags.values())).tolist()
        return [name for name, flag in zip(self._skip_flags, flags, strict=True) if flag]

    def _dense_name(self, index: int) -> str:
        return self.dense_names[index] if self.dense_names else f"dense tensor #{index}"

    def _end_step(self) -> None:
        self._skip_flags.clear()
        self.tracker.reset()
        self.stats.end_step()

    def abandon_step(self) -> list[str]:
        """Drop a step a backward left partial (it raised): dense gradients and the step's bookkeeping.

        Expert tensors the interrupted backward updated keep that update (it cannot be taken back) and
        their Adam step counts stay one ahead of the others'; returns their names. For a run bitwise
        equal to an uninterrupted one, restore the last checkpoint instead.
        """
        updated = list(self.tracker.interrupted or self.tracker.updated)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self.stats.abandoned_steps.append(updated)
        self.stats.current_step = {}
        self._skip_flags.clear()
        self.tracker.reset()
        return updated

    def report(self) -> dict[str, Any]:
        """What Sonar found and did: expert tensors, update counts by path, compiles and fallbacks."""
        s, t = self.stats, self.tracker
        return {
            "expert_layers": len(self.expert_layers),
            "expert_tensors": len(self._names),
            "granularity": self.granularity,
            "compiler": self.compiler,
            "nonfinite": self.nonfinite,
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


def _release(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _finite(t: Tensor | None) -> bool:
    return t is None or bool(nonfinite_flag(t) == 0)


def _multi_process() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
