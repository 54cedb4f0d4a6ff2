"""The project's own Triton kernels for the ScatterMoE algorithm, and their launchers.

Legend: S routed slots sorted by expert (position i), E experts, K input and N output features;
`expert_S[i]` is slot i's expert, `order_S[i]` its index in token-major order (token = order // k).
Two kernels:
- `scatter_mm`: y[out_row(i)] = x[in_row(i)] @ w[expert_S[i]] for every sorted slot i, where
  in_row(i) = i if x is grouped else order_S[i] // fan_out, and out_row(i) = i if y is grouped else
  order_S[i]. Gathering and scattering happen inside the GEMM, so no grouped copy of x or y is made.
  Row blocks come from a padded schedule: each block of BLOCK_M sorted rows lies inside one expert,
  so a program loads one expert's weight tile.
- `group_xty`: dw[e] = sum over slots i of expert e of x[in_row(i)]^T dy[out_row(i)], one program
  per (expert, K tile, N tile), rows visited in order (deterministic: no atomics).
Accumulation is fp32; fp32 inputs use IEEE dot unless torch allows TF32 for matmuls.

This module imports triton; import it only when a scattermoe kernel runs. Kernels are jitted on first
use, separately for Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, fp32 only: its bf16 dot is
broken) and for compiled GPU code, so the variable takes effect when it is set, even after triton was
imported. That holds only because the kernels call builtins alone: triton.language's own jitted helpers
(tl.zeros, tl.cdiv, reductions) are fixed to one mode when triton is imported, so use tl.full and plain
integer arithmetic instead.
These functions compute; they never update weights or allocate per-step copies of them.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor


def _scatter_mm_body(
    x_ptr, w_ptr, y_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    K, N, E,
    FAN_OUT: tl.constexpr, X_GROUPED: tl.constexpr, Y_GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < E:  # padding blocks of the schedule have e == E
        start = tl.load(block_start_ptr + pid_m)
        end = tl.load(block_end_ptr + pid_m)
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < end
        order = tl.load(order_ptr + rows, mask=row_mask, other=0)
        in_rows = rows if X_GROUPED else order // FAN_OUT
        out_rows = rows if Y_GROUPED else order
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(
                x_ptr + in_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        y_ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _group_xty_body(
    x_ptr, dy_ptr, dw_ptr, order_ptr, expert_start_ptr, expert_end_ptr,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    K, N,
    FAN_OUT: tl.constexpr, X_GROUPED: tl.constexpr, DY_GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    pid = tl.program_id(1)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    ks = (pid // n_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    col_mask = cols < N
    start = tl.load(expert_start_ptr + e)
    end = tl.load(expert_end_ptr + e)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < end
        order = tl.load(order_ptr + rows, mask=row_mask, other=0)
        in_rows = rows if X_GROUPED else order // FAN_OUT
        out_rows = rows if DY_GROUPED else order
        xt = tl.load(  # x^T tile (BLOCK_K, BLOCK_M), loaded transposed rather than transposed in registers
            x_ptr + ks[:, None] * stride_xk + in_rows[None, :] * stride_xm,
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )
        dy = tl.load(
            dy_ptr + out_rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def interpreting() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1, read now, not at import)."""
    return bool(triton.knobs.runtime.interpret)


@cache
def _jitted(interpret: bool) -> tuple[triton.JITFunction, triton.JITFunction]:
    # triton.jit picks interpreter or compiler when it decorates: `interpret` is part of the cache key
    # so the choice follows the environment variable at call time.
    assert interpreting() == interpret
    return triton.jit(_scatter_mm_body), triton.jit(_group_xty_body)


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 dot follows torch's TF32 switch (off by default: IEEE); other dtypes take Triton's default."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


# Explicit FMA contraction (Triton's default today), which also silences its "default will change" warning.
_OPTIONS = {"enable_fp_fusion": True}


def _launch_options() -> dict[str, bool]:
    return {} if interpreting() else _OPTIONS


def _tile(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))  # tl.dot needs every tile dim >= 16


