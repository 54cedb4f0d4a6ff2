"""Muon update math: Newton-Schulz orthogonalisation batched over expert matrices, the in-place
multi-tensor update, its per-matrix reference, and the end-of-step recipe built on torch's optimizers.

Legend: a parameter is one matrix (A, B) or a batch of E expert matrices (E, A, B), an expert tensor as
stored (transformers' gate_up (E, 2n, d), down (E, d, n)); A, B are each matrix's rows and columns as
stored, the shape torch.optim.Muon's `adjust_lr_fn` reads. A momentum buffer has its parameter's
shape and dtype. Per matrix, one update is torch.optim.Muon's:

    buf    = buf.lerp(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    O      = NS(update)         # bf16, on the wide orientation (transposed when A > B)
    param  = param * (1 - lr * weight_decay) - adjusted_lr(lr, A, B) * O

`muon_` runs it on a batch of E matrices with ONE batched Newton-Schulz (`torch.baddbmm` over E)
instead of E separate ones; on CPU the batched GEMMs, the batched norm and the element-wise steps give
the bits of E separate calls (measured, tests/test_muon.py), except the last `add_` of a bf16 batch,
whose vectorized loop rounds its scalar tail differently (no FMA): that add runs once per matrix.
`muon_ref` is the per-matrix reference, one 2-D matrix at a time, with torch's calls.
torch 2.13's Muon divides a bf16 momentum buffer in place when nesterov=False (`grad.bfloat16()` is the
buffer itself; fixed upstream by copying, pytorch PR 194664); here the iteration always works on a copy.
Never decides WHEN to update.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sonar_fx.config import MuonConfig
from sonar_fx.optim.adamw import grad_like_param


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """The LR of a matrix of `shape` (..., A, B), with torch.optim.Muon's arithmetic (same float ops)."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: expected None, 'original' or 'match_rms_adamw'.")
    return lr * ratio


