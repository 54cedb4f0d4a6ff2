"""Where a run or a benchmark ran: the one environment record (versions, hardware, load).

For: `Environment.now(device)`, which `summary.json` (as `summary()`: versions and hardware), the demo
and every benchmark's results (as plain fields, with `line()` above each table) record beside their
numbers, so that two runs can be compared. Never: change what it reads, or the run's state.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where and with what something ran."""

    date: str
    """UTC time it started, ISO 8601."""
    device: str
    """The device it ran on, as given: "cpu", "cuda", "cuda:1"."""
    host: str
    """Processor model."""
    cores: int
    """Logical CPUs this process may run on."""
    threads: int
    """torch intra-op threads."""
    load_avg: tuple[float, float, float]
    """1/5/15-minute load average at the start: on a shared machine it says how noisy timings are."""
    platform: str
    python: str
    torch: str
    transformers: str
    sonar_fx: str
    gpu: str | None = None
    """The CUDA device's name (None on CPU)."""
    gpu_memory_bytes: int | None = None
    cuda: str | None = None
    """The CUDA version torch was built with (None on CPU)."""

    @classmethod
    def now(cls, device: str = "cpu") -> Environment:
        import transformers

        gpu: dict[str, Any] = {}
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            gpu = dict(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
        return cls(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            device=device,
            host=cpu_name(),
            cores=cpu_cores(),
            threads=torch.get_num_threads(),
            load_avg=tuple(round(x, 2) for x in os.getloadavg()),  # type: ignore[arg-type]
            platform=platform.platform(),
            python=platform.python_version(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            sonar_fx=_installed_version(),
            **gpu,
        )

    def line(self) -> str:
        """One line for the top of a table."""
        load = "/".join(f"{x:.1f}" for x in self.load_avg)
        where = f"{self.gpu or self.device} on {self.host} ({self.cores} cores, {self.threads} torch threads"
        versions = f"torch {self.torch}, transformers {self.transformers}, Python {self.python}"
        return f"{self.date} | {where}, load {load}) | {versions}"

    def summary(self) -> dict[str, Any]:
        """The record as `summary.json` and demo.json nest it: {"versions": ..., "hardware": ...}."""
        hardware: dict[str, Any] = {
            "device": self.device,
            "cpu": self.host,
            "cpu_cores": self.cores,
            "torch_threads": self.threads,
            "platform": self.platform,
            "load_avg": list(self.load_avg),
        }
        if self.gpu is not None:
            hardware.update(gpu=self.gpu, gpu_memory_bytes=self.gpu_memory_bytes, cuda=self.cuda)
        versions = {
            "python": self.python,
            "torch": self.torch,
            "transformers": self.transformers,
            "sonar_fx": self.sonar_fx,
        }
        return {"versions": versions, "hardware": hardware, "date": self.date}


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


def _installed_version() -> str:
    """The installed sonar-fx distribution's version (read from its metadata, not by importing the
    package's top level, which sits above this module)."""
    try:
        return importlib.metadata.version("sonar-fx")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
