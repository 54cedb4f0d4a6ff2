"""`--parallel ddp|fsdp2|ep`: a fine-tuning run on every process that torchrun started.

For: the run's place among the processes (`Parallel`: engine, rank, world size, from torchrun's
environment), the process group, the method built on the engine (`build_parallel_method`: Sonar and
the dense-only-clip baseline, plus the global-clip baseline on DDP and FSDP2), each rank's batch (all
ranks draw the same `world` batches from one seeded stream and keep their own, so the stream state is
the same everywhere and resumes exactly), the agreement of ranks (mean loss, stop requests) and the
checkpoint files: rank 0 writes the run's files; on the sharded engines every other rank writes its
own `checkpoint.rank<r>.pt` beside it, holding its local shards (FSDP2 DTensors as local tensors).
A checkpoint resumes on the same engine and world size only. Never: write from a rank other than 0
outside its own checkpoint file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sonar_fx import data as D
from sonar_fx.config import OptimizerConfig
from sonar_fx.methods import Execution, TrainingMethod
from sonar_fx.optim.rules import rule_for
from sonar_fx.trainer.config import ConfigError

Engine = Literal["ddp", "fsdp2", "ep"]
ENGINES: tuple[str, ...] = ("ddp", "fsdp2", "ep")
METHODS_ON = {
    "ddp": ("sonar", "standard", "standard_no_expert_clip"),
    "fsdp2": ("sonar", "standard", "standard_no_expert_clip"),
    # A global clip over EP's local expert gradients would differ per rank: dense-only clip only.
    "ep": ("sonar", "standard_no_expert_clip"),
}


@dataclass(frozen=True)
class Parallel:
    """This process's place in a `--parallel` run."""

    engine: Engine
    rank: int
    world: int

    @property
    def writer(self) -> bool:
        """Rank 0 logs and writes the run's files."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Ranks hold different state (FSDP2 shards, EP experts): each saves its own checkpoint file."""
        return self.engine != "ddp"

    def checkpoint_path(self, path: Path) -> Path:
        """This rank's checkpoint file beside rank 0's `path`."""
        if self.rank == 0 or not self.sharded:
            return path
        return path.with_name(f"{path.stem}.rank{self.rank}{path.suffix}")


def from_env(engine: str | None) -> Parallel | None:
    """The `Parallel` of `--parallel engine` from torchrun's RANK / WORLD_SIZE (None without it)."""
    if engine is None:
        return None
    if engine not in ENGINES:
        raise ConfigError(
            f"--parallel {engine!r} is invalid: expected one of {', '.join(ENGINES)}", flag="--parallel"
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"--parallel {engine} runs on the processes torchrun starts: "
            "torchrun --nproc-per-node 2 -m sonar_fx finetune ... --parallel " + engine,
            flag="--parallel",
        )
    return Parallel(engine, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))  # type: ignore[arg-type]


def check(parallel: Parallel, method: str, execution: Execution) -> None:
    """Refuse combinations the engines do not run, naming the flag."""
    if method not in METHODS_ON[parallel.engine]:
        raise ConfigError(
            f"--method {method} is not available with --parallel {parallel.engine}; use one of "
            f"{', '.join(METHODS_ON[parallel.engine])}",
            flag="--method",
        )
    if parallel.engine == "ep" and execution.compiled:
        raise ConfigError("--parallel ep runs eagerly: pass --compiler eager", flag="--compiler")
    if not execution.sonar_pass:
        raise ConfigError(
            "--hooks-on-compiled is a single-process ablation; drop it", flag="--hooks-on-compiled"
        )


def init_process_group(parallel: Parallel, device: str) -> bool:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); True if this call created it."""
    if dist.is_initialized():
        return False
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.get_world_size() != parallel.world:
        raise RuntimeError(
            f"process group has {dist.get_world_size()} ranks, WORLD_SIZE says {parallel.world}"
        )
    return True


def rank_batch(stream: D.BatchStream, parallel: Parallel) -> tuple[dict[str, Tensor], int]:
    """This rank's batch of the step and the supervised tokens of the whole step (all ranks)."""
    batches = [stream.next_batch() for _ in range(parallel.world)]
    return batches[parallel.rank], sum(D.supervised_tokens(b) for b in batches)


