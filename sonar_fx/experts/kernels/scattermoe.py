"""The `scattermoe` backend: ScatterMoE's scatter-to-scatter expert GEMMs as `torch.library` ops.

Legend: see `base.py`; `expert_S` / `order_S` are the stable sort of the flat top-k indices (sorted
expert of slot i, and its token-major index), `fan_out` = k when x has one row per token.
Two custom ops, each traced by torch.compile as one node:
- `sonar_fx::scatter_mm(x, w_EKN, expert_S, order_S, fan_out, x_grouped, y_grouped) -> y`
  (forward GEMM and, with w transposed, the input gradient);
- `sonar_fx::scatter_group_xty(x, dy, expert_S, order_S, fan_out, x_grouped, dy_grouped, E,
  dw_transposed) -> dw_EKN` (the weight gradient: the node the graph pass finds in the AOT backward).
  The kernel writes the gradient straight into the buffer this op returns, in the parameter's layout:
  one weight-gradient buffer, never a second copy.
`scatter_mm` registers its autograd, so the backward graph holds exactly these two ops per GEMM.
Under `schedule="deferred"` the eager backward computes no `scatter_group_xty`: it hands the op's
operands (x, dy and the routing) to the weight's owner, which runs the op at `step()` (`deferral.py`);
compiled, the graph pass makes the same recipe of the node.

The kernels are the project's own (`triton_kernels.py`). When the upstream `scattermoe` package
(github shawntan/scattermoe) is installed with the API this adapter knows, its kernels run inside the
same ops instead, with two differences stated here:
- Import side effects: the package's `__init__` imports `scattermoe.utils.replace_moe`, which patches
  transformers classes (GptOss experts, GraniteMoeHybrid MoE) process-wide. So only the kernel file
  `scattermoe/kernels/ops.py` is loaded, by path, without running the package's `__init__`; it is
  registered as `scattermoe.kernels.ops`, so a later `import scattermoe` by the user reuses it rather
  than registering its `scattermoe::*` ops twice. Nothing else of the package runs, no class is patched.
- TF32: upstream (0.3.0) hard-codes `ALLOW_TF32 = True`, so its fp32 GEMMs run in TF32 (~1e-3
  relative error) whatever `torch.backends.cuda.matmul.allow_tf32` says; the project's kernels follow
  torch's switch (off by default: IEEE fp32). `fp32_matmul_precision()` says which applies.
Nothing here copies or updates a weight.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from sonar_fx.experts.kernels.base import BackendUnavailableError, ExpertLayout, Glu
from sonar_fx.experts.kernels.deferral import defer_weight_grad

UPSTREAM_MODULE = "scattermoe.kernels.ops"
# Parameters this adapter passes to each upstream function (and that must be all it requires).
_UPSTREAM_CALLS = {
    "scatter2scatter": {
        *("X", "W", "sorted_expert_idxs", "sorted_scattered_idxs", "k", "x_grouped", "y_grouped"),
    },
    "group": {"A", "sorted_expert_idxs", "fan_out"},
    "groupXtY_compileable": {"E", "DW", "Db", "DY", "X", "expert_offsets"},
}


@cache
def upstream_ops() -> ModuleType | None:
    """Upstream `scattermoe.kernels.ops`, loaded without the package's side effects; None when absent.

    A package whose kernel functions take other parameters than this adapter passes is not used
    (warned once): the project's own kernels run instead, which compute the same op.
    """
    ops = sys.modules.get(UPSTREAM_MODULE)  # imported already (by the user): its effects are theirs
    if ops is None:
        ops = _load_kernels_only()
    if ops is None:
        return None
    for name, passed in _UPSTREAM_CALLS.items():
        accepted, required = _parameters(getattr(ops, name, None))
        if not (required <= passed <= accepted):
            warnings.warn(
                f"scattermoe is installed but {UPSTREAM_MODULE}.{name} takes {sorted(accepted)} "
                f"(requires {sorted(required)}), not the {sorted(passed)} this adapter passes; "
                "sonar-fx runs its own ScatterMoE kernels instead.",
                stacklevel=2,
            )
            return None
    return ops


def _load_kernels_only() -> ModuleType | None:
    """Execute only `scattermoe/kernels/ops.py` (it imports torch and triton alone), by path."""
    spec = importlib.util.find_spec("scattermoe")  # finds the package without executing its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "kernels" / "ops.py"
    file_spec = importlib.util.spec_from_file_location(UPSTREAM_MODULE, path)
    if not path.is_file() or file_spec is None or file_spec.loader is None:
        warnings.warn(f"scattermoe is installed without {path}; sonar-fx runs its own kernels.", stacklevel=3)
        return None
    ops = importlib.util.module_from_spec(file_spec)
    sys.modules[UPSTREAM_MODULE] = ops
    try:
        file_spec.loader.exec_module(ops)
    except Exception as err:
        del sys.modules[UPSTREAM_MODULE]
        warnings.warn(
            f"scattermoe's kernels failed to load ({type(err).__name__}: {err}); sonar-fx runs its own.",
            stacklevel=3,
        )
        return None
    return ops


def _parameters(fn: object) -> tuple[set[str], set[str]]:
    """(accepted, required) parameter names of a function or a `torch.library` custom op."""
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    if schema is not None:
        args = schema.arguments
        return {a.name for a in args}, {a.name for a in args if not a.has_default_value()}
    if not callable(fn):
        return set(), set()
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params}, {p.name for p in params if p.default is inspect.Parameter.empty}


def implementation() -> str:
    """Which kernels the scattermoe backend runs: "upstream" (package `scattermoe`) or "sonar_fx"."""
    return "upstream" if upstream_ops() is not None else "sonar_fx"


def fp32_matmul_precision() -> Literal["tf32", "ieee"]:
    """How the scattermoe backend's kernels multiply fp32 on a GPU right now (see the module docstring)."""
    ops = upstream_ops()
    if ops is not None:
        return "tf32" if getattr(ops, "ALLOW_TF32", False) else "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@torch.library.custom_op("sonar_fx::scatter_mm", mutates_args=())
