"""Question: how much gradient memory does Sonar save on each distributed engine (DDP, FSDP2, EP)?

Each engine runs its standard recipe (all gradients kept until `step()`) and Sonar, on `world` gloo
processes, and every rank counts gradient storage bytes deterministically at every gradient
completion (`sonar_fx.distributed.memory.GradStorageCounter`: parameters' `.grad`, DDP's buckets,
gradients a reduction holds in flight; the CPU profiler misses frees on gloo's threads). The saving
should be the engine's expert-gradient bytes (twice that under DDP without gradient_as_bucket_view,
whose buckets hold a second copy) less at most one layer of them. Byte counts, so no timing noise:
the same on every rank and every run (the script checks that ranks agree).

The 2-D layout (`sonar_fx.distributed.fsdp2_ep`: experts E/ep per rank and FSDP2-sharded over dp,
dense FSDP2 over every rank) runs on a separate dp x ep group of processes, standard against Sonar on
the same layout; its rows also give what a rank holds between steps (parameters and optimizer states),
against DDP's replicas on the same world.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx.distributed as sd
from benchmarks import common
from benchmarks.common import Output, Table
from sonar_fx.api import sonar_of
from sonar_fx.config import AdamWConfig
from sonar_fx.distributed.memory import GradStorageCounter
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.memory import ExpertGradBytes, state_bytes
from sonar_fx.models import build_model
from sonar_fx.workload import random_batches

SCRIPT = "distributed"
SONAR = AdamWConfig(lr=1e-3)


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    model: str = "tiny-olmoe"
    overrides: dict[str, Any] = field(default_factory=lambda: {"num_experts": 16, "num_hidden_layers": 4})
    """Tiny-config fields (more experts and layers than the test model: the saving grows with both)."""
    dtype: str = "bfloat16"
    world: int = 2
    mesh: tuple[int, int] = (2, 2)
    """(dp, ep) of the 2-D layout's rows, run on dp * ep processes."""
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
    held_bytes: int | None = None
    """2-D rows: parameters and optimizer states this rank holds between steps (`state_bytes`)."""

    @property
    def saving(self) -> int:
        return self.standard_bytes - self.peak_bytes


# ---------------------------------------------------------------------------------------- per rank


def measure(cfg: Config) -> list[Row]:
    """Every engine's arms on this rank (a process group must be initialised)."""
    dtype = getattr(torch, cfg.dtype)
    rows = _ddp_rows(cfg, dtype, bucket_view=False) + _ddp_rows(cfg, dtype, bucket_view=True)
    return rows + _fsdp_rows(cfg, dtype) + _ep_rows(cfg, dtype)


def _model(cfg: Config, dtype: torch.dtype) -> Any:
    return build_model(cfg.model, dtype=dtype, seed=0, **cfg.overrides)


def _expert_bytes(model: Any) -> tuple[int, int]:
    """This rank's expert-gradient bytes, all layers and the largest one (an FSDP2 shard counts its own)."""
    grads = ExpertGradBytes.of(ExpertSet.discover(model).layers)
    return grads.total, grads.one_layer


def _peak(cfg: Config, counter: GradStorageCounter, run: Callable[..., Any], optimizer: Any) -> int:
    """The largest per-step gradient storage over `cfg.steps` steps of `run` on this rank's batches
    (`counter` hooked on the model before Sonar hooks its tensors, so it sees each gradient first)."""
    peak = 0
    for batch in random_batches(cfg.steps, batch=cfg.batch, seq=cfg.seq, seed=1 + dist.get_rank()):
        counter.reset()
        run(**batch).loss.backward()
        counter.sample()
        optimizer.step()
        optimizer.zero_grad()
        peak = max(peak, counter.peak)
    return peak