def mean_over_ranks(value: Tensor) -> float:
    """The mean of a scalar over ranks (the step's loss, as data parallelism averages it)."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def build_parallel_method(
    parallel: Parallel,
    name: str,
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    execution: Execution,
    **sonar_kwargs: Any,
) -> TrainingMethod:
    """The method `name` on the engine (see the module docstring)."""
    import sonar_fx.distributed as sd

    compiler = execution.compiler
    if name == "sonar":
        if parallel.engine == "ddp":
            run: Any = sd.ddp(model, opt_cfg, compiler=compiler, **sonar_kwargs)
        elif parallel.engine == "fsdp2":
            run = sd.fsdp2(model, opt_cfg, compiler=compiler, **sonar_kwargs)
        else:
            run = sd.expert_parallel(model, opt_cfg, **sonar_kwargs)
        return TrainingMethod(name, execution, run, run.sonar)
    return _standard(parallel, name, model, opt_cfg, execution)


def _standard(
    parallel: Parallel, name: str, model: nn.Module, opt_cfg: OptimizerConfig, execution: Execution
) -> TrainingMethod:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sonar_fx.distributed as sd
    from sonar_fx.experts.discovery import discover_experts

    if parallel.engine == "ep":
        sd.shard_experts_(model)
    expert_ids = {id(t.param) for layer in discover_experts(model) for t in layer.tensors}
    run: Any
    if parallel.engine == "fsdp2":
        sd.fully_shard_experts(model)
        run = model
        if execution.compiled:
            for block in _blocks(model):
                block.compile(backend=execution.compiler)
    else:
        if parallel.engine == "ep":
            names = [n for n, p in model.named_parameters() if id(p) in expert_ids]
            DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        run = DDP(model)
        if execution.compiled:
            run = torch.compile(run, backend=execution.compiler)
    expert_ids = {
        id(t.param) for layer in discover_experts(model) for t in layer.tensors
    }  # FSDP2 swapped them
    params = [p for p in model.parameters() if p.requires_grad]
    clip = params if name == "standard" else [p for p in params if id(p) not in expert_ids]
    baseline = rule_for(opt_cfg).torch_optimizer(params, opt_cfg)
    scale = 1.0 / parallel.world if parallel.engine == "ep" else 1.0
    experts = [p for p in params if id(p) in expert_ids]
    clip = clip if opt_cfg.clips else []
    return _ScaledExperts(name, execution, run, baseline, clip, opt_cfg.max_grad_norm, experts=experts,
                          expert_scale=scale)  # fmt: skip


class _ScaledExperts(TrainingMethod):
    """A standard method whose expert gradients are scaled before clipping (EP: by 1/world)."""

    def __init__(self, *args: Any, experts: list[nn.Parameter], expert_scale: float) -> None:
        super().__init__(*args)
        self.experts, self.expert_scale = experts, expert_scale

    def optimizer_step(self) -> None:
        if self.expert_scale != 1.0:
            for p in self.experts:
                if p.grad is not None:
                    p.grad.mul_(self.expert_scale)
        super().optimizer_step()


def _blocks(model: nn.Module) -> list[nn.Module]:
    from sonar_fx.compiled import repeated_blocks
    from sonar_fx.experts.discovery import discover_experts

    return [b for _, b in repeated_blocks(model, [layer.name for layer in discover_experts(model)])]


# ------------------------------------------------------------------------------------ checkpoints


def checkpoint_views(
    parallel: Parallel | None, model: nn.Module, method: TrainingMethod
) -> tuple[Any, list[Any]]:
    """What a checkpoint saves and loads: the model and optimizers, FSDP2 shards as local tensors."""
    if parallel is None or parallel.engine != "fsdp2":
        return model, list(method.optimizers)
    return LocalState(model), [LocalState(opt) for opt in method.optimizers]


class LocalState:
    """`state_dict()` / `load_state_dict()` of a module or optimizer with every DTensor as its local
    shard, so a rank's checkpoint file holds plain tensors (FSDP2); anything else passes through."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return _map(self.obj.state_dict(), lambda t, _: t.to_local() if hasattr(t, "to_local") else t)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Any:
        init = getattr(self.obj, "init_state", None)
        if init is not None:
            init()  # a fresh SonarOptimizer: templates for the DTensor states
        elif isinstance(self.obj, torch.optim.Optimizer) and not self.obj.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.obj)
        current = self.obj.state_dict()
        rebuilt = _map(state, lambda t, where: _like(t, _at(current, where)))
        if isinstance(self.obj, nn.Module):
            return self.obj.load_state_dict(rebuilt, strict=strict)
        return self.obj.load_state_dict(rebuilt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.obj, name)


def _like(saved: Tensor, template: Any) -> Tensor:
    if hasattr(template, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(saved, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())  # fmt: skip
    return saved


def _map(obj: Any, fn: Any, where: tuple[Any, ...] = ()) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj, where)
    if isinstance(obj, Mapping):
        return {k: _map(v, fn, (*where, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, fn, (*where, i)) for i, v in enumerate(obj)]
    return obj


def _at(obj: Any, where: tuple[Any, ...]) -> Any:
    for key in where:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj
