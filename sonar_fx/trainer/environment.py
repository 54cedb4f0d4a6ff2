"""What a run records about where it ran: memory readings, versions and hardware.

For: the facts `summary.json` and the benchmarks store next to their numbers so that two runs can be
compared. Never: change what it measures or the run's state.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx.memory import process_peak_rss_bytes


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