def _adamw(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _rows(engine: str, peaks: dict[str, int], grads: tuple[int, int], expected: dict[str, int]) -> list[Row]:
    """One row per arm of `peaks` (standard first); `expected`: each Sonar arm's least saving."""
    experts, layer = grads
    return [Row(engine=engine, arm=arm, peak_bytes=peak, standard_bytes=peaks["standard"],
                expert_bytes=experts, layer_bytes=layer, expected_min=expected.get(arm, 0))
            for arm, peak in peaks.items()]  # fmt: skip


def _ddp_rows(cfg: Config, dtype: torch.dtype, *, bucket_view: bool) -> list[Row]:
    model = _model(cfg, dtype)
    grads, counter = _expert_bytes(model), GradStorageCounter.hook(model)
    wrapped = DDP(model, gradient_as_bucket_view=bucket_view)
    counter.add_ddp(wrapped)
    peaks = {"standard": _peak(cfg, counter, wrapped, _adamw(model))}
    for arm in ("sonar", "sonar async"):
        model = _model(cfg, dtype)
        counter = GradStorageCounter.hook(model)
        wrapped = sd.ddp(model, SONAR, async_reduce=arm == "sonar async",
                         ddp_kwargs={"gradient_as_bucket_view": bucket_view})  # fmt: skip
        counter.add_ddp(wrapped)
        counter.held = cast(Any, wrapped).sonar.distributed.live_grads
        peaks[arm] = _peak(cfg, counter, wrapped, wrapped.sonar)
    copies, (experts, layer) = 1 if bucket_view else 2, grads
    expected = {"sonar": copies * experts - layer, "sonar async": copies * experts - 2 * layer}
    return _rows(f"DDP{' (gradient_as_bucket_view)' if bucket_view else ''}", peaks, grads, expected)


def _fsdp_rows(cfg: Config, dtype: torch.dtype) -> list[Row]:
    model = sd.fully_shard_experts(_model(cfg, dtype))
    grads = _expert_bytes(model)
    peaks = {"standard": _peak(cfg, GradStorageCounter.hook(model), model, _adamw(model))}
    for arm in ("sonar", "sonar, experts in the block's group"):
        model = _model(cfg, dtype)
        if arm == "sonar":
            sd.fully_shard_experts(model)
        else:  # experts share their block's group: exact, but nothing is saved
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
        counter = GradStorageCounter.hook(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = sd.fsdp2(model, SONAR)
        peaks[arm] = _peak(cfg, counter, model, model.sonar)
    return _rows("FSDP2", peaks, grads, {"sonar": grads[0] - grads[1]})


def _ep_rows(cfg: Config, dtype: torch.dtype) -> list[Row]:
    peaks = {}
    for arm in ("standard", "sonar"):
        model = _model(cfg, dtype)
        sd.shard_experts_(model)
        grads, counter = _expert_bytes(model), GradStorageCounter.hook(model)
        if arm == "standard":
            DDP._set_params_and_buffers_to_ignore_for_model(model, ExpertSet.discover(model).names)
            wrapped, optimizer = DDP(model), _adamw(model)
        else:
            wrapped = sd.expert_parallel(model, SONAR, shard=False)
            optimizer = sonar_of(wrapped)
        counter.add_ddp(wrapped)
        peaks[arm] = _peak(cfg, counter, wrapped, optimizer)
    return _rows(f"expert parallel (E/{cfg.world} per rank)", peaks, grads, {"sonar": grads[0] - grads[1]})


def measure_2d(cfg: Config) -> list[Row]:
    """The 2-D layout's arms on this rank, and DDP's replicas on the same world for what a rank holds
    (a process group of dp * ep ranks must be initialised)."""
    dtype, (dp, ep) = getattr(torch, cfg.dtype), cfg.mesh
    peaks, held = {}, []
    for arm in ("standard", "sonar"):
        mesh = init_device_mesh("cpu", cfg.mesh, mesh_dim_names=("dp", "ep"))
        model = sd.shard_fsdp2_ep(_model(cfg, dtype), mesh)
        grads, counter = _expert_bytes(model), GradStorageCounter.hook(model)
        opt = _adamw(model) if arm == "standard" else sonar_of(sd.fsdp2_ep(model, SONAR, mesh=mesh))
        peaks[arm] = _peak(cfg, counter, model, opt)
        held.append(state_bytes(model, [opt]))
    rows = _rows(f"FSDP2 x EP ({dp} dp x {ep} ep)", peaks, grads, {"sonar": grads[0] - grads[1]})
    model = _model(cfg, dtype)
    counter = GradStorageCounter.hook(model)
    wrapped = DDP(model)
    counter.add_ddp(wrapped)
    opt = _adamw(model)
    replicas = _rows(f"DDP ({dp * ep} ranks, replicas)", {"standard": _peak(cfg, counter, wrapped, opt)},
                     _expert_bytes(model), {})  # fmt: skip
    held.append(state_bytes(model, [opt]))
    return [replace(r, held_bytes=h) for r, h in zip([*rows, *replicas], held, strict=True)]


# ------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, cfg: Config, port: int, out: str, world: int, two_d: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = measure_2d(cfg) if two_d else measure(cfg)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps([asdict(r) for r in rows]))


def per_rank(cfg: Config, *, two_d: bool = False) -> list[list[Row]]:
    """Rows of every rank (spawns `cfg.world` gloo processes on loopback; `two_d`: the 2-D layout's
    rows, on dp * ep processes)."""
    world = cfg.mesh[0] * cfg.mesh[1] if two_d else cfg.world
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(
            _rank_main, args=(cfg, _free_port(), out, world, two_d), nprocs=world, join=True
        )
        return [[Row(**r) for r in json.loads(Path(out, f"rank{k}.json").read_text())] for k in range(world)]


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


def largest(per_rank: list[list[Row]]) -> list[Row]:
    """Each row with the largest byte counts over ranks (FSDP2's dense shards differ by a padded row)."""
    fields = ("peak_bytes", "standard_bytes", "expert_bytes", "layer_bytes", "expected_min", "held_bytes")
    return [replace(rows[0], **{f: _max(rows, f) for f in fields}) for rows in zip(*per_rank, strict=True)]


def _max(rows: tuple[Row, ...], name: str) -> int | None:
    values = [getattr(r, name) for r in rows]
    return None if values[0] is None else max(values)


def table_2d(rows: list[Row], cfg: Config) -> Table:
    def kib(n: int | None) -> str:
        return "-" if n is None else f"{n / 1024:.1f}"

    body = [
        [r.engine, r.arm, kib(r.held_bytes), kib(r.peak_bytes), kib(r.expert_bytes),
         "-" if r.arm == "standard" else f"{r.saving / r.expert_bytes:.2f}"]
        for r in rows
    ]  # fmt: skip
    dp, ep = cfg.mesh
    note = (
        f"{cfg.model} {cfg.overrides or ''} {cfg.dtype}, batch {cfg.batch} x seq {cfg.seq} per rank, "
        f"{dp * ep} gloo ranks as {dp} dp x {ep} ep. The largest rank's bytes (FSDP2 pads uneven shards): "
        "'held' = parameters and AdamW states between steps (storage bytes), 'grad peak' = gradient storage "
        f"counted at every gradient completion; expert grads = the rank's E/{ep} experts' shard over dp."
    )
    headers = ["layout", "arm", "held KiB", "grad peak KiB", "expert grads KiB", "saving / expert grads"]
    return Table(title="Memory per rank, 2-D layout", headers=headers, rows=body, note=note)


def run(cfg: Config) -> Output:
    ranks = per_rank(cfg)
    agree = all(rows == ranks[0] for rows in ranks)
    rows_2d = largest(per_rank(cfg, two_d=True))
    tables = [table(ranks[0], cfg, agree), table_2d(rows_2d, cfg)]
    return Output(tables=tables, records=[asdict(r) for r in ranks[0] + rows_2d])


def main(argv: list[str] | None = None) -> None:
    common.main(SCRIPT, __doc__, argv, run=run, default=Config(), quick=QUICK)


if __name__ == "__main__":
    main()
