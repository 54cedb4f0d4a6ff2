"""Update rules: how one optimizer updates tensors, chosen from the config type.

A rule is small and stateless: the hyper-parameters its param groups carry, the state a tensor needs,
the fused multi-tensor update (the same calls torch's end-of-step optimizer makes), the per-expert
ablation, and the end-of-step torch optimizer it must equal (its "twin", which the baselines train
with). `SonarOptimizer` runs a rule on one expert tensor inside backward and on the dense tensors at
`step()`. Hyper-parameters are read from the param group when the update runs, as Python floats
(never baked into a graph), so LR schedulers drive them without recompiling. Muon is per matrix, not
element-wise: its config names three rules (AdamW for the ordinary dense tensors, Muon for the expert
tensors and for the hidden matrices, `matrix_rule_for`), and its twin is `muon.MuonTwin`.
Never: decide WHEN an update runs, or clip (see `norms`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sonar_fx.config import AdamConfig, AdamWConfig, LionConfig, MuonConfig, OptimizerConfig, SGDConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.optim.adamw import fused_adamw_, grad_like_param
from sonar_fx.optim.lion import LionRef, lion_
from sonar_fx.optim.lowbit import LowBitAdamRule
from sonar_fx.optim.muon import MuonTwin, muon_, muon_defaults, muon_hyper
from sonar_fx.optim.sgd import fused_sgd_, torch_sgd
from sonar_fx.optim.update_rule import State, UpdateRule


class AdamRule(UpdateRule):
    """AdamW (`decoupled=True`, torch's `_fused_adamw_`) or Adam with L2 decay (`_fused_adam_`)."""

    def __init__(self, *, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.name = "adamw" if decoupled else "adam"

    def defaults(self, cfg: OptimizerConfig) -> dict[str, Any]:
        if isinstance(cfg, MuonConfig):
            cfg = cfg.adamw  # the recipe's AdamW half
        assert isinstance(cfg, (AdamWConfig, AdamConfig))
        return dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def torch_keys(self) -> dict[str, Any]:
        # What torch.optim.AdamW(fused=True) (Adam(fused=True) for decoupled=False) puts in its groups.
        return dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=True, decoupled_weight_decay=self.decoupled)  # fmt: skip

    def init_state(self, param: Tensor, state: State) -> None:
        # Same state tensors as torch's fused Adam(W): moments in the param's dtype and layout (bf16
        # params get bf16 states), the step as a 0-d float32 on its device.
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        return dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=self.decoupled)  # fmt: skip

    def update_(self, params, grads, states, group, *, found_inf=None):
        fused_adamw_(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states], found_inf=found_inf, **self._hyper(group),
        )  # fmt: skip

    def update_slices_(self, param, grad, state, group, *, found_inf):
        # All slices share the tensor's step: count it once, then run E kernels that do not count.
        g, m, v, step = grad_like_param(param, grad), state["exp_avg"], state["exp_avg_sq"], state["step"]
        step.add_(1)
        for e in range(param.shape[0]):
            fused_adamw_([param[e]], [g[e]], [m[e]], [v[e]], [step], increment_steps=False,
                         found_inf=found_inf, **self._hyper(group))  # fmt: skip
        if found_inf is not None:
            step.sub_(found_inf)
        return param.shape[0]

    def torch_optimizer(self, params, cfg):
        kind = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return kind(params, fused=True, **self.defaults(cfg))


