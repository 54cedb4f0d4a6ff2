"""Expert kernel backends on a CUDA GPU: compiled Triton scattermoe kernels and the real sonic-moe.

Every test here skips without CUDA (and sonic-moe's without the package or a Hopper+ GPU), so the CPU
suite reports them as skipped, never as failed. The CPU suite checks the same claims with the Triton
interpreter and a sonic-moe stub; these check the real kernels.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
from test_kernels import LAYOUTS, TOL, forward_backward, problem

from sonar_fx.experts.kernels import ExpertLayout, experts_forward, use_kernel_backend
from sonar_fx.experts.kernels.torch_backend import experts_forward_ref
from sonar_fx.methods import build_method
from sonar_fx.models import build_model

from helpers import CFG, assert_same_weights, batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed")


def _hopper_with_sonicmoe() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (9, 0):
        return "sonic-moe needs compute capability >= 9.0"
    if find_spec("sonicmoe") is None:
        return "sonic-moe is not installed: pip install 'sonar-fx[sonicmoe]'"
    return None


needs_sonicmoe = pytest.mark.skipif(_hopper_with_sonicmoe() is not None, reason=str(_hopper_with_sonicmoe()))
# Compiled GPU kernels: bf16 inputs with fp32 accumulation; fp32 uses IEEE dot (TF32 off by default).
GPU_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: TOL[torch.bfloat16]}


def _compare(backend: str, dtype: torch.dtype, layout: ExpertLayout, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    leaves, index_Tk = problem(layout, dtype, t=256, k=4, e=9, d=96, n=80)
    leaves = [x.detach().cuda().requires_grad_() for x in leaves]
    got = forward_backward(lambda *a: experts_forward(backend, *a, layout=layout), leaves, index_Tk.cuda())
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    want = forward_backward(lambda *a: experts_forward_ref(*a, layout=layout), ref_leaves, index_Tk.cuda())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **GPU_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scattermoe_gpu_matches_reference(dtype, layout, monkeypatch):
    _compare("scattermoe", dtype, layout, monkeypatch)


@needs_sonicmoe
@pytest.mark.parametrize("layout", [ExpertLayout(), ExpertLayout(gate_up="interleaved")])
def test_sonicmoe_gpu_matches_reference(layout, monkeypatch):
    _compare("sonicmoe", torch.bfloat16, layout, monkeypatch)


def _trained(backend: str, method: str, compiler: str):
    torch._dynamo.reset()
    with torch.device("cuda"):
        model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0, attn_implementation="eager")
    use_kernel_backend(model, backend)
    run = build_method(method, model, CFG, compiler=compiler)
    for batch in batches(3):
        run.train_step({k: v.cuda() for k, v in batch.items()})
    return model, run


@pytest.mark.parametrize(
    ("backend", "compiler"),
    [
        ("torch", "eager"),
        pytest.param("scattermoe", "eager", marks=needs_triton),
        pytest.param("scattermoe", "inductor", marks=[needs_triton, pytest.mark.slow]),
        pytest.param("sonicmoe", "eager", marks=needs_sonicmoe),
        pytest.param("sonicmoe", "inductor", marks=[needs_sonicmoe, pytest.mark.slow]),
    ],
)
def test_gpu_sonar_is_bitwise_standard_no_expert_clip_with_the_same_backend(backend, compiler, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sonar, run = _trained(backend, "sonar", compiler)
    twin, _ = _trained(backend, "standard_no_expert_clip", compiler)
    assert_same_weights(sonar, twin)
    if compiler != "eager":
        assert run.optimizer.report()["updates_by_hook"] == 0