def scatter_mm(
    x: Tensor,
    w_EKN: Tensor,
    expert_S: Tensor,
    order_S: Tensor,
    fan_out: int,
    x_grouped: bool,
    y_grouped: bool,
) -> Tensor:
    """(S, N): row out_row(i) = x[in_row(i)] @ w_EKN[expert_S[i]] (see `triton_kernels.py`)."""
    ops = upstream_ops()
    if ops is not None:
        return ops.scatter2scatter(
            X=x, W=w_EKN, sorted_expert_idxs=expert_S, sorted_scattered_idxs=order_S, k=fan_out,
            x_grouped=x_grouped, y_grouped=y_grouped,
        )  # fmt: skip
    from sonar_fx.experts.kernels.triton_kernels import scatter_mm_into

    y = x.new_empty(order_S.shape[0], w_EKN.shape[2])
    scatter_mm_into(y, x, w_EKN, expert_S, order_S, fan_out, x_grouped, y_grouped)
    return y


@scatter_mm.register_fake
def _scatter_mm_fake(x, w_EKN, expert_S, order_S, fan_out, x_grouped, y_grouped) -> Tensor:
    return x.new_empty(order_S.shape[0], w_EKN.shape[2])


@torch.library.custom_op("sonar_fx::scatter_group_xty", mutates_args=())
def scatter_group_xty(
    x: Tensor,
    dy: Tensor,
    expert_S: Tensor,
    order_S: Tensor,
    fan_out: int,
    x_grouped: bool,
    dy_grouped: bool,
    num_experts: int,
    dw_transposed: bool,
) -> Tensor:
    """dw_EKN[e] = sum over slots of e of x[in_row]^T dy[out_row]; strides follow `dw_transposed`.

    `dw_transposed=True` stores dw as the transpose of a contiguous (E, N, K) tensor: the layout of
    the parameter when the forward received `param.transpose(1, 2)`, so the gradient reaches the
    optimizer in the parameter's own layout without a copy.
    """
    dw_EKN = _new_dw(x, dy, num_experts, dw_transposed)
    ops = upstream_ops()
    if ops is not None:
        x_g = x if x_grouped else ops.group(A=x, sorted_expert_idxs=order_S, fan_out=fan_out)
        dy_g = dy if dy_grouped else ops.group(A=dy, sorted_expert_idxs=order_S, fan_out=1)
        ends_E = torch.bincount(expert_S, minlength=num_experts).cumsum(0)
        # Upstream's kernel takes any output strides and skips experts without a token: zero our own
        # buffer and let it write there (its `group_bwd_W` would allocate a second, full-size one).
        ops.groupXtY_compileable(
            E=num_experts, DW=dw_EKN.zero_(), Db=None, DY=dy_g, X=x_g, expert_offsets=ends_E
        )
        return dw_EKN
    from sonar_fx.experts.kernels.triton_kernels import group_xty_into

    group_xty_into(dw_EKN, x, dy, expert_S, order_S, fan_out, x_grouped, dy_grouped)
    return dw_EKN


@scatter_group_xty.register_fake
def _scatter_group_xty_fake(
    x, dy, expert_S, order_S, fan_out, x_grouped, dy_grouped, num_experts, dw_transposed
) -> Tensor:
    return _new_dw(x, dy, num_experts, dw_transposed)


def _new_dw(x: Tensor, dy: Tensor, num_experts: int, transposed: bool) -> Tensor:
    k_in, n_out = x.shape[1], dy.shape[1]
    if transposed:
        return x.new_empty(num_experts, n_out, k_in).transpose(1, 2)
    return x.new_empty(num_experts, k_in, n_out)


