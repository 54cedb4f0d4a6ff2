"""The `torch` reference backend: sort by expert, grouped GEMM (`sonar_fx::grouped_mm`), unsort.

Legend: see `base.py` (T tokens, k per token, S = T*k slots, E experts, d width, n expert width).
It runs wherever torch runs (CPU and GPU, fp32 and bf16) and is the reference every other backend
is measured against. Every reduction is deterministic (no atomics over duplicate indices), so two
runs of the same step are bitwise equal on GPU too: the exactness checks depend on it. It never
copies a weight: layouts are views handed to the grouped GEMM.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_fx.experts.grouped import grouped_mm
from sonar_fx.experts.kernels.base import ExpertLayout, Glu


def expert_offsets(expert_S: Tensor, num_experts: int) -> Tensor:
    """int32 cumulative group ends of `expert_S` (sorted), with a static shape (E,) for compile."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_S.device)
    counts_E = counts_E.index_add_(0, expert_S, torch.ones_like(expert_S))
    return torch.cumsum(counts_E, 0).to(torch.int32)


def torch_forward(
    hidden_Td: Tensor,
    index_Tk: Tensor,
    weights_Tk: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    layout: ExpertLayout,
    glu: Glu | None,
) -> Tensor:
    """The expert block with grouped GEMMs; see `base.py` for the arguments."""
    t, k = index_Tk.shape
    w_up_E2nd, w_down_Edn = layout.out_in(w_up), layout.out_in(w_down)
    expert_S, perm_S = torch.sort(index_Tk.reshape(-1), stable=True)
    offs_E = expert_offsets(expert_S, w_up_E2nd.shape[0])
    # repeat_interleave then a gather with unique indices: its backward sums over k in a fixed order,
    # where `hidden_Td[perm_S // k]` would scatter-add duplicates (atomics on GPU, not reproducible).
    x_Sd = hidden_Td.to(w_up.dtype).repeat_interleave(k, dim=0)[perm_S]
    h_S2n = grouped_mm(x_Sd, w_up_E2nd, offs_E)
    a_Sn = glu(h_S2n) if glu is not None else layout.glu(h_S2n)
    y_Sd = grouped_mm(a_Sn, w_down_Edn, offs_E)
    y_Skd = torch.zeros_like(y_Sd).index_copy(0, perm_S, y_Sd)  # back to token order
    out_Td = (y_Skd.view(t, k, -1) * weights_Tk.unsqueeze(-1)).sum(dim=1)
    return out_Td.to(hidden_Td.dtype)


def check_torch(device: torch.device, dtype: torch.dtype) -> None:
    """The reference runs everywhere."""


def experts_forward_ref(
    hidden_Td: Tensor,
    index_Tk: Tensor,
    weights_Tk: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    layout: ExpertLayout,
    glu: Glu | None = None,
) -> Tensor:
    """The plainest statement of the expert block, in fp32: a loop over experts, no sorting or kernels.

    The yardstick for every backend (including `torch_forward`) in tests and the GPU check.
    """
    w_up_E2nd, w_down_Edn = layout.out_in(w_up).float(), layout.out_in(w_down).float()
    out_Td = hidden_Td.new_zeros(hidden_Td.shape, dtype=torch.float32)
    for e in range(w_up_E2nd.shape[0]):
        token_R, slot_R = (index_Tk == e).nonzero(as_tuple=True)
        h_R2n = hidden_Td[token_R].float() @ w_up_E2nd[e].T
        a_Rn = glu(h_R2n) if glu is not None else layout.glu(h_R2n)
        y_Rd = (a_Rn @ w_down_Edn[e].T) * weights_Tk[token_R, slot_R].float().unsqueeze(-1)
        out_Td = out_Td.index_add(0, token_R, y_Rd)
    return out_Td