class SGDRule(UpdateRule):
    """SGD with momentum, dampening, Nesterov and L2 decay: torch's `_fused_sgd_` (foreach SGD for CPU
    bf16 tensors, which that kernel leaves unchanged: see `sonar_fx.optim.sgd`)."""

    name = "sgd"

    def defaults(self, cfg: OptimizerConfig) -> dict[str, Any]:
        assert isinstance(cfg, SGDConfig)
        return dict(lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening, nesterov=cfg.nesterov,
                    weight_decay=cfg.weight_decay)  # fmt: skip

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        return {k: group[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay")}

    def update_(self, params, grads, states, group, *, found_inf=None):
        # The momentum buffer appears at a tensor's first update (torch.optim.SGD keeps it the same way).
        buffers = fused_sgd_(params, grads, [s.get("momentum_buffer") for s in states], found_inf=found_inf,
                             **self._hyper(group))  # fmt: skip
        for state, buf in zip(states, buffers, strict=True):
            if buf is not None:
                state["momentum_buffer"] = buf

    def update_slices_(self, param, grad, state, group, *, found_inf):
        if group["momentum"] and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.empty_like(param)
            first = True
        else:
            first = False
        g, buf = grad_like_param(param, grad), state.get("momentum_buffer")
        for e in range(param.shape[0]):
            # A fresh buffer slice is passed as None so the kernel runs its first step on it.
            slice_buf = None if first or buf is None else buf[e]
            out = fused_sgd_([param[e]], [g[e]], [slice_buf], found_inf=found_inf, **self._hyper(group))
            if first and out[0] is not None:
                buf[e].copy_(out[0])
        return param.shape[0]

    def torch_optimizer(self, params, cfg):
        return torch_sgd(params, **self.defaults(cfg))


class LionRule(UpdateRule):
    """Lion (see `sonar_fx.optim.lion`); its twin is `LionRef`, the pure-function reference."""

    name = "lion"

    def defaults(self, cfg: OptimizerConfig) -> dict[str, Any]:
        assert isinstance(cfg, LionConfig)
        return dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def init_state(self, param: Tensor, state: State) -> None:
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def update_(self, params, grads, states, group, *, found_inf=None):
        lion_(params, grads, [s["exp_avg"] for s in states], lr=group["lr"], beta1=group["betas"][0],
              beta2=group["betas"][1], weight_decay=group["weight_decay"], found_inf=found_inf)  # fmt: skip

    def torch_optimizer(self, params, cfg):
        return LionRef(params, **self.defaults(cfg))


class MuonRule(UpdateRule):
    """Muon per matrix (see `sonar_fx.optim.muon`): an expert tensor (E, A, B) is E matrices, updated
    with one batched Newton-Schulz; a 2-D tensor is one matrix. The per-expert ablation (the base
    class's `update_slices_`) runs it on each 2-D slice: torch.optim.Muon's calls, matrix by matrix."""

    name = "muon"

    def defaults(self, cfg: OptimizerConfig) -> dict[str, Any]:
        assert isinstance(cfg, MuonConfig)
        return muon_defaults(cfg)

    def init_state(self, param: Tensor, state: State) -> None:
        # torch.optim.Muon's only state: the momentum buffer, zeros in the param's dtype and layout.
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def update_(self, params, grads, states, group, *, found_inf=None):
        muon_(params, grads, [s["momentum_buffer"] for s in states], found_inf=found_inf, **muon_hyper(group))

    def check_experts(self, layers: Sequence[ExpertLayer]) -> None:
        for layer in layers:
            for t in layer.tensors:
                if t.role == "bias":
                    raise SonarUsageError(
                        f"{t.name} is a per-expert bias, which Muon (a matrix optimizer) does not update: "
                        "train per-expert biases with the dense AdamW tensors, expert_biases='dense' in "
                        "sonar_fx.compile / prepare."
                    )
                if t.param.dim() != 3 or tuple(t.param.shape) != tuple(t.expert_shape):
                    raise SonarUsageError(
                        f"{t.name} has shape {tuple(t.param.shape)} (experts as {tuple(t.expert_shape)}): "
                        "Muon updates batched (E, out, in) expert tensors, one matrix per expert; a fused or "
                        "flattened layout has no matrix per expert to orthogonalise. Use AdamWConfig for it."
                    )

    def torch_optimizer(self, params, cfg):
        assert isinstance(cfg, MuonConfig)
        return MuonTwin(params, cfg, matrices=params)


def end_of_step_optimizer(
    cfg: OptimizerConfig, params: Sequence[nn.Parameter], *, matrices: Collection[Tensor] = ()
) -> torch.optim.Optimizer:
    """The end-of-step optimizer over `params` that Sonar with `cfg` equals bitwise (its twin);
    `matrices`: the tensors of `params` a config with a matrix rule (Muon) updates as matrices (hidden
    2-D matrices and expert tensors); the rest take the config's dense rule."""
    if isinstance(cfg, MuonConfig):
        return MuonTwin(params, cfg, matrices=matrices)
    return rule_for(cfg).torch_optimizer(params, cfg)


def matrix_rule_for(cfg: OptimizerConfig) -> UpdateRule | None:
    """The end-of-step rule of the hidden 2-D matrices when `cfg` updates them apart from the other
    dense tensors (Muon), else None (they take `rule_for(cfg)` with the rest)."""
    return MuonRule() if isinstance(cfg, MuonConfig) else None


def rule_for(cfg: OptimizerConfig, *, experts: bool = False) -> UpdateRule:
    """The rule of `cfg`'s dense tensors, or with `experts=True` of the expert tensors: low-bit states
    when `cfg.dense_state_bits` / `cfg.state_bits` ask for them; Muon for MuonConfig's experts (its
    dense rule is AdamW)."""
    if isinstance(cfg, MuonConfig):
        return MuonRule() if experts else AdamRule(decoupled=True)
    bits = getattr(cfg, "state_bits" if experts else "dense_state_bits", 32)
    if bits != 32:
        return LowBitAdamRule(bits=bits, decoupled=isinstance(cfg, AdamWConfig))
    if isinstance(cfg, AdamWConfig):
        return AdamRule(decoupled=True)
    if isinstance(cfg, AdamConfig):
        return AdamRule(decoupled=False)
    if isinstance(cfg, SGDConfig):
        return SGDRule()
    if isinstance(cfg, LionConfig):
        return LionRule()
    raise TypeError(
        "optimizer config must be one of sonar_fx.AdamWConfig, AdamConfig, SGDConfig, LionConfig, "
        f"MuonConfig; got {type(cfg).__name__}. Sonar updates each expert tensor alone during backward, "
        "which is exact only for an optimizer whose update of a tensor needs that tensor's gradient alone: "
        "build one, e.g. sonar_fx.AdamWConfig(lr=..., max_grad_norm=...)."
    )
