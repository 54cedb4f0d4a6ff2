"""Workers for the 2-process gloo tests: each runs in its own process, on loopback only.

A worker writes what it saw to `<out>/rank<r>.json`; the test reads the files after both processes
ended (an exception in a worker fails `torch.multiprocessing.spawn` in the test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2


def run(fn_name: str, out: str, port: int) -> None:
    """Spawn `WORLD` processes running `fn_name(rank, out)` under a gloo group; wait for them."""
    torch.multiprocessing.spawn(_entry, args=(fn_name, out, port), nprocs=WORLD, join=True)


def results(out: str) -> list[dict]:
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _entry(rank: int, fn_name: str, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = globals()[fn_name](rank)
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