def block_schedule(expert_S: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Padded row blocks: (expert, first row, end row) per block; each block lies inside one expert.

    cdiv(S, block_m) + E blocks always suffice; the unused tail has expert == E (skipped by the
    kernel), so the grid size never depends on the data and nothing syncs with the device.
    """
    s = expert_S.shape[0]
    counts_E = torch.bincount(expert_S, minlength=num_experts)
    ends_E = counts_E.cumsum(0)
    blocks_E = (counts_E + block_m - 1) // block_m
    block_ends_E = blocks_E.cumsum(0)
    b_B = torch.arange(triton.cdiv(s, block_m) + num_experts, device=expert_S.device)
    expert_B = torch.searchsorted(block_ends_E, b_B, right=True)
    e_B = expert_B.clamp(max=num_experts - 1)
    first_block_B = block_ends_E[e_B] - blocks_E[e_B]
    start_B = ends_E[e_B] - counts_E[e_B] + (b_B - first_block_B) * block_m
    return expert_B, start_B, ends_E[e_B]


def scatter_mm_into(
    y: Tensor, x: Tensor, w_EKN: Tensor, expert_S: Tensor, order_S: Tensor,
    fan_out: int, x_grouped: bool, y_grouped: bool,
) -> None:  # fmt: skip
    """Launch `scatter_mm` into `y` (see the module docstring); w_EKN may be any strided view."""
    scatter_kernel, _ = _jitted(interpreting())
    num_experts, k_in, n_out = w_EKN.shape
    block_m, block_n, block_k = 64, _tile(n_out, 128), _tile(k_in, 64)
    expert_B, start_B, end_B = block_schedule(expert_S, num_experts, block_m)
    grid = (expert_B.shape[0], triton.cdiv(n_out, block_n))
    scatter_kernel[grid](
        x, w_EKN, y, order_S, expert_B, start_B, end_B,
        x.stride(0), x.stride(1), *w_EKN.stride(), y.stride(0), y.stride(1),
        k_in, n_out, num_experts,
        FAN_OUT=fan_out, X_GROUPED=x_grouped, Y_GROUPED=y_grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype), **_launch_options(),
    )  # fmt: skip


def group_xty_into(
    dw_EKN: Tensor, x: Tensor, dy: Tensor, expert_S: Tensor, order_S: Tensor,
    fan_out: int, x_grouped: bool, dy_grouped: bool,
) -> None:  # fmt: skip
    """Launch `group_xty` into `dw_EKN` (any strides: it is written in the weight's own layout)."""
    _, xty_kernel = _jitted(interpreting())
    num_experts, k_in, n_out = dw_EKN.shape
    block_m, block_n, block_k = 64, _tile(n_out, 128), _tile(k_in, 64)
    counts_E = torch.bincount(expert_S, minlength=num_experts)
    ends_E = counts_E.cumsum(0)
    grid = (num_experts, triton.cdiv(k_in, block_k) * triton.cdiv(n_out, block_n))
    xty_kernel[grid](
        x, dy, dw_EKN, order_S, ends_E - counts_E, ends_E,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), *dw_EKN.stride(),
        k_in, n_out,
        FAN_OUT=fan_out, X_GROUPED=x_grouped, DY_GROUPED=dy_grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype), **_launch_options(),
    )  # fmt: skip


def compile_for_gpu(dtype: torch.dtype, capability: int = 90) -> dict[str, list[str]]:
    """Compile both kernels ahead of time for a CUDA arch (default sm_90) without a GPU.

    Triton ships ptxas, so this runs on a CPU machine and catches what the interpreter cannot: code
    that does not lower to GPU code. Returns the stages produced per kernel specialisation.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("compile_for_gpu builds GPU code: unset TRITON_INTERPRET first.")
    data = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    scatter_kernel, xty_kernel = _jitted(False)
    tiles = dict(FAN_OUT=8, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, PRECISION=_precision(dtype))
    variants = [
        (scatter_kernel, dict(tiles, X_GROUPED=False, Y_GROUPED=True)),
        (scatter_kernel, dict(tiles, FAN_OUT=1, X_GROUPED=True, Y_GROUPED=False)),
        (xty_kernel, dict(tiles, X_GROUPED=False, DY_GROUPED=True)),
        (xty_kernel, dict(tiles, FAN_OUT=1, X_GROUPED=True, DY_GROUPED=False)),
    ]
    stages = {}
    for kernel, constexprs in variants:
        signature = {
            name: "constexpr" if name in constexprs else data if name in _DATA_PTRS else "*i64"
            if name.endswith("_ptr") else "i32"
            for name in kernel.arg_names
        }  # fmt: skip
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", capability, 32),
            options=_OPTIONS,
        )
        stages[f"{kernel.__name__}{sorted(constexprs.items())}"] = list(compiled.asm)
    return stages


_DATA_PTRS = ("x_ptr", "w_ptr", "y_ptr", "dy_ptr", "dw_ptr")