def _setup_context(ctx, inputs, output) -> None:
    x, w_EKN, expert_S, order_S, fan_out, x_grouped, y_grouped = inputs
    ctx.save_for_backward(x, w_EKN, expert_S, order_S)
    ctx.fan_out, ctx.x_grouped, ctx.y_grouped = fan_out, x_grouped, y_grouped
    # The parameter is (E, N, K) when the forward got its transpose: keep dw in the parameter's layout.
    ctx.dw_transposed = w_EKN.stride(1) < w_EKN.stride(2)


def _backward(ctx, dy: Tensor):
    x, w_EKN, expert_S, order_S = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dw_EKN = None
    if ctx.needs_input_grad[0]:
        # dx[in_row(i)] += dy[out_row(i)] @ w[e]^T: the same kernel with roles swapped; for a token-major
        # x (fan_out k) it lands in token-major slot order, then the k copies of each token are summed.
        dx = scatter_mm(dy, w_EKN.transpose(1, 2), expert_S, order_S, 1, ctx.y_grouped, ctx.x_grouped)
        if not ctx.x_grouped and ctx.fan_out > 1:
            dx = dx.view(x.shape[0], ctx.fan_out, -1).sum(dim=1)
    if ctx.needs_input_grad[1]:
        args = (
            x, dy, expert_S, order_S, ctx.fan_out, ctx.x_grouped, ctx.y_grouped, w_EKN.shape[0],
            ctx.dw_transposed,
        )  # fmt: skip
        # schedule="deferred": the owner keeps (x, dy, routing) and runs this op at step() instead.
        if not defer_weight_grad(w_EKN, torch.ops.sonar_fx.scatter_group_xty.default, args):
            dw_EKN = scatter_group_xty(*args)
    return dx, dw_EKN, None, None, None, None, None


scatter_mm.register_autograd(_backward, setup_context=_setup_context)


def scattermoe_forward(
    hidden_Td: Tensor,
    index_Tk: Tensor,
    weights_Tk: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    layout: ExpertLayout,
    glu: Glu | None,
) -> Tensor:
    """The expert block with two scatter GEMMs: token rows in, token-major slot rows out."""
    t, k = index_Tk.shape
    # The ops take (E, in, out): the transpose of transformers' (E, out, in) weights, as a view.
    w_up_EdN = w_up if layout.transposed else w_up.transpose(1, 2)
    w_down_End = w_down if layout.transposed else w_down.transpose(1, 2)
    expert_S, order_S = torch.sort(index_Tk.reshape(-1), stable=True)
    x_Td = hidden_Td.to(w_up.dtype)
    h_S2n = scatter_mm(x_Td, w_up_EdN, expert_S, order_S, k, False, True)
    a_Sn = glu(h_S2n) if glu is not None else layout.glu(h_S2n)
    y_Skd = scatter_mm(a_Sn, w_down_End, expert_S, order_S, 1, True, False)
    out_Td = (y_Skd.view(t, k, -1) * weights_Tk.unsqueeze(-1)).sum(dim=1)
    return out_Td.to(hidden_Td.dtype)


def check_scattermoe(device: torch.device, dtype: torch.dtype) -> None:
    """Triton must be importable; CPU needs Triton's interpreter (fp32 only: its bf16 dot is broken),
    and upstream kernels need it switched on before `triton.language` was imported."""
    try:
        import triton
    except ImportError as err:
        raise BackendUnavailableError(
            "The scattermoe backend needs triton: pip install 'sonar-fx[scattermoe]'."
        ) from err
    if device.type == "cuda":
        return
    if device.type != "cpu" or not triton.knobs.runtime.interpret:
        raise BackendUnavailableError(
            f"The scattermoe backend runs Triton kernels on CUDA; on {device.type} it runs only on CPU under "
            "Triton's interpreter: set TRITON_INTERPRET=1 (slow, for tests) or use kernel backend 'torch'."
        )
    if dtype != torch.float32:
        raise BackendUnavailableError(
            f"Triton's interpreter computes scattermoe in fp32 only (got {dtype}); use fp32 or a GPU."
        )
    if upstream_ops() is not None and not language_interpreted():
        # Upstream kernels call triton.language's own jitted helpers, which are bound to interpreter or
        # compiler once, when triton.language is imported (torch._dynamo imports it).
        raise BackendUnavailableError(
            "The upstream scattermoe kernels need Triton's interpreter chosen before triton is imported "
            "(torch imports it): start Python with TRITON_INTERPRET=1 set, or use a GPU."
        )


def language_interpreted() -> bool:
    """Whether triton.language was imported under the interpreter (its jitted helpers are bound then)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)
