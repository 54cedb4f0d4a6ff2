"""The deferred schedule on the expert kernel backends: each backend's weight-gradient op is kept as a
recipe (its operands, not its gradient) and run at step(), eager and compiled, bitwise as plain torch.

The twin is plain torch on the same backend (`test_deferred.Twin`: fused AdamW, the clip over every
parameter, here 4 micro-batches per step). scattermoe runs its Triton kernels under the interpreter
(fp32), sonicmoe the plain-torch stub of its kernels (bf16), as in tests/test_kernels.py; the GPU test
at the end runs the real kernels and skips without CUDA. Micro-batches of 8 tokens keep every expert
tensor's kept operands below its gradient over the 4 micro-batches (no crossover), so the run also
shows the saving: the suite's saving guard would refuse a gradient kept whole or crossed over.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_kernels import INTERPRETED, activate
from test_kernels_gpu import needs_sonicmoe, needs_triton, on_device
from test_kernels_real_packages import upstream  # noqa: F401 (a fixture)

import sonar_fx
from sonar_fx.experts.kernels import get_backend, use_kernel_backend
from sonar_fx.experts.kernels.deferral import _views_to_param
from sonar_fx.experts.kernels.scattermoe import implementation
from sonar_fx.models import build_model
from sonar_fx.passes.recipe import Recipe

from helpers import assert_same_weights, batches, train_with_side_backwards, weights_differ
from test_deferred import MAX_NORM, Twin, cfg_for

ACCUM = 4
DTYPES = {"scattermoe": torch.float32, "sonicmoe": torch.bfloat16}  # the interpreter / the stub's GEMMs


def kernel_model(backend: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    with torch.device(device):
        # 4 experts: half the Triton programs of 8, and the kept operands still below every gradient
        model = build_model("tiny-olmoe", dtype=dtype, seed=0, num_experts=4)
    return use_kernel_backend(model, backend)


def recipe_ops(backend: str) -> set[str]:
    """The backend's weight-gradient ops as a recipe names them ("sonar_fx.scatter_group_xty.default")."""
    return {name.replace("::", ".") + ".default" for name in get_backend(backend).weight_grad_ops}


def expert_bytes(params: list[torch.Tensor]) -> tuple[int, int]:
    """(all the expert gradients' bytes, the largest one's)."""
    sizes = [p.numel() * p.element_size() for p in params]
    return sum(sizes), max(sizes)


def deferred_matches_plain_torch(
    backend: str, compiler: str, device: torch.device, dtype: torch.dtype, steps: int
) -> None:
    """Train the deferred schedule and its plain twin side by side, `steps` steps of ACCUM micro-batches;
    check the memory of the first step, and each step's expert gradients and weights."""
    torch._dynamo.reset()
    model, twin_model = (kernel_model(backend, dtype, device) for _ in range(2))
    sonar_fx.compile(model, cfg_for("all"), compiler=compiler, schedule="deferred")
    opt = model.sonar
    experts = list(opt.expert_group["params"])
    names = {opt.expert_name(p) for p in experts}
    twin = Twin(twin_model, names, "all", compiler)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(steps * ACCUM, batch=1, seq=8)]
    grad_bytes, biggest = expert_bytes(experts)
    totals = []
    for step in range(steps):
        for batch in data[step * ACCUM : (step + 1) * ACCUM]:
            model(**batch).loss.backward()
            twin.run(**batch).loss.backward()
        twin_params = dict(twin_model.named_parameters())
        twin_experts = [twin_params[opt.expert_name(p)] for p in experts]
        with torch.no_grad():  # the recipes' sum is autograd's .grad, bit for bit
            for p, twin_p in zip(experts, twin_experts, strict=True):
                assert torch.equal(opt.deferred.gradient(p, consume=False), twin_p.grad)
        if step == 0:  # every micro-batch's operands kept, no gradient: below what standard holds
            assert all(p.grad is None for p in experts)
            kept = opt.deferred.live_bytes
            assert 0 < kept < grad_bytes
            assert sum(p.grad.nbytes for p in twin_experts) == grad_bytes  # standard holds them all
            assert {Recipe.from_json(e.recipe).op for e in opt.deferred.entries()} == recipe_ops(backend)
            # Detached: a kept operand never holds the autograd graph upstream of it until step().
            assert all(not t.requires_grad for e in opt.deferred.entries() for t in e.operands)
        opt.step()
        opt.zero_grad()
        twin.step()
        totals.append(opt.grad_norms()["total"])
        if step == 0:  # at step(): one tensor's running sum and one recomputed piece at a time
            report = opt.report()
            assert report["deferred"]["kept_operand_peak"] == kept
            assert report["expert_grad_bytes"]["measured_peak"] == 2 * biggest < grad_bytes
        assert_same_weights(model, twin_model)
    assert all(t > MAX_NORM for t in totals), totals  # the clip over all parameters was active
    deferred = opt.report()["deferred"]
    assert deferred["kept_whole"] == [] and deferred["crossed_over"] == {}, deferred
    assert opt.report()["updates_deferred"] == steps * len(experts)
    # Not trivially equal: the experts trained (a run that never updated them would match nothing).
    assert names <= set(weights_differ(model, kernel_model(backend, dtype, device)))


