"""Workers for the multi-process gloo tests: each runs in its own process, on loopback only.

`run("module:function", out, world=2)` starts `world` processes, each running `function(rank)` from
`module` (default: this one) under a gloo group, and waits at most `timeout_s`: a process that hangs
(a collective some rank never joins) is killed and the test fails with a TimeoutError, so no test
process outlives its test. A worker writes what it saw to `<out>/rank<r>.json`; the test reads the
files after every process ended (an exception in a worker fails `run`). The ranks meet through a fresh
file in `out` (a FileStore), not a TCP port, so runs started at once by other tests or other suites on
the machine never collide.

Ranks are forked from a forkserver that imported torch, transformers and sonar_fx once (`PRELOAD`):
a fresh interpreter spends ~10 s of CPU on those imports, once per rank and run with "spawn". A fork of
the server starts as a spawned process would after its imports: no tensor made, no thread started,
torch's settings at their defaults. The server starts with the first run, with the environment of that
moment (conftest's settings).
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "sonar_fx",
    "sonar_fx.distributed",
    "sonar_fx.models",
]
"""Imported once by the forkserver the ranks fork from."""
TIMEOUT_S = 900
"""Generous: it only stops a hang, and a shared machine under load runs these many times slower (at load
13 on two cores one DDP inductor case took 1,554 s; both together took 247 s on a quiet machine)."""


def run(fn_name: str, out: str, *, world: int = WORLD, timeout_s: int = TIMEOUT_S) -> None:
    """Run `fn_name(rank)` on `world` gloo processes; raise if one fails or all take over `timeout_s`."""
    store = Path(out).resolve() / f".rendezvous-{time.monotonic_ns()}"  # fresh for every run
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first run)
    context = torch.multiprocessing.start_processes(
        _entry, args=(fn_name, out, str(store), world, timeout_s), nprocs=world, join=False,
        start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            raise TimeoutError(f"{fn_name} on {world} processes did not end within {timeout_s} s")


def results(out: str, world: int = WORLD) -> list[dict]:
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, fn_name: str, out: str, store: str, world: int, timeout_s: int) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout
    )
    module_name, _, name = fn_name.rpartition(":")
    fn = getattr(importlib.import_module(module_name or __name__), name)
    try:
        result = fn(rank)
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def ddp_guard(rank: int) -> dict:
    """prepare() of a DDP model refuses; a DDP wrapper added after prepare fails at the first update."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sonar_fx
    from sonar_fx.models import build_model

    cfg = sonar_fx.AdamWConfig(lr=1e-2)
    seen: dict[str, str] = {}
    try:
        sonar_fx.prepare(DDP(build_model("tiny-olmoe", seed=0)), cfg)
    except sonar_fx.SonarUsageError as err:
        seen["prepare_ddp"] = str(err)
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.prepare(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 259, (2, 8), generator=torch.Generator().manual_seed(rank))
    try:
        DDP(model)(input_ids=ids, labels=ids).loss.backward()
    except sonar_fx.SonarUsageError as err:
        seen["wrapped_after_prepare"] = str(err)
    seen["experts_unchanged"] = str(
        all(torch.equal(before[t.name], t.param) for layer in opt.expert_layers for t in layer.tensors)
    )
    return seen
