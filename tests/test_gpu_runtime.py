"""The runtime on a CUDA GPU: CUDA graphs (`mode="reduce-overhead"`) must not freeze the update.

The update op decides in Python, when it runs, which tensor it updates and with which LR. A CUDA graph
replay runs kernels without Python, so the op is tagged `cudagraph_unsafe` and inductor keeps it out
of captured regions. Here an LR that changes every step must reach every expert update under
reduce-overhead, bitwise as in the default mode. Skips without CUDA; `--gpu-device cpu` (the rehearsal
of scripts/gpu_check.sh) runs its code on CPU, where inductor captures no CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

import sonar_fx
from sonar_fx.models import build_model
from sonar_fx.runtime import EXPERT_UPDATE_OP

from helpers import CFG, assert_same_weights, batches


def test_update_op_is_kept_out_of_cuda_graphs():
    assert torch.Tag.cudagraph_unsafe in EXPERT_UPDATE_OP.tags


def _train(mode: str | None, device: torch.device) -> torch.nn.Module:
    torch._dynamo.reset()
    # bf16 on the GPU; fp32 in the CPU rehearsal, where the bf16 compiles made this the slowest test with
    # a cold inductor cache (what it checks there is the code path: the mode reaching the backend, the LR
    # reaching the op, as test_kernels_gpu.py's CPU cases do in fp32).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model("tiny-olmoe", dtype=dtype, seed=0).to(device)
    kwargs = {"mode": mode} if mode else {}
    sonar_fx.compile(model, CFG, **kwargs)
    opt = model.sonar
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for b in batches(6):
        model(**{k: v.to(device) for k, v in b.items()}).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.report()["updates_in_graph"] == 6 * 4
    return model


@pytest.mark.gpu
@pytest.mark.slow
def test_lr_schedule_under_reduce_overhead_matches_default_mode(gpu_device):
    assert_same_weights(_train("reduce-overhead", gpu_device), _train(None, gpu_device))
