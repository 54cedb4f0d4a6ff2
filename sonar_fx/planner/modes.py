"""Which mode when: each planned method's semantics, and the deferred schedule's crossover batch.

For: `sonar_fx.plan` and `sonar-fx plan`. `semantics` says what a plan method trains (which gradients
one global norm clips, whether gradient accumulation is exact, when expert tensors are updated), read
from the method's own `sonar_fx.methods.Method` and the config it runs with, so the table beside the
planned peaks never disagrees with the code. `crossover` is the deferred schedule's break-even: per
routed slot (a token's copy sent to one expert) an expert GEMM y = x W^T keeps x (in-width values) and
dy (out-width values), plus its group offsets; a tensor's kept operands outgrow its gradient (E x out x
in values) at E x out x in / (in + out) slots, where `DeferredGrads.add` computes the gradient and keeps
it from then on. That figure is arithmetic on the expert shapes and the router's top-k (the planned
step of sonar_deferred measures the operands it keeps: the tests check the two agree).
Never: plan a step (the figures here are shapes and arithmetic); describe a method other than by its
`Method`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sonar_fx.config import OptimizerConfig
from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.methods import Method

TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k", "moe_topk", "moe_k", "top_k_experts",
                "moe_top_k")  # fmt: skip
"""Config fields that name the experts each token is routed to (the router's top-k)."""
OFFSET_BYTES = 4
"""Bytes per expert of a grouped GEMM's group offsets (int32), kept with each backward's operands."""


@dataclass(frozen=True, kw_only=True)
class Semantics:
    """What a plan method trains, in words for the "which mode when" table."""

    clip: str
    """Which gradients one global norm clips: "all", "dense", "none" (+ "each expert tensor alone")."""
    accumulation: str
    """Gradient accumulation over micro-batches: "exact", "per micro-batch updates" (not the same
    optimizer) or "refused"."""
    experts_updated: str
    """When an expert tensor is updated, and the extra work that costs."""


def semantics(plan_method: str, base: str, cfg: OptimizerConfig) -> Semantics:
    """`plan_method` (run as `sonar_fx.methods` method `base` with `cfg`) in words."""
    kind = Method.named(base)
    clip = kind.clipped(cfg)
    if cfg.clips and cfg.expert_clip == "per_tensor":
        clip = f"{clip} + each expert tensor alone"  # type: ignore[assignment]
    if kind.schedule == "deferred":
        when = "at step(), from kept operands" + (
            " (+1 weight-grad GEMM per tensor: the norm pass)" if cfg.expert_clip == "global" else ""
        )
        accumulation = "exact"
    elif kind.sonar:
        two_pass = cfg.expert_clip == "global"
        when = "in backward" + (" (forward and backward run twice)" if two_pass else "")
        accumulation = "refused" if two_pass else "per micro-batch updates"
    elif kind.per_param_hooks:
        when, accumulation = "in backward, every parameter", "per micro-batch updates"
    else:
        when, accumulation = "at step()", "exact"
    return Semantics(clip=str(clip), accumulation=accumulation, experts_updated=when)


@dataclass(frozen=True, kw_only=True)
class ExpertCrossover:
    """One expert tensor's break-even between kept operands and its gradient."""

    name: str
    """The tensor's name within its layer (e.g. "experts.down_proj")."""
    grad_bytes: int
    operand_bytes_per_token: int
    """Operand bytes kept per token of a step: top-k slots x (in + out) values."""
    batch: int
    """The smallest batch (of `seq` tokens, per micro-batch) whose step crosses over this tensor."""


@dataclass(frozen=True, kw_only=True)
class Crossover:
    """Where the deferred schedule's kept operands outgrow the expert gradients (module docstring)."""

    top_k: int
    seq: int
    grad_accum: int
    layer_grad_bytes: int
    """The largest layer's expert-gradient bytes."""
    layer_operand_bytes_per_token: int
    """That layer's kept operand bytes per token of a step (its offsets aside)."""
    layer_batch: float
    """The batch above which that layer's kept operands outgrow its expert gradients."""
    tensors: list[ExpertCrossover]
    """That layer's tensors, each with the batch from which `DeferredGrads` crosses it over."""
    offset_bytes: int
    """Bytes of one backward's group offsets: one tensor, read by each of the layer's GEMMs."""

    def operand_bytes(self, layers: int, batch: int) -> int:
        """Bytes `layers` layers like this one keep at `batch` (offsets included), below every crossover.
        The layer's tensors keep one offsets tensor per backward, which `DeferredGrads` counts once
        (`kept_storages`); each tensor's own crossover counts it for that tensor (`ExpertCrossover`)."""
        per_micro_batch = self.layer_operand_bytes_per_token * batch * self.seq
        return layers * self.grad_accum * (per_micro_batch + self.offset_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "top_k": self.top_k, "seq": self.seq, "grad_accum": self.grad_accum,
            "layer_grad_bytes": self.layer_grad_bytes,
            "layer_operand_bytes_per_token": self.layer_operand_bytes_per_token,
            "layer_batch": self.layer_batch,
            "tensors": [{"name": t.name, "grad_bytes": t.grad_bytes,
                         "operand_bytes_per_token": t.operand_bytes_per_token, "batch": t.batch}
                        for t in self.tensors],
        }  # fmt: skip


def top_k_of(config: Any) -> int | None:
    """The router's top-k from a model config (a nested `ffn_config` too), None if it names none."""
    for holder in (config, getattr(config, "ffn_config", None), getattr(config, "text_config", None)):
        for name in TOP_K_FIELDS:
            value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def crossover(layers: list[ExpertLayer], top_k: int, *, seq: int, grad_accum: int) -> Crossover | None:
    """The deferred schedule's crossover for the largest of `layers` (None where an expert tensor is not
    a batched (E, out, in) weight: its GEMM's operands are not modelled)."""
    layer = max(layers, key=lambda la: la.grad_bytes())
    weights = [t for t in layer.tensors if t.role != "bias"]
    if not weights or any(len(t.expert_shape) != 3 for t in weights):
        return None
    tensors = []
    prefix = f"{layer.name}."
    for t in weights:
        experts, out_width, in_width = t.expert_shape
        size = t.param.element_size()
        grad = experts * out_width * in_width * size
        per_token = top_k * (in_width + out_width) * size
        offsets = experts * OFFSET_BYTES
        # `DeferredGrads.add` crosses over once the step's kept bytes exceed the gradient's.
        batch = math.floor((grad - grad_accum * offsets) / (grad_accum * seq * per_token)) + 1
        tensors.append(ExpertCrossover(name=t.name.removeprefix(prefix), grad_bytes=grad,
                                       operand_bytes_per_token=per_token, batch=max(batch, 1)))  # fmt: skip
    per_token = sum(t.operand_bytes_per_token for t in tensors)
    grad = sum(t.grad_bytes for t in tensors)
    return Crossover(
        top_k=top_k, seq=seq, grad_accum=grad_accum, layer_grad_bytes=grad,
        layer_operand_bytes_per_token=per_token, layer_batch=grad / (grad_accum * seq * per_token),
        tensors=tensors, offset_bytes=weights[0].num_experts * OFFSET_BYTES,
    )  # fmt: skip


def norm_pass_flops(layers: list[ExpertLayer], top_k: int, tokens: int, crossed: tuple[str, ...] = ()) -> int:
    """The deferred schedule with the all-parameter clip: the FLOPs of its extra weight-gradient GEMMs
    per step. Each expert tensor's gradient is computed once for its norm and once more at `step()`
    for the update; the second is one GEMM dW = dy^T x over every routed slot of the step (`tokens` x
    top-k, all micro-batches), 2 x slots x in x out FLOPs per (E, out, in) tensor. A tensor that
    crossed over (`crossed`) keeps its gradient and computes none; a tensor that is not a batched
    (E, out, in) weight is not counted."""
    slots = tokens * top_k
    return sum(
        2 * slots * t.expert_shape[1] * t.expert_shape[2]
        for layer in layers
        for t in layer.tensors
        if t.role != "bias" and len(t.expert_shape) == 3 and t.name not in crossed
    )
