"""Expert kernel backends on a CUDA GPU: compiled Triton scattermoe kernels and the real sonic-moe.

Every test here skips without CUDA (and sonic-moe's without the package or a Hopper+ GPU), so the CPU
suite reports them as skipped, never as failed. The CPU suite checks the same claims with the Triton
interpreter and a sonic-moe stub; these check the real kernels. fp32 tolerances depend on the path:
the project's Triton kernels multiply fp32 in IEEE (torch's TF32 switch is off by default), upstream
ScatterMoE hard-codes TF32; sonic-moe has no fp32 path at all (bf16 only here).

`--gpu-device cpu` (the rehearsal of scripts/gpu_check.sh) runs this code on CPU: smaller shapes, fp32
(Triton's interpreter has no bf16 dot), scattermoe interpreted; what it verifies is the test's own
code, not the GPU kernels.
"""

from __future__ import annotations

import os
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

pytestmark = pytest.mark.gpu
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


def on_device(device: torch.device, dtype: torch.dtype, monkeypatch) -> None:
    """CUDA: compiled Triton kernels. CPU (the rehearsal): Triton interpreted, which computes fp32 only."""
    if device.type == "cuda":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return
    if dtype != torch.float32:
        pytest.skip("Triton's interpreter computes fp32 only: this case runs on a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _compare(
    backend: str, dtype: torch.dtype, layout: ExpertLayout, device: torch.device, monkeypatch
) -> None:
    on_device(device, dtype, monkeypatch)
    shape = dict(t=256, k=4, e=9, d=96, n=80) if device.type == "cuda" else {}
    leaves, index_Tk = problem(layout, dtype, **shape)
    leaves = [x.detach().to(device).requires_grad_() for x in leaves]
    got = forward_backward(
        lambda *a: experts_forward(backend, *a, layout=layout), leaves, index_Tk.to(device)
    )
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    want = forward_backward(
        lambda *a: experts_forward_ref(*a, layout=layout), ref_leaves, index_Tk.to(device)
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance(backend, dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scattermoe_gpu_matches_reference(dtype, layout, gpu_device, monkeypatch):
    _compare("scattermoe", dtype, layout, gpu_device, monkeypatch)


@needs_sonicmoe
@pytest.mark.parametrize(
    "layout",
    [ExpertLayout(), ExpertLayout(gate_up="interleaved"), ExpertLayout(activation="gelu_tanh")],
)
def test_sonicmoe_gpu_matches_reference(layout, gpu_device, monkeypatch):
    _compare("sonicmoe", torch.bfloat16, layout, gpu_device, monkeypatch)


@needs_sonicmoe
def test_sonicmoe_gpu_refuses_fp32_before_any_kernel_runs():
    with torch.device("cuda"):
        model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    with pytest.raises(BackendUnavailableError, match="fp16 or bf16"):
        use_kernel_backend(model, "sonicmoe")


def rehearsed(compiler: str, device: torch.device) -> str:
    """The compiler a compiled case runs with: inductor, except on CPU when REHEARSE_COMPILER names
    another (the suite's rehearsal sets aot_eager: on CPU inductor generates C++, not the GPU's Triton
    kernels, so what the rehearsal verifies, this test's own code, runs the same without C++ codegen;
    `make gpu-rehearsal` keeps inductor). tests/test_kernels.py checks the CPU claim under aot_eager."""
    if device.type == "cpu" and compiler == "inductor":
        return os.environ.get("REHEARSE_COMPILER", compiler)
    return compiler


def _trained(backend: str, method: str, compiler: str, device: torch.device, dtype: torch.dtype):
    torch._dynamo.reset()
    with torch.device(device):
        model = build_model("tiny-olmoe", dtype=dtype, seed=0, attn_implementation="eager")
    use_kernel_backend(model, backend)
    run = build_method(method, model, CFG, compiler=compiler)
    for batch in batches(3):
        run.train_step({k: v.to(device) for k, v in batch.items()})
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
def test_gpu_sonar_is_bitwise_standard_no_expert_clip_with_the_same_backend(
    backend, compiler, gpu_device, monkeypatch
):
    dtype = torch.bfloat16 if gpu_device.type == "cuda" else torch.float32
    on_device(gpu_device, dtype, monkeypatch)
    compiler = rehearsed(compiler, gpu_device)
    sonar, run = _trained(backend, "sonar", compiler, gpu_device, dtype)
    twin, _ = _trained(backend, "standard_no_expert_clip", compiler, gpu_device, dtype)
    assert_same_weights(sonar, twin)
    if compiler != "eager":
        assert run.optimizer.report()["updates_by_hook"] == 0
