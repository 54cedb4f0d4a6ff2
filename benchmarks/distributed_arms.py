"""The arms of `benchmarks.distributed_deferred` on one rank: each engine's plain recipe (every
gradient kept until `step()`, `clip_grad_norm_`, fused AdamW) and Sonar's deferred schedule on it, the
user's accumulation loop, and the run's settings."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx.distributed as sd
from benchmarks.workload import SHAPES
from sonar_fx.compiled import repeated_blocks
from sonar_fx.config import AdamWConfig
from sonar_fx.distributed.memory import ddp_bucket_bytes
from sonar_fx.distributed.reductions import expert_parallel_norm
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.memory import storage_bytes
from sonar_fx.workload import random_batches

ENGINES = ("ddp", "ep", "fsdp2")
"""Engines the script can run (`--engines`)."""
MAX_NORM = 1e-3
"""Below every step's norm: the clip scales every gradient on every step (both arms)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of `benchmarks.distributed_deferred`."""

    shape: str = "olmoe-cpu"
    dtype: str = "bfloat16"
    world: int = 2
    batch: int = 2
    seq: int = 32
    accum: int = 4
    """Micro-batches per step (`no_sync()` on all but the last)."""
    engines: tuple[str, ...] = ("ddp", "ep")
    """The default run's; FSDP2 with `--engines ddp ep fsdp2` (half as long again on 2 busy cores)."""
    compilers: dict[str, str] = field(
        default_factory=lambda: {"ddp": "eager", "ep": "aot_eager", "fsdp2": "eager"}
    )
    """Per engine: the eager capture keeps the grouped GEMMs' operands on each (expert parallelism's:
    Sonar's own grouped-GEMM op); expert parallelism's blocks are compiled, as its results were
    measured (its eager step saves alike: olmoe-cpu, 2 ranks, ranks 0 / 1, the deferred step's peak
    235.3 / 239.5 MB eager and aot_eager, the plain one's 274.1 / 275.3 eager, 271.9 / 273.0 aot_eager)."""
    rounds: int = 15
    """Timed rounds per pair (0: memory only)."""
    warmup: int = 1


QUICK = Config(shape="olmoe-micro", seq=16, accum=2, rounds=2)
"""`--quick`: a smoke test of every code path (its time ratios are labelled so, never graded; it writes
results/distributed_deferred_smoke)."""
SMOKE_SHAPES = ("olmoe-micro",)
"""Shapes too small for a time ratio to mean anything (`distributed_deferred.smoke_test`)."""


# ---------------------------------------------------------------------------------------- the arms


