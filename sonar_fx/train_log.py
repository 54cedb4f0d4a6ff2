"""What a training run records about itself: metrics.jsonl, memory readings, versions and hardware.

For: the bookkeeping `sonar_fx.train` writes next to a run so that two runs can be compared (and a
resumed run continues the same metrics file). Never: change what it measures or the run's state.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx.memory import process_peak_rss_bytes


class MetricsFile:
    """metrics.jsonl, one JSON object per step; a resumed run first drops the lines after its checkpoint."""

    def __init__(self, path: Path, *, keep_until: int) -> None:
        self.path, self.keep_until = path, keep_until
        self.file: Any = None

    def __enter__(self) -> MetricsFile:
        kept = []
        if self.keep_until and self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= self.keep_until]
        self.file = self.path.open("w")
        self.file.writelines(line + "\n" for line in kept)
        return self

    def write(self, record: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crashed run still leaves every finished step on disk

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def tensor_state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of the tensors a step starts with: weights, gradients still alive, optimizer states."""
    seen: set[int] = set()
    total = 0
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def memory_now(device: str) -> dict[str, float]:
    """The run's memory high-water mark so far, in MiB (CUDA: allocated; CPU: process RSS)."""
    if device.startswith("cuda"):
        return {"cuda_max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"peak_rss_mib": process_peak_rss_bytes() / 2**20}


def cpu_name() -> str:
    """The CPU model ("AMD EPYC ..."), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """Cores this process may run on (its affinity, not the machine's total, where the OS says)."""
    if hasattr(os, "sched_getaffinity"):  # not on macOS
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


def environment(device: str) -> dict[str, Any]:
    """Versions and hardware, for summary.json and benchmark results."""
    import transformers

    import sonar_fx

    hardware: dict[str, Any] = {
        "device": device,
        "cpu": cpu_name(),
        "cpu_cores": cpu_cores(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        hardware.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sonar_fx": sonar_fx.__version__,
    }
    return {"versions": versions, "hardware": hardware}