SLOW = pytest.mark.slow  # over 10 s: the Triton interpreter; two aot_eager compiles
# Interpreted, each Triton launch costs about 0.2 s: scattermoe trains one step (its gradients compared
# bitwise, then its weights), the sonicmoe stub two.
CPU_CASES = [
    pytest.param("scattermoe", "eager", 1, marks=[INTERPRETED, SLOW]),
    pytest.param("scattermoe", "aot_eager", 1, marks=[INTERPRETED, SLOW]),
    ("sonicmoe", "eager", 2),
    pytest.param("sonicmoe", "aot_eager", 2, marks=SLOW),
]


@pytest.mark.parametrize(("backend", "compiler", "steps"), CPU_CASES)
def test_deferred_backend_is_plain_torch_and_keeps_operands_only(backend, compiler, steps, monkeypatch):
    activate(backend, monkeypatch)
    deferred_matches_plain_torch(backend, compiler, torch.device("cpu"), DTYPES[backend], steps)


@INTERPRETED
@pytest.mark.usefixtures("upstream")
def test_deferred_upstream_scattermoe_is_plain_torch():
    """With the scattermoe package installed its kernels run inside the same op, so the recipe re-runs
    upstream's groupXtY at step() (the stand-in package: plain torch kernels, upstream's signatures)."""
    deferred_matches_plain_torch("scattermoe", "eager", torch.device("cpu"), torch.float32, steps=2)
    assert implementation() == "upstream" and "groupXtY" in sys.modules["scattermoe.kernels.ops"].CALLS


def test_side_backwards_keep_only_what_plain_torch_accumulates(monkeypatch):
    """The eager hand-over asks autograd's engine, as the grouped-GEMM capture does, whether the running
    backward accumulates into the weight: `torch.autograd.grad` of the embedding and `backward(inputs=)`
    without an expert keep nothing for it (plain torch leaves its .grad alone)."""
    activate("sonicmoe", monkeypatch)
    model, twin_model = (kernel_model("sonicmoe", torch.bfloat16, torch.device("cpu")) for _ in range(2))
    sonar_fx.compile(model, cfg_for("all"), compiler="eager", schedule="deferred")
    opt = model.sonar
    twin = Twin(twin_model, {opt.expert_name(p) for p in opt.expert_group["params"]}, "all", "eager")
    data = batches(3, batch=1, seq=8)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    train_with_side_backwards(model, data, step)
    train_with_side_backwards(twin_model, data, twin.step)
    assert_same_weights(model, twin_model)
    assert opt.report()["deferred"]["kept_whole"] == []


def test_a_weight_read_through_another_view_is_left_to_autograd():
    """The eager hand-over knows the gradient's way back to the parameter for the parameter itself and
    its transpose only; any other view leaves dw to autograd (kept whole, and the saving guard says so)."""
    param = torch.zeros(3, 4, 5)
    assert _views_to_param(param, param) == []
    assert _views_to_param(param.transpose(1, 2), param) == [("aten.transpose.int", [-2, -1], {})]
    assert _views_to_param(param[1:], param) is None
    assert _views_to_param(param.permute(2, 1, 0), param) is None
    assert _views_to_param(torch.zeros(3, 4, 5), param) is None


GPU_CASES = [
    pytest.param(backend, compiler, marks=mark)
    for backend, mark in (("scattermoe", needs_triton), ("sonicmoe", needs_sonicmoe))
    for compiler in ("eager", "aot_eager")
]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "compiler"), GPU_CASES)
def test_gpu_deferred_backend_is_plain_torch(backend, compiler, gpu_device, monkeypatch):
    """The real kernels (compiled Triton, sonic-moe) in bf16; on `--gpu-device cpu` (the rehearsal)
    scattermoe runs interpreted in fp32, and sonicmoe (no CPU path) skips."""
    dtype = torch.bfloat16 if gpu_device.type == "cuda" else torch.float32
    on_device(gpu_device, dtype, monkeypatch)
    deferred_matches_plain_torch(backend, compiler, gpu_device, dtype, steps=2)
