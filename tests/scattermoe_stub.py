"""An on-disk stand-in for the upstream `scattermoe` package (github shawntan/scattermoe, 0.3.0).

It has upstream's layout and its hazards: `scattermoe/__init__.py` patches a transformers class
when imported (upstream's `replace_moe` patches GptOss and GraniteMoeHybrid; this one patches
`OlmoeExperts.forward`, which the CPU tests run), `scattermoe/kernels/ops.py` has upstream's kernel
signatures (`scatter2scatter`, `group`, `group_bwd_W`, `groupXtY_compileable` writing into a DW it is
given and skipping experts without a token) and `ALLOW_TF32 = True`. The kernels are plain torch,
except that with STUB_TRITON=1 in the environment `group` runs a tiny Triton kernel that calls a
`triton.language` helper, as upstream's kernels do: under the interpreter it works only if
TRITON_INTERPRET=1 was set before triton was imported. Each execution of ops.py appends a line to
`loads.txt` beside it, and `ops.CALLS` / `ops.DW_WRITTEN` record what ran (keeping each DW alive, so
storages can be compared by address).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

INIT = '''
"""Stand-in for scattermoe/__init__.py: importing the package patches transformers (as upstream)."""
from transformers.models.olmoe import modeling_olmoe


def _patched_forward(self, *args, **kwargs):
    raise RuntimeError("OlmoeExperts.forward was replaced by the scattermoe package's import")


modeling_olmoe.OlmoeExperts.forward = _patched_forward
from . import kernels  # noqa: E402
'''

KERNELS_INIT = """
from . import ops
"""

OPS = '''
"""Stand-in for scattermoe/kernels/ops.py (upstream 0.3.0 signatures; plain torch kernels)."""
import os
from pathlib import Path

import torch

with open(Path(__file__).with_name("loads.txt"), "a") as f:
    f.write(__name__ + "\\n")

ALLOW_TF32 = True
CALLS = []
DW_WRITTEN = []


def scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, b=None, x_grouped=False,
                    y_grouped=False, out=None):
    CALLS.append("scatter2scatter")
    slots = torch.arange(sorted_scattered_idxs.numel())
    in_rows = slots if x_grouped else sorted_scattered_idxs // k
    out_rows = slots if y_grouped else sorted_scattered_idxs
    y = torch.einsum("sk,skn->sn", X[in_rows], W[sorted_expert_idxs])
    return torch.zeros_like(y).index_copy(0, out_rows, y)


def group(A, sorted_expert_idxs, coeff=None, fan_out=1, out=None):
    CALLS.append("group")
    rows = sorted_expert_idxs // fan_out
    if os.environ.get("STUB_TRITON") == "1":
        return _triton_gather(A, rows)
    return A[rows]


def group_bwd_W(DY, X, expert_offsets, E, has_bias=False):
    CALLS.append("group_bwd_W")
    DW = torch.zeros((E, DY.size(-1), X.size(-1)), dtype=DY.dtype).permute(0, 2, 1)
    groupXtY_compileable(E, DW, None, DY, X, expert_offsets)
    return DW, None


def groupXtY_compileable(E, DW, Db, DY, X, expert_offsets):
    CALLS.append("groupXtY")
    DW_WRITTEN.append(DW)
    start = 0
    for e, end in enumerate(expert_offsets.tolist()):
        if end > start:  # like upstream: an expert without a token is not written
            DW[e] = X[start:end].T @ DY[start:end]
        start = end


def _triton_gather(A, rows):
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src, idx, dst, K, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < tl.cdiv(K, 1) * 1  # a triton.language helper, as upstream's kernels call
        row = tl.load(idx + r)
        tl.store(dst + r * K + cols, tl.load(src + row * K + cols, mask=mask), mask=mask)

    A = A.contiguous()
    out = A.new_empty(rows.numel(), A.shape[1])
    gather[(rows.numel(),)](A, rows, out, A.shape[1], BLOCK=triton.next_power_of_2(A.shape[1]))
    return out
'''

FILES = {
    "scattermoe/__init__.py": INIT,
    "scattermoe/kernels/__init__.py": KERNELS_INIT,
    "scattermoe/kernels/ops.py": OPS,
}


def write(root: Path) -> Path:
    """Write the stand-in package under `root` (a folder to put on sys.path); returns `root`."""
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip())
    return root


def loads(root: Path) -> list[str]:
    """Module names ops.py was executed under, in order."""
    path = root / "scattermoe" / "kernels" / "loads.txt"
    return path.read_text().split() if path.exists() else []


def install(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the stand-in importable (NOT imported) for one test; `forget()` must run at teardown."""
    monkeypatch.syspath_prepend(str(write(root)))


def forget() -> None:
    """Drop every scattermoe module this process loaded, so the next test starts clean."""
    for name in [m for m in sys.modules if m == "scattermoe" or m.startswith("scattermoe.")]:
        del sys.modules[name]
