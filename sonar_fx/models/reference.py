"""The project's own plain-PyTorch MoE language model: the reference for tests and benchmarks.

Each layer is a residual top-k MoE block (softmax router, experts as two batched tensors
`gate_up_proj` (E, 2n, d) and `down_proj` (E, d, n), grouped GEMM) after a causal token mixer, so
the layout matches transformers' MoE experts. It is small on purpose; it never updates itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar_fx.experts.kernels import experts_forward


@dataclass(frozen=True, kw_only=True)
class ReferenceMoEConfig:
    """Shape of a `ReferenceMoEModel`."""

    vocab_size: int = 259
    """Token ids in [0, vocab_size); 259 fits the built-in byte tokenizer."""
    hidden_size: int = 32
    """d: model width."""
    intermediate_size: int = 16
    """n: expert hidden width (gate and up are n each)."""
    num_experts: int = 4
    """E: experts per layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    num_layers: int = 2
    """L: MoE layers."""
    kernel: str = "torch"
    """Expert kernel backend (`sonar_fx.experts.kernels.BACKENDS`); "torch" is the grouped GEMM below."""


@dataclass
class CausalLMOutput:
    loss: Tensor | None
    logits: Tensor


class ReferenceExperts(nn.Module):
    """E SwiGLU experts in two batched tensors, computed by a kernel backend (torch: grouped GEMMs)."""

    def __init__(self, cfg: ReferenceMoEConfig) -> None:
        super().__init__()
        e, n, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.num_experts = e
        self.kernel = cfg.kernel  # `use_kernel_backend(model, name)` switches it per model
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * n, d) * d**-0.5)
        self.down_proj = nn.Parameter(torch.randn(e, d, n) * n**-0.5)

    def forward(self, h_Td: Tensor, top_k_index_Tk: Tensor, top_k_weights_Tk: Tensor) -> Tensor:
        w_up, w_down = self.gate_up_proj, self.down_proj
        return experts_forward(self.kernel, h_Td, top_k_index_Tk, top_k_weights_Tk, w_up, w_down)


class ReferenceMoEBlock(nn.Module):
    """Softmax router, top-k, renormalised weights, experts."""

    def __init__(self, cfg: ReferenceMoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = ReferenceExperts(cfg)

    def forward(self, h_BTd: Tensor) -> Tensor:
        h_Td = h_BTd.reshape(-1, h_BTd.shape[-1])
        probs_TE = F.softmax(self.router(h_Td), dim=-1, dtype=torch.float32)
        weights_Tk, index_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        weights_Tk = (weights_Tk / weights_Tk.sum(-1, keepdim=True)).to(h_Td.dtype)
        return self.experts(h_Td, index_Tk, weights_Tk).reshape(h_BTd.shape)


class ReferenceLayer(nn.Module):
    def __init__(self, cfg: ReferenceMoEConfig) -> None:
        super().__init__()
        self.mix_norm = nn.RMSNorm(cfg.hidden_size)
        # Causal token mixing (a depthwise conv over time) so the model sees context.
        self.mix = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, 4, groups=cfg.hidden_size, padding=3)
        self.moe_norm = nn.RMSNorm(cfg.hidden_size)
        self.mlp = ReferenceMoEBlock(cfg)

    def forward(self, h_BTd: Tensor) -> Tensor:
        t = h_BTd.shape[1]
        mixed = self.mix(self.mix_norm(h_BTd).transpose(1, 2))[..., :t].transpose(1, 2)
        h_BTd = h_BTd + mixed
        return h_BTd + self.mlp(self.moe_norm(h_BTd))


class ReferenceMoEModel(nn.Module):
    """A causal LM with the `input_ids`/`labels` -> `.loss` interface of transformers models."""

    def __init__(self, cfg: ReferenceMoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ReferenceLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self, input_ids: Tensor, labels: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> CausalLMOutput:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutput(loss=loss, logits=logits)
