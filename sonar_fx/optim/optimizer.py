"""`SonarOptimizer`: a real `torch.optim.Optimizer` whose expert group is updated during backward.

Two param groups, so any LR scheduler drives both: "dense" (end-of-step fused AdamW after clipping
the global norm of the dense gradients) and "experts" (updated one batched tensor at a time by
`update_expert_`, called from a hook or from the compiled graph, as soon as its gradient is ready).
It never decides where updates run; the eager hooks and the graph pass do.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.optim.adamw import fused_adamw_, grad_like_param
from sonar_fx.optim.stats import SonarStats

Granularity = Literal["batched", "per_expert"]
Accumulation = Literal["per_microbatch"] | None


class SonarUsageError(RuntimeError):
    """Sonar was driven in a way that would train silently differently from what the user asked."""


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
    ) -> None:
        if granularity not in ("batched", "per_expert"):
            raise ValueError(f"granularity={granularity!r}: expected 'batched' or 'per_expert'.")
        if accumulation not in (None, "per_microbatch"):
            raise ValueError(f"accumulation={accumulation!r}: expected None or 'per_microbatch'.")
        self.cfg = cfg
        self.granularity = granularity
        self.accumulation = accumulation
        self.expert_layers = list(expert_layers)
        self.expert_names = {id(t.param): t.name for layer in expert_layers for t in layer.tensors}
        self.stats = SonarStats()
        self.compiler = "eager"
        self._warned_accumulation = False
        self.hook_handles: list[Any] = []
        """Handles of the eager expert hooks (set by `sonar_fx.prepare`)."""
        defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        experts = [t.param for layer in expert_layers for t in layer.tensors]
        super().__init__(
            [dict(params=list(dense_params), name="dense"), dict(params=experts, name="experts")], defaults
        )

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
        name = self.expert_names.get(id(param))
        if name is None:
            raise KeyError("update_expert_ got a tensor that is not one of this optimizer's experts.")
        self._check_once_per_step(name)
        if grad.dtype != param.dtype or grad.device != param.device:
            raise SonarUsageError(
                f"{name}: gradient is {grad.dtype} on {grad.device} but the parameter is {param.dtype} on "
                f"{param.device}; Sonar updates weights in their own dtype. Keep expert weights and their "
                "gradients in one dtype (e.g. model.to(torch.bfloat16)), without fp32 master copies."
            )
        group, state = self.expert_group, self._adamw_state(param)
        hyper = dict(
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.granularity == "batched":
            fused_adamw_([param], [grad], [m], [v], [state["step"]], **hyper)
            self.stats.update_calls += 1
        else:
            # The ablation: one kernel call per expert slice, all slices sharing the tensor's step.
            g = grad_like_param(param, grad)
            state["step"].add_(1)
            for e in range(param.shape[0]):
                fused_adamw_(
                    [param[e]], [g[e]], [m[e]], [v[e]], [state["step"]], increment_steps=False, **hyper
                )
            self.stats.update_calls += param.shape[0]
        self.stats.record_update(name, path)

    def _check_once_per_step(self, name: str) -> None:
        if name not in self.stats.current_step:
            return
        if self.accumulation is None:
            raise SonarUsageError(
                f"{name} received a second gradient before optimizer.step(): this looks like gradient "
                "accumulation. Sonar updates experts inside each backward, so accumulating would apply one "
                "update per micro-batch, a different optimizer. Call step() after every backward, or opt in "
                "with sonar_fx.compile(..., accumulation='per_microbatch')."
            )
        if not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                "accumulation='per_microbatch': expert tensors are updated once per micro-batch (the "
                "paper's semantics), not once per optimizer step.",
                stacklevel=3,
            )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Dense parameters: clip their global gradient norm, then fused AdamW. Experts are done."""
        if closure is not None:
            raise SonarUsageError("SonarOptimizer.step() takes no closure: experts update during backward.")
        group = self.dense_group
        params = [p for p in group["params"] if p.grad is not None]
        if self.cfg.clips and group["params"]:
            torch.nn.utils.clip_grad_norm_(group["params"], self.cfg.max_grad_norm)  # type: ignore[arg-type]
        states = [self._adamw_state(p) for p in params]
        fused_adamw_(
            params,
            [p.grad for p in params if p.grad is not None],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        self.stats.end_step()

    def report(self) -> dict[str, Any]:
        """What Sonar found and did: expert tensors, update counts by path, compiles and fallbacks."""
        s = self.stats
        return {
            "expert_layers": len(self.expert_layers),
            "expert_tensors": len(self.expert_names),
            "granularity": self.granularity,
            "compiler": self.compiler,
            "updates_in_graph": s.updates["graph"],
            "updates_by_hook": s.updates["hook"],
            "update_calls": s.update_calls,
            "graphs_compiled": s.graphs_compiled,
            "graphs_from_cache": s.graphs_from_cache,
            "updates_inserted": s.updates_inserted,
            "recompiles": s.recompiles,
            "fallbacks": list(s.fallbacks),
            "last_step": dict(s.last_step),
        }
