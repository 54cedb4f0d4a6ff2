"""Shared test helpers: tiny models, fixed batches, and exact comparisons of training state."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy
import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn

from sonar_fx.config import AdamWConfig
from sonar_fx.methods import TrainingMethod, build_method
from sonar_fx.models import build_model
from sonar_fx.workload import random_batches

# lr large enough that bf16 weights visibly move in 3 steps; small clip so clipping is active.
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)


batches = random_batches  # vocab 259: the byte tokenizer's size, the tiny models' vocab


def trained(
    method: str, model_name: str, dtype: torch.dtype, steps: int = 3, cfg: AdamWConfig = CFG, **kwargs
) -> tuple[nn.Module, TrainingMethod]:
    model = build_model(model_name, dtype=dtype, seed=0)
    m = build_method(method, model, cfg, **kwargs)
    for b in batches(steps):
        m.train_step(b)
    return model, m


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    diff = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def weights_differ(a: nn.Module, b: nn.Module) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p, pb[n])]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The batched expert tensors of a tiny model, by name (the same list for a Sonar model and its twin)."""
    return [p for n, p in model.named_parameters() if ".experts." in n]


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".experts." not in n]


def train_with_side_backwards(model: nn.Module, data: list[dict], step: Callable[[], None]) -> None:
    """One step per batch, each through backwards that plain torch keeps off some experts' `.grad`:
    batch 0, a side `torch.autograd.grad` of the first parameter (the embedding), then the ordinary
    backward; batch 1, `backward(inputs=dense + the first expert tensor)`; later batches,
    `backward(inputs=dense)`. `step()`: the optimizer step and zero_grad (and the twin's clip)."""
    first = next(iter(model.parameters()))
    for i, batch in enumerate(data):
        if i == 0:
            torch.autograd.grad(model(**batch).loss, [first])
            model(**batch).loss.backward()
        else:
            inputs = dense_params(model) + (expert_params(model)[:1] if i == 1 else [])
            model(**batch).loss.backward(inputs=inputs)
        step()


def side_backwards_twin(
    data: list[dict], name: str = "tiny-reference", compile_with: str | None = None, cfg: AdamWConfig = CFG
) -> nn.Module:
    """Plain torch trained by `train_with_side_backwards`: AdamW(fused=True), the dense gradients
    clipped; `compile_with`: a torch.compile backend for the twin (None: eager)."""
    twin = build_model(name, seed=0)
    hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    opt = torch.optim.AdamW(twin.parameters(), fused=True, **hyper)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(dense_params(twin), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()

    runner = twin if compile_with is None else torch.compile(twin, backend=compile_with)
    train_with_side_backwards(runner, data, step)
    return twin


def flip_a_byte_of_tensor_data(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor record of a torch.save zip (stored, not
    compressed), as a bad disk or a bad copy would."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with path.open("r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


# ------------------------------------------------ library versions other than the suite's own
# `make test-gpu-versions` runs the fast tier on the GPU image's transformers and triton. What those
# releases cannot do is a fact of the library, named here once; each reason says why the GPU check
# (bf16 compiles on CUDA, compared with a twin compiled the same way) never meets it.

_TRANSFORMERS_BEFORE_5_18 = Version(transformers.__version__) < Version("5.18")


def _fallback_backward_traced() -> bool:
    """transformers' grouped-mm fallback op whose backward is plain Python (`offs.tolist()`) rather than
    an opaque op of its own: AOTAutograd cannot trace it (DataDependentOutputException)."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers' ops)

    ops = torch.ops.transformers
    return hasattr(ops, "grouped_mm_fallback") and not hasattr(ops, "grouped_mm_fallback_backward")


def _interpreter_refuses_numpy() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return Version(triton.__version__) < Version("3.7") and Version(numpy.__version__) >= Version("2.4")


_FALLBACK_TRACED = _fallback_backward_traced()
# Model types whose model transformers < 5.18 cannot run a forward of / whose experts discovery misses.
_FORWARD_BROKEN = {
    "doge": "transformers < 5.18's Doge passes its MoE block's (hidden, router_logits) tuple to dropout: "
    "no forward runs, with sonar-fx or without",
}
_DISCOVERY_MISSES = {
    "aria_text": "transformers < 5.18's Aria keeps each expert projection in its own AriaGroupedExpertsGemm "
    "whose count is named `groups` (never read as an expert count): pass its experts explicitly",
}


def known_library_failure(
    *,
    grouped_mm_compiled: torch.dtype | None = None,
    compiled_vs_eager: bool = False,
    forward_of: str | None = None,
    discovery_of: str | None = None,
    triton_interpreter: bool = False,
) -> pytest.MarkDecorator:
    """A strict xfail for a test that the installed transformers or triton cannot pass, else a no-op mark.

    The facts of the test: grouped_mm_compiled, the dtype of the expert weights it compiles through
    transformers' grouped_mm experts (the tiny models' default); compiled_vs_eager, it compares a
    compiled run with an eager one bitwise; forward_of / discovery_of, the model type it runs / discovers;
    triton_interpreter, it runs Triton kernels under TRITON_INTERPRET=1. Use as a decorator, in
    `pytest.param(marks=...)`, or `request.applymarker(...)` where the facts are the test's parameters.
    """
    reasons = []
    if grouped_mm_compiled not in (None, torch.bfloat16) and _FALLBACK_TRACED:
        reasons.append(
            f"transformers {transformers.__version__} takes its grouped-mm fallback under torch.compile for "
            "non-bf16 expert weights (on every device) and traces its backward's offs.tolist(), which "
            "AOTAutograd cannot: the graph falls back to eager hooks. The GPU check compiles bf16, where "
            "transformers calls torch's grouped_mm (CUDA sm80+, the H200 is sm90)"
        )
    if compiled_vs_eager and _TRANSFORMERS_BEFORE_5_18:
        reasons.append(
            "transformers < 5.18 materializes the causal mask under torch.compile and passes none in eager "
            "(SDPA's is_causal), so compiled attention rounds otherwise than the eager twin on every "
            "device; the pass stays exact against a twin compiled the same way, which the GPU check uses"
        )
    if _TRANSFORMERS_BEFORE_5_18:
        reasons += [_FORWARD_BROKEN[t] for t in [forward_of] if t in _FORWARD_BROKEN]
        reasons += [_DISCOVERY_MISSES[t] for t in [discovery_of] if t in _DISCOVERY_MISSES]
    if triton_interpreter and _interpreter_refuses_numpy():
        reasons.append(
            "Triton < 3.7's interpreter converts a 1-element array with int(), which numpy >= 2.4 refuses "
            "(Triton issue 9171, fixed in 3.7); only TRITON_INTERPRET=1 interprets: on a GPU Triton compiles"
        )
    return pytest.mark.xfail(bool(reasons), reason="; ".join(reasons) or "-", strict=True)
