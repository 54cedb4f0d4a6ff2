"""What a CPU matrix-multiply kernel allocates beyond its output: measured on this host, per shape.

For: `sonar_fx.planner` planning a CPU step. A fake tensor's matmul allocates only its output, while
the real CPU kernel may also allocate scratch inside the op, and which kernel runs depends on the host:
on a CPU with AVX-512 (Intel Xeon), a bf16 `mm` runs oneDNN's matmul, whose scratchpad comes from
torch's CPU allocator (measured on torch 2.13: 50,944 bytes for a (128, k) x (k, 64) product with a
transposed left operand, 42,624 without); on a host without it (AMD EPYC before Zen 4) the same `mm`
allocates nothing more. No formula holds across oneDNN's kernels, so the bytes are measured: the op
runs once on zeros of the same shapes, strides and dtypes, and what it allocates beyond its output is
the scratch (0 where the kernel takes none). `torch._grouped_mm` runs one `mm` per group on CPU; the
tokens per group are data, so the measured call splits them evenly.
Never: run on fake tensors (the op is measured for real, outside every mode, once per shape); measure
an op other than the matrix multiplies below.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from sonar_fx.memory import measure_peak

aten = torch.ops.aten
MATMULS = frozenset(
    {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default}
)
"""The ops whose CPU kernels are measured (those a training step's linear layers and experts run)."""


def cpu_kernel_scratch(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Bytes the CPU kernel of `func(*args, **kwargs)` allocates and frees inside the op (0 for any op
    not in `MATMULS`); the arguments may be fake: only their shapes, strides and dtypes are read."""
    if func not in MATMULS or kwargs.get("out") is not None:
        return 0
    return _measured(func, _key(args), _key(tuple(sorted(kwargs.items()))))


def _key(values: Any) -> tuple[Any, ...]:
    """The arguments as a hashable description: a tensor by its shape, strides and dtype."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, Tensor):
            out.append((tuple(v.shape), v.stride(), v.dtype))
        elif isinstance(v, (tuple, list)):
            out.append(_key(v))
        else:
            out.append(v)
    return tuple(out)


@functools.cache
def _measured(func: Any, args: tuple[Any, ...], kwargs: tuple[Any, ...]) -> int:
    with _disable_current_modes():
        real = [_zeros(a) if _is_tensor_key(a) else a for a in args]
        named = {k: _zeros(v) if _is_tensor_key(v) else v for k, v in kwargs}
        if func is aten._grouped_mm.default:
            offs_at = 2 if len(real) > 2 else "offs"
            offs = real[offs_at] if isinstance(offs_at, int) else named.get(offs_at)
            if offs is not None:  # tokens per group are data: an even split
                offs = _even_offsets(real[0], real[1], offs.numel())
                if isinstance(offs_at, int):
                    real[offs_at] = offs
                else:
                    named[offs_at] = offs
        out, peak = measure_peak(lambda: func(*real, **named))
    return max(0, peak.peak_bytes - out.untyped_storage().nbytes())


def _is_tensor_key(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 3 and isinstance(v[2], torch.dtype)


def _zeros(key: tuple[Any, ...]) -> Tensor:
    shape, stride, dtype = key
    return torch.empty_strided(shape, stride, dtype=dtype).zero_()


def _even_offsets(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """`_grouped_mm`'s group ends, the grouped dimension split as evenly as it goes."""
    # Rows of `a` (tokens per expert), the shared dimension (a weight gradient), or columns of `b`.
    total = b.shape[1] if a.dim() == 3 else a.shape[0] if b.dim() == 3 else a.shape[1]
    size = math.ceil(total / groups)
    return torch.tensor([min(total, size * (i + 1)) for i in range(groups)], dtype=torch.int32)