def zeropower_via_newtonschulz(
    update: Tensor, *, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Orthogonalise `update` (A, B) or each matrix of (E, A, B), in bf16; returns a new bf16 tensor.

    Per matrix the same calls as torch.optim.Muon (divide by the Frobenius norm, then `ns_steps`
    quintic iterations with addmm); a batch runs them once with baddbmm, never looping over E.
    """
    x = update.to(torch.bfloat16, copy=True)  # a copy: never normalise the caller's tensor in place
    return _newton_schulz_(x, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps)


def _newton_schulz_(
    x: Tensor, *, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """`zeropower_via_newtonschulz` of a bf16 tensor the caller gives up: it is normalised in place."""
    if x.dim() not in (2, 3):
        raise ValueError(f"Newton-Schulz takes (A, B) or (E, A, B), got shape {tuple(x.shape)}.")
    a, b, c = ns_coefficients
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # iterate on the wide orientation: the Gram matrix is the smaller one
    norm = x.norm() if x.dim() == 2 else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norm.clamp(min=eps))
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(ns_steps):
        gram = x @ x.mT
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def muon_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    found_inf: Tensor | None = None,
) -> None:
    """Muon on every tensor of `params` ((A, B) or (E, A, B)), in place. `found_inf` (0-d float32,
    1.0 = skip) leaves weights and momentum untouched without a sync: a skipped tensor's gradient is
    replaced by its momentum buffer (the buffer then lerps onto itself), its orthogonalised update is
    multiplied by 0 and its decay factor is 1, all on the device; an update that is not skipped makes
    the same calls on the same values, so it keeps its bits. Temporaries beyond the gradient: one
    tensor in the parameter's dtype, its bf16 copy (fp32 parameters), the iteration's."""
    skip = None if found_inf is None else found_inf.to(torch.bool)
    ns: dict[str, Any] = dict(ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps)
    for p, grad, buf in zip(params, grads, momentum_buffers, strict=True):
        g = grad_like_param(p, grad)
        owned = skip is not None
        if skip is not None:
            g = torch.where(skip, buf, g)  # finite whatever the gradient held; ours to overwrite
        buf.lerp_(g, 1 - momentum)
        # Nesterov's update in place where the tensor is ours: one gradient-sized temporary fewer.
        update = buf if not nesterov else g.lerp_(buf, momentum) if owned else g.lerp(buf, momentum)
        # The iteration's bf16 input: our own temporary as it is, a copy of the buffer; the fp32
        # temporary goes before the iteration's own temporaries arrive.
        x = update.to(torch.bfloat16, copy=update is buf)
        del update, g
        ortho = _newton_schulz_(x, **ns)
        if skip is None:
            p.mul_(1 - lr * weight_decay)
        else:
            ortho.mul_((~skip).to(ortho.dtype))
            p.mul_(torch.where(skip, 1.0, 1 - lr * weight_decay))
        _add_per_matrix_(p, ortho, alpha=-adjusted_lr(lr, adjust_lr_fn, p.shape))


def _add_per_matrix_(param: Tensor, ortho: Tensor, *, alpha: float) -> None:
    """`param += alpha * ortho`, as E per-matrix calls where one batched call would round differently:
    CPU's vectorized add of two bf16 tensors uses an FMA in its vector body and not in its scalar tail,
    so an element's bits depend on where the batch's loop (or a thread's chunk) ends. A mixed-dtype add
    (fp32 weights) computes every element alike: one call; so does CUDA's kernel, as far as we know
    (unverified without a GPU; `granularity="per_expert"` is the per-matrix mode)."""
    if param.dim() == 2 or param.dtype != ortho.dtype or param.device.type != "cpu":
        param.add_(ortho, alpha=alpha)
        return
    for p_e, o_e in zip(param.unbind(0), ortho.unbind(0), strict=True):
        p_e.add_(o_e, alpha=alpha)


def muon_ref(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """The per-matrix reference, in place: torch.optim.Muon's single-tensor arithmetic on each matrix
    `param[e]` of (E, A, B) (or on `param` itself when 2-D), one after the other."""
    if param.dim() == 3:
        for e in range(param.shape[0]):
            muon_ref(param[e], grad[e], momentum_buffer[e], lr=lr, weight_decay=weight_decay,
                     momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
                     ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn)  # fmt: skip
        return
    a, b, c = ns_coefficients
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    x = update.to(torch.bfloat16, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    param.mul_(1 - lr * weight_decay)
    param.add_(x.T if tall else x, alpha=-adjusted_lr(lr, adjust_lr_fn, param.shape))


HYPER = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn")
"""torch.optim.Muon's hyper-parameters, as its param groups and `muon_` name them."""


def muon_defaults(cfg: MuonConfig) -> dict[str, Any]:
    """The Muon hyper-parameters of `cfg`, as a param group holds them."""
    return {k: getattr(cfg, k) for k in HYPER}


def muon_hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's Muon hyper-parameters, as `muon_` takes them."""
    return {k: group[k] for k in HYPER}


class MuonTwin(torch.optim.Optimizer):
    """The end-of-step Muon recipe with torch's own optimizers, the baseline Sonar's Muon equals:
    `torch.optim.Muon` on each 2-D matrix and on each expert matrix `param[e]` as its own 2-D
    parameter (an alias of that slice, so no copy), `torch.optim.AdamW(fused=True)` on the rest
    (`cfg.adamw`). Param groups: "dense" (AdamW), "experts" (the expert slices), "dense_matrices"
    (hidden matrices), each one present when it has tensors; the groups and states are torch's own, so
    LR schedulers and state dicts work as on any optimizer.
    """

    def __init__(
        self, params: Iterable[nn.Parameter], cfg: MuonConfig, *, matrices: Collection[Tensor]
    ) -> None:
        params = list(params)
        matrix_ids = {id(m) for m in matrices}
        rest = [p for p in params if id(p) not in matrix_ids]
        self.experts = [p for p in params if id(p) in matrix_ids and p.dim() == 3]
        dense = [p for p in params if id(p) in matrix_ids and p.dim() == 2]
        self.slices = {id(p): [nn.Parameter(p.detach()[e]) for e in range(p.shape[0])] for p in self.experts}
        hyper, adamw = muon_defaults(cfg), cfg.adamw
        parts: list[torch.optim.Optimizer] = []
        if rest:
            parts.append(torch.optim.AdamW(
                [dict(params=rest, name="dense")], fused=True, lr=adamw.lr, betas=adamw.betas, eps=adamw.eps,
                weight_decay=adamw.weight_decay,
            ))  # fmt: skip
        if self.experts:
            flat = [s for p in self.experts for s in self.slices[id(p)]]
            parts.append(torch.optim.Muon([dict(params=flat, name="experts")], **hyper))
        if dense:
            parts.append(torch.optim.Muon([dict(params=dense, name="dense_matrices")], **hyper))
        self.parts = parts
        super().__init__([group for part in parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Each torch optimizer reads and writes this optimizer's groups and state."""
        groups = iter(self.param_groups)
        for part in self.parts:
            part.param_groups = [next(groups) for _ in part.param_groups]
            part.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonTwin.step() takes no closure.")
        for p in self.experts:
            grads = [None] * p.shape[0] if p.grad is None else list(p.grad.unbind(0))
            for s, g in zip(self.slices[id(p)], grads, strict=True):
                s.grad = g  # a view of the expert gradient: torch's Muon reads it as that matrix's own
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.experts:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()  # torch's loader replaces the groups and the state