@dataclass
class Arm:
    """One model on this rank: its engine's wrapper, its step, what it keeps."""

    name: str
    run: nn.Module
    model: nn.Module
    step: Callable[[], Any]
    optimizers: list[torch.optim.Optimizer]
    experts: list[nn.Parameter]
    sonar: Any = None

    def train(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        self.backwards(micro_batches)
        self.step()

    def backwards(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """The user's accumulation loop: gradient sync on the last micro-batch only (DDP's `no_sync()`,
        FSDP2's `set_requires_gradient_sync(False)`)."""
        for i, b in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if isinstance(self.run, DDP):
                with nullcontext() if last else self.run.no_sync():
                    self.run(**b).loss.backward()
            else:
                self.run.set_requires_gradient_sync(last)  # type: ignore[operator]
                self.run(**b).loss.backward()

    def alive(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The tensors alive when a step starts: weights, buffers, gradients, optimizer states and the
        batch (FSDP2: the rank's shards)."""
        tensors = [t for p in self.model.parameters() for t in (p, p.grad) if t is not None]
        tensors += [
            v for o in self.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        tensors += [*self.model.buffers(), *(t for b in micro_batches for t in b.values())]
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

    def all_gather_outputs(self) -> list[torch.Tensor]:
        """FSDP2's all-gather output buffers: allocated and freed by resizing their storage in place."""
        states = [m._get_fsdp_state() for m in self.model.modules() if isinstance(m, FSDPModule)]
        groups = [g for s in states if (g := s._fsdp_param_group) is not None]
        return [t for g in groups for fp in g.fsdp_params for t in fp.all_gather_outputs]

    def held(self) -> list[torch.Tensor]:
        """What the deferred store holds now (kept operands, gradients kept whole or folded at the
        crossover): a compiled graph's kept op folds a sum inside its own body, where the meter's mode
        does not see it made."""
        if self.sonar is None:
            return []
        entries = [e for pending in self.sonar.deferred.kept.values() for g in pending.groups() for e in g]
        return [t for e in entries for t in ([e] if torch.is_tensor(e) else e.operands) if torch.is_tensor(t)]

    def bucket_bytes(self) -> int:
        """DDP's bucket buffers: alive for the run, exposed by no tensor of the model."""
        return ddp_bucket_bytes(self.run) if isinstance(self.run, DDP) else 0

    def start_bytes(self, micro_batches: list[dict[str, torch.Tensor]]) -> int:
        """Storage bytes alive when a step starts (each storage once), DDP's buckets included."""
        return storage_bytes(self.alive(micro_batches)) + self.bucket_bytes()


def build(cfg: Config, engine: str, deferred: bool, clip: str) -> Arm:
    """The plain engine (`deferred=False`) or Sonar's deferred schedule on it, clipping `clip`."""
    torch._dynamo.reset()
    model = SHAPES[cfg.shape].build(getattr(torch, cfg.dtype), seed=0)
    compiler = cfg.compilers[engine]
    sonar_cfg = AdamWConfig(lr=1e-3, max_grad_norm=MAX_NORM, expert_clip="global" if clip == "all" else None)
    name = f"{'deferred' if deferred else 'plain'} {engine}, clip {clip}"
    if deferred:
        wrap = {"ddp": sd.ddp, "ep": sd.expert_parallel, "fsdp2": sd.fsdp2}[engine]
        kwargs: dict[str, Any] = {} if compiler == "eager" else {"compiler": compiler}
        run: Any = wrap(model, sonar_cfg, schedule="deferred", **kwargs)
        opt = run.sonar
        experts = list(opt.expert_group["params"])

        def step() -> None:
            opt.step()
            opt.zero_grad()

        return Arm(name, run, model, step, [opt], experts, sonar=opt)
    run, experts = _plain_engine(model, engine, compiler)
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    plain = torch.optim.AdamW([dict(params=dense), dict(params=experts)], lr=1e-3, fused=True)

    def plain_step() -> None:
        if engine == "ep":  # the rank's own experts: data-parallel averaging, as DDP gives dense grads
            for p in experts:
                p.grad.mul_(1.0 / dist.get_world_size())  # type: ignore[union-attr]
        _clip(engine, dense, experts if clip == "all" else [])
        plain.step()
        plain.zero_grad()

    return Arm(name, run, model, plain_step, [plain], experts)


def _plain_engine(model: nn.Module, engine: str, compiler: str) -> tuple[Any, list[nn.Parameter]]:
    if engine == "fsdp2":  # the experts in their own fully_shard groups, as sd.fsdp2 lays them out
        sd.fully_shard_experts(model)
        return model, ExpertSet.discover(model).params
    if engine == "ddp":
        experts = ExpertSet.discover(model).params
        wrapped = DDP(model)
        return (wrapped if compiler == "eager" else torch.compile(wrapped, backend=compiler)), experts
    sd.shard_experts_(model)
    found = ExpertSet.discover(model)
    DDP._set_params_and_buffers_to_ignore_for_model(model, found.names)
    if compiler != "eager":
        for _, block in repeated_blocks(model, [layer.name for layer in found.layers]):
            block.compile(backend=compiler)
    return DDP(model), found.params


def _clip(engine: str, dense: list[nn.Parameter], experts: list[nn.Parameter]) -> None:
    """`clip_grad_norm_` over `dense + experts`; expert parallelism: torchtitan's norm (each rank's
    experts counted once)."""
    if engine != "ep" or not experts:
        torch.nn.utils.clip_grad_norm_([*dense, *experts], MAX_NORM)
        return
    grads = [p.grad for p in dense], [p.grad for p in experts]
    dense_norm = torch.nn.utils.get_total_norm(grads[0])  # type: ignore[arg-type]
    expert_norms = torch._foreach_norm(grads[1], 2.0)  # type: ignore[arg-type]
    total = expert_parallel_norm(dense_norm, expert_norms, dist.group.WORLD)  # type: ignore[arg-type]
    torch.nn.utils.clip_grads_with_norm_([*dense, *experts], MAX_NORM, total)


def steps_of(cfg: Config, n: int, seed: int) -> list[list[dict[str, torch.Tensor]]]:
    flat = random_batches(n * cfg.accum, batch=cfg.batch, seq=cfg.seq, seed=seed + dist.get_rank())
    return [flat[i * cfg.accum : (i + 1) * cfg.accum] for i in range(n)]
