"""Expert kernel backends on a CUDA GPU: compiled Triton scattermoe kernels and the real sonic-moe.

Every test here skips without CUDA (and sonic-moe's without the package or a Hopper+ GPU), so the CPU
suite reports them as skipped, never as failed. The CPU suite checks the same claims with the Triton
interpreter and a sonic-moe stub; these check the real kernels. fp32 tolerances depend on the path:
the project's Triton kernels multiply fp32 in IEEE (torch's TF32 switch is off by default), upstream
ScatterMoE hard-codes TF32; sonic-moe has no fp32 path at all (bf16 only here).
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
from test_kernels import LAYOUTS, TOL, forward_backward, problem

from sonar_fx.experts.kernels import (
    BackendUnavailableError,
    ExpertLayout,
    experts_forward,
    use_kernel_backend,
)
from sonar_fx.experts.kernels.scattermoe import fp32_matmul_precision
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
# Compiled GPU kernels accumulate in fp32. "tf32": 3x the error of TF32-rounded operands emulated on CPU
# for this problem (max 1.4e-3 on outputs of magnitude ~2, 1.6e-2 on weight gradients of ~27).
GPU_TOL = {
    "ieee": dict(atol=1e-4, rtol=1e-4),
    "tf32": dict(atol=5e-2, rtol=1e-2),
    "bf16": TOL[torch.bfloat16],
}


def tolerance(backend: str, dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.bfloat16:
        return GPU_TOL["bf16"]
    precision = fp32_matmul_precision() if backend == "scattermoe" else "ieee"
    return GPU_TOL[precision]


def _compare(backend: str, dtype: torch.dtype, layout: ExpertLayout, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    leaves, index_Tk = problem(layout, dtype, t=256, k=4, e=9, d=96, n=80)
    leaves = [x.detach().cuda().requires_grad_() for x in leaves]
    got = forward_backward(lambda *a: experts_forward(backend, *a, layout=layout), leaves, index_Tk.cuda())
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    want = forward_backward(lambda *a: experts_forward_ref(*a, layout=layout), ref_leaves, index_Tk.cuda())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance(backend, dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scattermoe_gpu_matches_reference(dtype, layout, monkeypatch):
    _compare("scattermoe", dtype, layout, monkeypatch)


@needs_sonicmoe
@pytest.mark.parametrize(
    "layout",
    [ExpertLayout(), ExpertLayout(gate_up="interleaved"), ExpertLayout(activation="gelu_tanh")],
)
def test_sonicmoe_gpu_matches_reference(layout, monkeypatch):
    _compare("sonicmoe", torch.bfloat16, layout, monkeypatch)


@needs_sonicmoe
def test_sonicmoe_gpu_refuses_fp32_before_any_kernel_runs():
    with torch.device("cuda"):
        model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    with pytest.raises(BackendUnavailableError, match="fp16 or bf16"):
        use_kernel_backend(model, "sonicmoe")


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
