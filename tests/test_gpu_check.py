"""The GPU check rehearsed on CPU, so that no first run on a GPU fails on a Python error.

`bash scripts/gpu_check.sh --rehearse` runs every stage and script the GPU check runs (preflight,
`scripts.gpu.olmoe`, `scripts.gpu.kernels`, the gpu-marked tests) with the device taken from the
argument (cpu) and tiny shapes. Code that only a CUDA device reaches is run here on stand-ins: the CUDA
memory statistics on a stubbed allocator, the GPU table's full-size formatting, and the flag an NCCL
all-reduce receives, as a fake CUDA tensor (FakeTensorMode). docs/gpu-check.md lists what stays
unverified until a GPU runs the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from scripts.gpu import olmoe as gpu
from sonar_fx.distributed import reductions
from sonar_fx.environment import Environment
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.measure import ArmResult, measure_arm

REPO = Path(__file__).resolve().parents[1]
STAGES = ("preflight", "gpu", "kernels", "tests")
REHEARSE_COMPILER = "aot_eager"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> Path:
    """The rehearsal's output folder ($OUT) after one run of every stage."""
    out = tmp_path_factory.mktemp("gpu_check")
    # The gpu stage's compiled arm and the kernel backends' compiled test case under aot_eager: the same
    # scripts, test code and pass without C++ codegen (with a cold inductor cache their compiles were most
    # of the rehearsal's time). The pass under inductor on this model class is test_compiled_inductor.py's;
    # `make gpu-rehearsal` keeps inductor.
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "REHEARSE_COMPILER": REHEARSE_COMPILER}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--rehearse"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3000, check=False,
    )  # fmt: skip
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_rehearsal_runs_every_stage(rehearsal):
    log = (rehearsal / "gpu_check.log").read_text()
    for stage in STAGES:
        assert f"=== [{stage}] rc=0 " in log, stage
    assert "gpu: none visible to torch" in (rehearsal / "preflight.txt").read_text()


@pytest.mark.slow
@pytest.mark.subprocess
def test_rehearsal_of_the_full_size_run_trains_every_arm(rehearsal):
    data = json.loads((rehearsal / "results" / "gpu_smoke" / "results.json").read_text())
    records = {r["arm"]: r for r in data["records"]}
    assert set(records) == {
        "standard · eager",
        "standard_no_expert_clip · eager",
        "sonar · eager hooks",
        "sonar · compiled pass",
    }
    assert all("error" not in r for r in records.values()), records
    cfg = data["config"]
    steps = cfg["warmup"] + 1 + cfg["steps"]
    tensors = sum(
        len(layer.tensors) for layer in discover_experts(gpu.build(gpu.Config(device="cpu", tiny=True)))
    )
    # The compiled arm (inductor on the GPU, the rehearsal's compiler here): every expert update in the
    # graph, none by hook.
    assert cfg["arms"][-1]["execution"]["compiler"] == REHEARSE_COMPILER, cfg["arms"]
    assert records["sonar · compiled pass"]["updates_in_graph"] == steps * tensors
    assert records["sonar · compiled pass"]["updates_by_hook"] == 0
    assert records["sonar · eager hooks"]["updates_by_hook"] == steps * tensors
    assert all(len(r["step_s"]) == cfg["steps"] and r["peak_step_bytes"] > 0 for r in records.values())
    assert data["env"]["torch"] == torch.__version__ and data["command"].startswith(
        "python -m scripts.gpu.olmoe"
    )
    # The GPU run's table (GiB, full-size note) renders from the same records.
    full_size = gpu.table(data["records"], gpu.Config())
    assert "max allocated GiB" in full_size.render() and "OLMoE-1B-7B shapes" in full_size.note


@pytest.mark.slow
@pytest.mark.subprocess
def test_rehearsal_of_the_kernel_checks_finds_every_cpu_backend_exact(rehearsal):
    data = json.loads((rehearsal / "results" / "gpu_kernels" / "results.json").read_text())
    numerics = [r["numerics"] for r in data["records"] if "numerics" in r]
    exact = [r["exactness"] for r in data["records"] if "exactness" in r]
    assert {r["backend"] for r in numerics} == {r["backend"] for r in exact} == {"torch", "scattermoe"}
    assert all(max(r["rel_err"].values()) < 1e-4 for r in numerics), numerics
    assert all(r["differing"] == [] and r["updates_by_hook"] > 0 for r in exact), exact
    assert [t for t in data["tables"] if t["title"] == "Not run or failed"] == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_rehearsal_runs_the_gpu_tests_code(rehearsal):
    suite = ET.parse(rehearsal / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == 0, counts
    ran = {
        case.get("name", "").split("[")[0] for case in suite.iter("testcase") if case.find("skipped") is None
    }
    # Everything but sonic-moe (Hopper only) and the bf16 kernel cases (no bf16 in Triton's interpreter).
    assert ran == {
        "test_update_op_is_kept_out_of_cuda_graphs",
        "test_scattermoe_gpu_matches_reference",
        "test_gpu_sonar_is_bitwise_standard_no_expert_clip_with_the_same_backend",
        "test_lr_schedule_under_reduce_overhead_matches_default_mode",
    }, ran


# ------------------------------------------------------------------ code only a CUDA device reaches


class StubCudaAllocator:
    """torch.cuda's memory statistics as a CUDA allocator would move them (no device needed)."""

    def __init__(self, resident: int) -> None:
        self.now = self.peak = self.reserved = resident

    def allocate_and_free(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.now + nbytes)
        self.reserved = max(self.reserved, self.peak)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(device=None) -> None:
            self.peak = self.now

        stats = dict(
            synchronize=lambda device=None: None, empty_cache=lambda: None,
            memory_allocated=lambda device=None: self.now, reset_peak_memory_stats=reset,
            max_memory_allocated=lambda device=None: self.peak,
            max_memory_reserved=lambda device=None: self.reserved,
            get_device_name=lambda device=None: "stub GPU",
            get_device_properties=lambda device=None: SimpleNamespace(name="stub GPU", total_memory=2**30),
        )  # fmt: skip
        for name, fn in stats.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_cuda_memory_statistics_reach_the_arm_result(monkeypatch):
    """`measure_arm(..., device="cuda")`, as scripts.gpu.olmoe and scripts.gpu.kernels call it: the step's
    peak above its start, and the absolute allocated and reserved peaks."""
    allocator = StubCudaAllocator(resident=10_000)
    allocator.install(monkeypatch)
    result = measure_arm(
        ArmResult(label="arm"), allocator.allocate_and_free, [100, 200], 3_000, device="cuda"
    )
    assert result.error is None, result.error
    assert (result.peak_bytes, result.allocated_bytes, result.reserved_bytes) == (3_000, 13_000, 13_000)
    assert Environment.now("cuda").gpu == "stub GPU"


def test_the_flag_an_nccl_all_reduce_receives_is_a_cuda_tensor(monkeypatch):
    """NCCL reduces CUDA tensors only: on an NCCL group, `any_rank` hands the all-reduce a CUDA flag
    (a fake one here: FakeTensorMode makes CUDA tensors on a CPU machine)."""
    received = []

    class Stop(Exception):
        """The fake NCCL saw the flag: nothing after the collective needs checking here."""

    def nccl_all_reduce(tensor, op=None, group=None, async_op=False):
        received.append(tensor.device)
        raise Stop

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "all_reduce", nccl_all_reduce)
    with FakeTensorMode(), pytest.raises(Stop):
        reductions.any_rank(True)
    assert received == [torch.device("cuda", 0)]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert reductions.collective_device() == torch.device("cpu")  # gloo: the flag stays on the host
