"""What every expert kernel backend shares: the weight layout, the GLU, the backend record, errors.

Legend: T tokens, k experts per token, S = T*k routed token-slots, E experts, d model width,
n expert width (gate and up are n each). A backend computes, for each token t,
    out_Td[t] = sum_j weights_Tk[t, j] * down_e(glu(up_e(hidden_Td[t])))   with e = index_Tk[t, j]
from the model's own batched weights. Layouts are read through views (a transpose, a strided
slice), never by copying a weight: the optimizer and the graph pass must see the parameters
themselves, and a per-step copy of every expert weight would cost the memory Sonar saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

GateUp = Literal["gate_first", "up_first", "interleaved"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact GELU, x * Phi(x) through erf
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # a different function: up to ~5e-4 apart
    "relu": F.relu,
}

Glu = Callable[[Tensor], Tensor]
"""(S, 2n) up-projection rows in the weight's row order -> (S, n) activations."""


class BackendUnavailableError(RuntimeError):
    """A kernel backend cannot run here (missing package, wrong device); the message names the fix."""


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """How a model stores its two batched expert weights."""

    gate_up: GateUp = "gate_first"
    """Row order of the 2n up-projection rows: [gate; up] (transformers), [up; gate] (ScatterMoE's
    GLUMLP takes the second half as the gate), or interleaved [g0, u0, g1, u1, ...] (sonic-moe default)."""
    transposed: bool = False
    """False: w_up (E, 2n, d) and w_down (E, d, n), i.e. (E, out, in). True: (E, in, out)."""
    activation: Activation = "silu"
    """Activation applied to the gate half (silu: SwiGLU, gelu: GeGLU with exact erf GELU, gelu_tanh:
    GeGLU with the tanh approximation of GELU, relu: ReGLU)."""

    def glu(self, h_S2n: Tensor) -> Tensor:
        """act(gate) * up, reading gate and up as views of `h_S2n` in this layout's row order."""
        if self.gate_up == "interleaved":
            gate_Sn, up_Sn = h_S2n[:, 0::2], h_S2n[:, 1::2]
        else:
            first_Sn, second_Sn = h_S2n.chunk(2, dim=-1)
            gate_Sn, up_Sn = (first_Sn, second_Sn) if self.gate_up == "gate_first" else (second_Sn, first_Sn)
        return ACTIVATIONS[self.activation](gate_Sn) * up_Sn

    def out_in(self, w: Tensor) -> Tensor:
        """The weight as an (E, out, in) view (no copy)."""
        return w.transpose(1, 2) if self.transposed else w


HF_LAYOUT = ExpertLayout()
"""transformers 5.x MoE experts: gate_up_proj (E, 2n, d) gate-first, down_proj (E, d, n), SwiGLU."""

Forward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, ExpertLayout, "Glu | None"], Tensor]
"""(hidden_Td, index_Tk, weights_Tk, w_up, w_down, layout, glu) -> out_Td."""
LayoutCheck = Callable[[ExpertLayout, "Glu | None"], None]
"""Raises ValueError (naming the fix) when a backend cannot compute this layout and gate function."""


def any_layout(layout: ExpertLayout, glu: Glu | None) -> None:
    """Backends that read every layout through views and run any gate function as given."""


@dataclass(frozen=True)
class KernelBackend:
    """One expert kernel backend, as the registry lists it."""

    name: str
    description: str
    forward: Forward
    check: Callable[[torch.device, torch.dtype], None]
    """Raises `BackendUnavailableError` (naming the fix) when the backend cannot run on this device/dtype."""
    weight_grad_ops: tuple[str, ...]
    """Custom ops whose outputs are the weight gradients in a backward graph (what the pass finds)."""
    check_layout: LayoutCheck = field(default=any_layout)
    """Checked for every experts module at selection, before the model is changed."""


def check_shapes(
    hidden_Td: Tensor, index_Tk: Tensor, weights_Tk: Tensor, w_up: Tensor, w_down: Tensor
) -> None:
    """Fail early, naming the mismatch, instead of deep inside a kernel."""
    if hidden_Td.dim() != 2 or index_Tk.dim() != 2 or index_Tk.shape != weights_Tk.shape:
        raise ValueError(
            "experts_forward takes hidden (T, d), top_k_index (T, k) and top_k_weights (T, k); got "
            f"{tuple(hidden_Td.shape)}, {tuple(index_Tk.shape)}, {tuple(weights_Tk.shape)}."
        )
    if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != w_down.shape[0]:
        raise ValueError(
            f"expert weights must be batched (E, ., .) tensors with the same E; got {tuple(w_up.shape)} "
            f"and {tuple(w_down.shape)}."
        )
