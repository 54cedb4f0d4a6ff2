"""What the benchmarks train: CPU-sized models shaped like OLMoE and Granite, and how big a batch.

The shapes keep each architecture's real transformers classes and its expert count and top-k (OLMoE
E=64, Granite E=40, both top-8) at widths two CPU cores can step through in well under a second.
Batch 2 with 64-token sequences keeps expert gradients far above activations, the regime of the paper
(OLMoE-1B-7B at batch 2, seq <= 256: 805 MB of bf16 expert gradients per layer, many times what a
layer's activations take). The data is `sonar_fx.workload`'s: the built-in synthetic instruction set
packed into fixed (batch, seq) windows, so every arm sees the same tokens and no compiled graph ever
sees a new shape. This module never measures anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from sonar_fx.models import build_model


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """An MoE model built from a transformers class with these dimensions and random weights."""

    name: str
    """Label in tables."""
    base: str
    """`sonar_fx.models.TINY_MODELS` entry whose class and defaults it starts from."""
    experts: int
    """E: experts per layer."""
    top_k: int
    hidden: int
    """d: model width."""
    intermediate: int
    """n: expert hidden width."""
    layers: int
    heads: int
    kv_heads: int

    def overrides(self) -> dict[str, Any]:
        # OLMoE calls it num_experts, GraniteMoe num_local_experts.
        experts_key = "num_experts" if self.base == "tiny-olmoe" else "num_local_experts"
        return {
            experts_key: self.experts,
            "num_experts_per_tok": self.top_k,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
        }

    def build(self, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
        """Same seed, same weights: every arm of a comparison starts from identical parameters."""
        return build_model(self.base, dtype=dtype, seed=seed, **self.overrides())

    def describe(self) -> str:
        return (
            f"{self.name}: E={self.experts} top-{self.top_k}, d={self.hidden}, n={self.intermediate}, "
            f"L={self.layers}, heads {self.heads}/{self.kv_heads} kv"
        )


OLMOE_CPU = ModelShape(
    name="olmoe-cpu",
    base="tiny-olmoe",
    experts=64,
    top_k=8,
    hidden=384,
    intermediate=192,
    layers=4,
    heads=6,
    kv_heads=6,
)


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        OLMOE_CPU,
        # n = d/2 rather than Granite's d/3: at d=512 that keeps expert gradients as dominant over
        # activations as they are at full width (d=1536), which is the regime the paper measures.
        ModelShape(
            name="granite-cpu", base="tiny-granitemoe", experts=40, top_k=8, hidden=512, intermediate=256,
            layers=4, heads=8, kv_heads=2,
        ),
        # olmoe-cpu with fewer experts per rank than top-k under expert parallelism on 2 ranks
        # (`distributed_deferred --plan --shape`): 8 experts of top-8 (4 per rank, every token's slots
        # reach both ranks), and as many experts as ranks (2 of top-2: one expert per rank).
        replace(OLMOE_CPU, name="olmoe-cpu-8e", experts=8, top_k=8),
        replace(OLMOE_CPU, name="olmoe-cpu-2e", experts=2, top_k=2),
        # Small enough for smoke tests: seconds per arm, compiled or not.
        ModelShape(
            name="olmoe-micro", base="tiny-olmoe", experts=8, top_k=2, hidden=32, intermediate=16,
            layers=2, heads=2, kv_heads=2,
        ),
    )
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The batches one arm trains on."""

    batch: int = 2
    seq: int = 64
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq
