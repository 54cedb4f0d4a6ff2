"""Question: how much gradient memory does Sonar save on each distributed engine (DDP, FSDP2, EP)?

Each engine runs its standard recipe (all gradients kept until `step()`) and Sonar, on `world` gloo
processes, and every rank counts gradient storage bytes deterministically at every gradient
completion (`sonar_fx.distributed.memory.GradStorageCounter`: parameters' `.grad`, DDP's buckets,
gradients a reduction holds in flight; the CPU profiler misses frees on gloo's threads). The saving
should be the engine's expert-gradient bytes (twice that under DDP without gradient_as_bucket_view,
whose buckets hold a second copy) less at most one layer of them. Byte counts, so no timing noise:
the same on every rank and every run (the script checks that ranks agree).
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from benchmarks import common
from benchmarks.common import Table

SCRIPT = "distributed"


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    model: str = "tiny-olmoe"
    overrides: dict[str, Any] = field(default_factory=lambda: {"num_experts": 16, "num_hidden_layers": 4})
    """Tiny-config fields (more experts and layers than the test model: the saving grows with both)."""
    dtype: str = "bfloat16"
    world: int = 2
    steps: int = 2
    batch: int = 2
    seq: int = 32


QUICK = Config(overrides={}, dtype="float32", steps=1, seq=16)


@dataclass(frozen=True, kw_only=True)
class Row:
    engine: str
    arm: str
    peak_bytes: int
    standard_bytes: int
    expert_bytes: int
    """This rank's expert-gradient bytes under the engine (a shard under FSDP2, local experts under EP)."""
    layer_bytes: int
    """The largest layer's share of `expert_bytes`."""
    expected_min: int
    """The least saving the design predicts: expert bytes (x2 without bucket views) less one layer
    (two for the async all-reduce, which keeps one more alive; all of it for a shared FSDP2 group)."""

    @property
    def saving(self) -> int:
        return self.standard_bytes - self.peak_bytes


# ---------------------------------------------------------------------------------------- per rank


def measure(cfg: Config) -> list[Row]:
    """Every engine's arms on this rank (a process group must be initialised)."""
    import torch

    dtype = getattr(torch, cfg.dtype)
    rows = _ddp_rows(cfg, dtype, bucket_view=False) + _ddp_rows(cfg, dtype, bucket_view=True)
    return rows + _fsdp_rows(cfg, dtype) + _ep_rows(cfg, dtype)


def _model(cfg: Config, dtype: Any) -> Any:
    from sonar_fx.models import build_model

    return build_model(cfg.model, dtype=dtype, seed=0, **cfg.overrides)


def _expert_bytes(model: Any) -> tuple[int, int]:
    """This rank's expert-gradient bytes, all layers and the largest one (an FSDP2 shard counts its own)."""
    from sonar_fx.experts.discovery import ExpertSet
    from sonar_fx.memory import ExpertGradBytes

    grads = ExpertGradBytes.of(ExpertSet.discover(model).layers)
    return grads.total, grads.one_layer


def _peak(cfg: Config, run: Callable[..., Any], step: Callable[[], None], counter: Any) -> int:
    """The largest per-step peak over `cfg.steps` steps on this rank's batches."""
    import torch.distributed as dist

    from sonar_fx.workload import random_batches

    peak = 0
    for batch in random_batches(cfg.steps, batch=cfg.batch, seq=cfg.seq, seed=1 + dist.get_rank()):
        counter.reset()
        run(**batch).loss.backward()
        counter.sample()
        step()
        peak = max(peak, counter.peak)
    return peak


def _adamw_step(model: Any) -> Callable[[], None]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return _sonar_step(opt)


def _sonar_step(optimizer: Any) -> Callable[[], None]:
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return step


def _ddp_rows(cfg: Config, dtype: Any, *, bucket_view: bool) -> list[Row]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sonar_fx.distributed as sd
    from sonar_fx.config import AdamWConfig
    from sonar_fx.distributed.memory import GradStorageCounter

    engine = f"DDP{' (gradient_as_bucket_view)' if bucket_view else ''}"
    model = _model(cfg, dtype)
    experts, layer = _expert_bytes(model)
    counter = GradStorageCounter.hook(model)
    wrapped = DDP(model, gradient_as_bucket_view=bucket_view)
    counter.add_ddp(wrapped)
    standard = _peak(cfg, wrapped, _adamw_step(model), counter)
    copies = 1 if bucket_view else 2
    rows = [Row(engine=engine, arm="standard", peak_bytes=standard, standard_bytes=standard,
                expert_bytes=experts, layer_bytes=layer, expected_min=0)]  # fmt: skip
    for asynchronous in (False, True):
        model = _model(cfg, dtype)
        counter = GradStorageCounter.hook(model)
        wrapped = sd.ddp(model, AdamWConfig(lr=1e-3), async_reduce=asynchronous,
                         ddp_kwargs={"gradient_as_bucket_view": bucket_view})  # fmt: skip
        counter.add_ddp(wrapped)
        reduction: Any = cast(Any, wrapped).sonar.distributed
        counter.held = reduction.live_grads
        peak = _peak(cfg, wrapped, _sonar_step(wrapped.sonar), counter)
        alive = 2 * layer if asynchronous else layer
        rows.append(Row(engine=engine, arm="sonar async" if asynchronous else "sonar", peak_bytes=peak,
                        standard_bytes=standard, expert_bytes=experts, layer_bytes=layer,
                        expected_min=copies * experts - alive))  # fmt: skip
    return rows


def _fsdp_rows(cfg: Config, dtype: Any) -> list[Row]:
    from torch.distributed.fsdp import fully_shard

    import sonar_fx.distributed as sd
    from sonar_fx.config import AdamWConfig
    from sonar_fx.distributed.memory import GradStorageCounter

    model = sd.fully_shard_experts(_model(cfg, dtype))
    experts, layer = _expert_bytes(model)
    counter = GradStorageCounter.hook(model)
    standard = _peak(cfg, model, _adamw_step(model), counter)
    rows = [Row(engine="FSDP2", arm="standard", peak_bytes=standard, standard_bytes=standard,
                expert_bytes=experts, layer_bytes=layer, expected_min=0)]  # fmt: skip
    for shared in (False, True):
        model = _model(cfg, dtype)
        if shared:  # experts share their block's group: exact, but nothing is saved
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
        else:
            sd.fully_shard_experts(model)
        counter = GradStorageCounter.hook(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = sd.fsdp2(model, AdamWConfig(lr=1e-3))
        peak = _peak(cfg, model, _sonar_step(model.sonar), counter)
        rows.append(Row(engine="FSDP2", arm="sonar, experts in the block's group" if shared else "sonar",
                        peak_bytes=peak, standard_bytes=standard, expert_bytes=experts, layer_bytes=layer,
                        expected_min=0 if shared else experts - layer))  # fmt: skip
    return rows


def _ep_rows(cfg: Config, dtype: Any) -> list[Row]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sonar_fx.distributed as sd
    from sonar_fx.config import AdamWConfig
    from sonar_fx.distributed.memory import GradStorageCounter
    from sonar_fx.experts.discovery import ExpertSet

    peaks = {}
    for arm in ("standard", "sonar"):
        model = _model(cfg, dtype)
        sd.shard_experts_(model)
        experts, layer = _expert_bytes(model)
        counter = GradStorageCounter.hook(model)
        if arm == "standard":
            names = ExpertSet.discover(model).names
            DDP._set_params_and_buffers_to_ignore_for_model(model, names)
            wrapped, step = DDP(model), _adamw_step(model)
        else:
            wrapped = sd.expert_parallel(model, AdamWConfig(lr=1e-3), shard=False)
            step = _sonar_step(wrapped.sonar)
        counter.add_ddp(wrapped)
        peaks[arm] = _peak(cfg, wrapped, step, counter)
    return [Row(engine=f"expert parallel (E/{cfg.world} per rank)", arm=arm, peak_bytes=peak,
                standard_bytes=peaks["standard"], expert_bytes=experts, layer_bytes=layer,
                expected_min=0 if arm == "standard" else experts - layer)
            for arm, peak in peaks.items()]  # fmt: skip


# ------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, cfg: Config, port: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world)
    try:
        rows = measure(cfg)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps([asdict(r) for r in rows]))


def run(cfg: Config) -> list[list[Row]]:
    """Rows of every rank (spawns `cfg.world` gloo processes on loopback)."""
    import json

    import torch

    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_rank_main, args=(cfg, _free_port(), out), nprocs=cfg.world, join=True)
        return [
            [Row(**r) for r in json.loads(Path(out, f"rank{k}.json").read_text())] for k in range(cfg.world)
        ]


def table(rows: list[Row], cfg: Config, ranks_agree: bool) -> Table:
    def kib(n: int) -> str:
        return f"{n / 1024:.1f}"

    def cells(r: Row) -> list[str]:
        if r.arm == "standard":
            return [kib(r.peak_bytes), "-", kib(r.expert_bytes), "-", "-"]
        predicted = "yes" if r.saving >= r.expected_min else "NO"
        return [
            kib(r.peak_bytes),
            kib(r.saving),
            kib(r.expert_bytes),
            f"{r.saving / r.expert_bytes:.2f}",
            predicted,
        ]

    body = [[r.engine, r.arm, *cells(r)] for r in rows]
    note = (
        f"{cfg.model} {cfg.overrides or ''} {cfg.dtype}, batch {cfg.batch} x seq {cfg.seq} per rank, "
        f"{cfg.world} gloo ranks, peak over {cfg.steps} steps. KiB of gradient storage per rank, counted at "
        "every gradient completion (deterministic); expert grads = this rank's (FSDP2: its shard; EP: its "
        "E/world experts). 'as predicted' = saving >= expert bytes (x2 without bucket views) less one "
        f"layer (two with async). Ranks agree: {'yes' if ranks_agree else 'NO'}."
    )
    headers = ["engine", "arm", "grad peak KiB", "saving KiB", "expert grads KiB", "saving / expert grads",
               "as predicted"]  # fmt: skip
    return Table(title="Gradient memory per engine", headers=headers, rows=body, note=note)


def main(argv: list[str] | None = None) -> None:
    inv = common.start(SCRIPT, __doc__, argv, default=Config(), quick=QUICK)
    per_rank = run(inv.cfg)
    agree = all(rows == per_rank[0] for rows in per_rank)
    inv.finish([table(per_rank[0], inv.cfg, agree)], records=[asdict(r) for r in per_rank[0]])


if __name__ == "__main__":
    main()
