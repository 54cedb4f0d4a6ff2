"""Where a training method runs: one process, or a torch.distributed engine (DDP, FSDP2, expert parallel,
FSDP2 x expert parallel).

An `Engine` is the strategy `sonar_fx.methods.build_method` calls to put any method on it, Sonar or a
baseline, so every method is built by one builder whatever runs it:
- `sonar(model, cfg, ...)`: Sonar set up on the engine (one process: `sonar_fx.compile`; the others:
  their `sonar_fx.distributed` entry point, which keeps experts out of DDP and reduces each expert
  gradient before its update, shards them with FSDP2, or shards them E/world per rank);
- `wrap(model, compiler)`: a baseline's model as the engine runs it (DDP, `fully_shard`, torch.compile);
- `expert_grad_scale()`: what a baseline multiplies expert gradients by before it clips (expert
  parallelism: 1/world, the data-parallel average that DDP applies to the dense gradients);
- `no_sync(run)`: the context every micro-batch of a step but the last runs under (DDP's and expert
  parallelism's `no_sync()`, FSDP2's `set_requires_gradient_sync(False)`), the accumulation loop
  whose arithmetic the deferred schedule has (each rank sums its micro-batches, one reduction);
- `total_norm` / `clip_with_norm_`: a baseline's clip over every parameter as the engine's users clip
  (torch's `clip_grad_norm_`; expert parallelism and FSDP2 x EP: torchtitan's, each expert counted
  once);
- what it runs: `methods` (by name), `compiles`, `hooks_on_compiled`, and `check_optimizer` for the
  optimizer settings and schedule it is verified with (`sonar_fx.api.distributed_gap`, the one
  rule), so a combination it does not run is refused before anything is built
  (`sonar_fx.methods.check_engine`).
Options of an engine (a process group, a device mesh, a setting it learns to support) belong on its
strategy object. `ENGINES` names them as `--parallel` does. The distributed engines import
`sonar_fx.distributed` when they build, so a single-process run never loads it.
Never: change a method's arithmetic; the clip rule and the optimizers are the builder's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from sonar_fx import api
from sonar_fx.config import ConfigFieldError, OptimizerConfig
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.log_filters import quiet_norm_over_mesh_dims
from sonar_fx.optim.optimizer import Granularity, Schedule, SonarOptimizer

Run = Callable[..., Any]
"""What a training step calls with a batch: the model, or its wrapper (DDP, torch.compile)."""
Experts = Iterable[nn.Parameter | str] | None
"""An explicit list of expert tensors (`sonar_fx.compile(experts=...)`), or None: discovery's."""


@dataclass(frozen=True)
class Engine(ABC):
    """How methods are put on one kind of execution engine (see the module docstring); the base is
    what every engine shares, each engine overrides what it does differently."""

    name: str = ""
    """"single", or the `--parallel` name: "ddp", "fsdp2", "ep", "fsdp2_ep"."""
    distributed: bool = False
    """Runs on every process of a torch.distributed process group."""
    sharded: bool = False
    """Ranks hold different state (FSDP2 shards, EP experts): each saves its own checkpoint file."""
    local_state: bool = False
    """Parameters and states are DTensors, checkpointed as their local shards (FSDP2)."""
    methods: tuple[str, ...] | None = None
    """Names of the methods it builds (None: every one)."""
    compiles: bool = True
    """Runs compiled models (aot_eager, inductor), not only eager ones."""
    hooks_on_compiled: bool = True
    """Runs Sonar's hooks on a compiled model without the graph pass (the ablation)."""
    experts_apart: bool = False
    """Expert and dense parameters live on different device meshes (FSDP2 x EP): a baseline steps the
    experts with an optimizer of their own (a fused step over DTensors spans one mesh)."""

    def check_optimizer(self, cfg: OptimizerConfig, schedule: Schedule = "in_backward") -> None:
        """Refuse optimizer settings or a Sonar schedule the engine is not verified with
        (`ConfigFieldError` naming the field)."""
        return None

    def no_sync(self, run: Run) -> AbstractContextManager[None]:
        """The context a micro-batch runs under when it is not the step's last: gradient sync off (one
        process: nothing to sync)."""
        return nullcontext()

    @abstractmethod
    def sonar(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        *,
        compiler: str,
        sonar_pass: bool,
        granularity: Granularity,
        experts: Experts,
        **sonar_kwargs: Any,
    ) -> tuple[Run, SonarOptimizer]:
        """Sonar on this engine: what to call with a batch, and its optimizer."""

    @abstractmethod
    def wrap(self, model: nn.Module, compiler: str) -> Run:
        """A baseline's model as this engine runs it (the builder discovers experts after this)."""

    def expert_grad_scale(self) -> float:
        """The factor a baseline applies to its expert gradients before clipping (1.0: none)."""
        return 1.0

    def total_norm(self, params: list[nn.Parameter], experts: set[int]) -> torch.Tensor:
        """The global norm of `params`' gradients as a baseline clips them all (`experts`: ids of the
        expert tensors): `clip_grad_norm_`'s, a DTensor for FSDP2 shards."""
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def clip_with_norm_(
        self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor, experts: set[int]
    ) -> None:
        """Scale `params`' gradients by `max_norm / norm` where it is below one, as `clip_grad_norm_`."""
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


@dataclass(frozen=True)
class SingleProcess(Engine):
    """One process: Sonar by `sonar_fx.compile` / `prepare`; baselines as the model or torch.compile'd."""

    name: str = "single"

    def sonar(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        *,
        compiler: str,
        sonar_pass: bool,
        granularity: Granularity,
        experts: Experts,
        **sonar_kwargs: Any,
    ) -> tuple[Run, SonarOptimizer]:
        if compiler != "eager" and not sonar_pass:  # the ablation: hooks on a compiled model
            optimizer = api.prepare(model, cfg, experts=experts, granularity=granularity, **sonar_kwargs)
            return torch.compile(model, backend=compiler), optimizer
        run = api.compile(
            model, cfg, compiler=compiler, experts=experts, granularity=granularity,  # type: ignore[arg-type]
            **sonar_kwargs,
        )  # fmt: skip
        return run, api.sonar_of(run)

    def wrap(self, model: nn.Module, compiler: str) -> Run:
        return model if compiler == "eager" else torch.compile(model, backend=compiler)


@dataclass(frozen=True)
class _Distributed(Engine):
    """What the torch.distributed engines share: the methods and settings they are verified with."""

    distributed: bool = True
    methods: tuple[str, ...] | None = ("sonar", "sonar_deferred", "standard", "standard_no_expert_clip")
    """sonar_deferred on every engine: where its schedule does not run, `check_optimizer` refuses it by
    the one rule (`api.distributed_gap`), naming why and what to use instead."""
    hooks_on_compiled: bool = False

    def check_optimizer(self, cfg: OptimizerConfig, schedule: Schedule = "in_backward") -> None:
        gap = api.distributed_gap(cfg, self.name, schedule)
        if gap is not None:
            raise ConfigFieldError(gap[1], field=gap[0])

    def no_sync(self, run: Run) -> AbstractContextManager[None]:
        # The DDP wrapper, or torch.compile's module around it (which forwards the attribute).
        return run.no_sync()  # type: ignore[attr-defined]

    def sonar(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        *,
        compiler: str,
        sonar_pass: bool,
        granularity: Granularity,
        experts: Experts,
        **sonar_kwargs: Any,
    ) -> tuple[Run, SonarOptimizer]:
        if granularity != "batched":
            raise ConfigFieldError(
                f"granularity={granularity!r} is a single-process ablation; the {self.name} engine updates "
                "each expert tensor whole",
                field="method",
            )
        run = self._setup(model, cfg, compiler, experts, sonar_kwargs)
        return run, api.sonar_of(run)

    @abstractmethod
    def _setup(
        self, model: nn.Module, cfg: OptimizerConfig, compiler: str, experts: Experts, options: dict[str, Any]
    ) -> nn.Module:
        """Sonar through the engine's `sonar_fx.distributed` entry point (`options`: its keywords)."""


@dataclass(frozen=True)
class DDPEngine(_Distributed):
    """DistributedDataParallel for the dense parameters, experts beside it (`sonar_fx.distributed.ddp`)."""

    name: str = "ddp"

    def _setup(
        self, model: nn.Module, cfg: OptimizerConfig, compiler: str, experts: Experts, options: dict[str, Any]
    ) -> nn.Module:
        import sonar_fx.distributed as sd

        return sd.ddp(model, cfg, compiler=compiler, experts=experts, **options)  # type: ignore[arg-type]

    def wrap(self, model: nn.Module, compiler: str) -> Run:
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
        return run if compiler == "eager" else torch.compile(run, backend=compiler)


@dataclass(frozen=True)
class FSDP2Engine(_Distributed):
    """FSDP2 (`fully_shard`), each experts module its own group (`sonar_fx.distributed.fsdp2`); compiled
    per block, so FSDP2's hooks run between the graphs."""

    name: str = "fsdp2"
    sharded: bool = True
    local_state: bool = True
    mesh: Any = None
    """The device mesh `fully_shard` shards over (None: its default, every rank of the default process
    group). The planner gives one made before its fake tensor mode, which cannot build a mesh."""

    def _setup(
        self, model: nn.Module, cfg: OptimizerConfig, compiler: str, experts: Experts, options: dict[str, Any]
    ) -> nn.Module:
        import sonar_fx.distributed as sd

        if self.mesh is not None:
            options = {"fully_shard_kwargs": {"mesh": self.mesh}, **options}
        return sd.fsdp2(model, cfg, compiler=compiler, experts=experts, **options)  # type: ignore[arg-type]

    def wrap(self, model: nn.Module, compiler: str) -> Run:
        import sonar_fx.distributed as sd

        sd.fully_shard_experts(model, **({} if self.mesh is None else {"mesh": self.mesh}))
        _compile_blocks(model, compiler)
        return model

    def no_sync(self, run: Run) -> AbstractContextManager[None]:
        return _fsdp2_no_sync(run)


@dataclass(frozen=True)
class ExpertParallelEngine(_Distributed):
    """Expert parallelism: each rank holds E/world experts, dense parameters through DDP
    (`sonar_fx.distributed.expert_parallel`); compiled per block, the all-to-alls between the graphs.
    Its global clip is torchtitan's: each expert tensor's norm combined over ranks (as DTensor reduces
    it), their norm with the dense norm (`sonar_fx.distributed.reductions.expert_parallel_norm`)."""

    name: str = "ep"
    sharded: bool = True

    def _setup(
        self, model: nn.Module, cfg: OptimizerConfig, compiler: str, experts: Experts, options: dict[str, Any]
    ) -> nn.Module:
        import sonar_fx.distributed as sd

        self.check_split(model, experts)
        return sd.expert_parallel(model, cfg, compiler=compiler, experts=experts, **options)  # type: ignore[arg-type]

    def wrap(self, model: nn.Module, compiler: str) -> Run:
        from torch.nn.parallel import DistributedDataParallel

        import sonar_fx.distributed as sd

        self.check_split(model, None)
        sd.shard_experts_(model)
        names = ExpertSet.discover(model).names
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        _compile_blocks(model, compiler)
        return DistributedDataParallel(model)

    def check_split(self, model: nn.Module, experts: Experts) -> None:
        """Refuse, before anything is laid out, a model with a layer whose experts the world size does
        not divide (`ConfigFieldError` on "parallel", naming the layer, its experts and the fix)."""
        from sonar_fx.distributed.expert_parallel import uneven_split

        problem = uneven_split(model, torch.distributed.get_world_size(), experts)
        if problem is not None:
            raise ConfigFieldError(problem, field="parallel")

    def expert_grad_scale(self) -> float:
        return 1.0 / torch.distributed.get_world_size()

    def total_norm(self, params: list[nn.Parameter], experts: set[int]) -> torch.Tensor:
        from sonar_fx.distributed.reductions import expert_parallel_norm

        dense = _grads_norm(p for p in params if id(p) not in experts)
        own = torch._foreach_norm([p.grad for p in params if id(p) in experts and p.grad is not None], 2.0)
        return expert_parallel_norm(dense, own, torch.distributed.group.WORLD)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FSDP2EPEngine(_Distributed):
    """FSDP2 x expert parallelism on a (dp, ep) mesh (`sonar_fx.distributed.fsdp2_ep`): each rank holds
    E/ep experts, FSDP2-sharded over its "dp" column, the dense parameters FSDP2 over every rank; compiled
    per block. Its global clip is torchtitan's: the experts' norm over the 2-D mesh (each expert counted
    once) with the dense norm over every rank, as squares."""

    name: str = "fsdp2_ep"
    sharded: bool = True
    local_state: bool = True
    experts_apart: bool = True
    ep_size: int | None = None
    """The expert-parallel degree: ranks a mesh row splits the experts over (`--ep-size`); the rest,
    world / ep_size, is FSDP2's data-parallel degree over each expert shard. None: every rank (a
    1 x world mesh: on 2 ranks each holds half the experts)."""

    def mesh_shape(self, world: int) -> tuple[int, int]:
        """(dp, ep) over `world` ranks; an ep_size that does not divide the world is refused."""
        ep = world if self.ep_size is None else self.ep_size
        if ep < 1 or world % ep:
            raise ConfigFieldError(
                f"ep_size={ep} does not divide the world of {world} ranks into (dp, ep) = (world / ep_size, "
                f"ep_size); use a divisor of {world} (default: {world}, every rank its own expert shard)",
                field="ep_size",
            )
        return world // ep, ep

    def mesh(self, model: nn.Module, experts: Experts) -> Any:
        """This run's ("dp", "ep") device mesh, after checking that ep_size divides every layer's experts
        (refused before anything is laid out)."""
        from torch.distributed.device_mesh import init_device_mesh

        from sonar_fx.distributed.fsdp_ep import MESH_DIMS
        from sonar_fx.distributed.reductions import collective_device

        shape = self.mesh_shape(torch.distributed.get_world_size())
        for layer in ExpertSet.discover(model, experts).layers:
            if layer.num_experts % shape[1]:
                raise ConfigFieldError(
                    f"{layer.name} holds {layer.num_experts} experts, which ep_size={shape[1]} does not "
                    f"split evenly; use an ep_size that divides {layer.num_experts}",
                    field="ep_size",
                )
        return init_device_mesh(collective_device().type, shape, mesh_dim_names=MESH_DIMS)

    def _setup(
        self, model: nn.Module, cfg: OptimizerConfig, compiler: str, experts: Experts, options: dict[str, Any]
    ) -> nn.Module:
        import sonar_fx.distributed as sd

        mesh = self.mesh(model, experts)
        return sd.fsdp2_ep(model, cfg, mesh=mesh, compiler=compiler, experts=experts, **options)  # type: ignore[arg-type]

    def wrap(self, model: nn.Module, compiler: str) -> Run:
        import sonar_fx.distributed as sd

        sd.shard_fsdp2_ep(model, self.mesh(model, None))
        _compile_blocks(model, compiler)
        return model

    def no_sync(self, run: Run) -> AbstractContextManager[None]:
        return _fsdp2_no_sync(run)

    def total_norm(self, params: list[nn.Parameter], experts: set[int]) -> torch.Tensor:
        # torchtitan's `_clip_grad_norm_with_ep`: each expert gradient seen as a DTensor over the 2-D
        # mesh (its "ep" row and FSDP2's "dp" column), so `full_tensor()` counts each expert once.
        from torch.distributed.tensor import DTensor, Shard

        own = [cast(DTensor, p.grad) for p in params if id(p) in experts and p.grad is not None]
        if not own:  # the dense-only clip: one mesh, clip_grad_norm_'s own norm
            return super().total_norm(params, experts)
        dense = [p.grad for p in params if id(p) not in experts and p.grad is not None]
        mesh = own[0].device_mesh._get_root_mesh()  # the (dp, ep) mesh FSDP2's "dp" mesh was cut from
        as_2d = [DTensor.from_local(g.to_local(), mesh, [Shard(0), Shard(0)]) for g in own]
        with quiet_norm_over_mesh_dims():  # DTensor's note on its two all-reduces (harmless: see there)
            ep_norm = cast(DTensor, torch.nn.utils.get_total_norm(as_2d)).full_tensor()
        dense_norm = cast(DTensor, torch.nn.utils.get_total_norm(dense)).full_tensor()
        total = ep_norm**2 + dense_norm**2
        total **= 1.0 / 2
        return total

    def clip_with_norm_(
        self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor, experts: set[int]
    ) -> None:
        # One foreach scale per mesh (a DTensor op spans one mesh), experts first as torchtitan does.
        torch.nn.utils.clip_grads_with_norm_([p for p in params if id(p) in experts], max_norm, norm)
        torch.nn.utils.clip_grads_with_norm_([p for p in params if id(p) not in experts], max_norm, norm)


@contextmanager
def _fsdp2_no_sync(root: Any) -> Iterator[None]:
    """FSDP2's accumulation without reduction: the root's gradient sync off, back on at the exit (the
    last micro-batch then reduce-scatters the sum)."""
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def _grads_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def _compile_blocks(model: nn.Module, compiler: str) -> None:
    """torch.compile each repeated block that holds experts (a baseline's per-block compile)."""
    from sonar_fx.compiled import repeated_blocks

    if compiler != "eager":
        layers = ExpertSet.discover(model).layers
        for _, block in repeated_blocks(model, [layer.name for layer in layers]):
            block.compile(backend=compiler)


SINGLE_PROCESS = SingleProcess()
ENGINES: dict[str, Engine] = {
    e.name: e for e in (DDPEngine(), FSDP2Engine(), ExpertParallelEngine(), FSDP2EPEngine())
}
"""The torch.distributed engines by their `--parallel` name."""


def engine_named(name: str | None) -> Engine:
    """The engine `--parallel name` runs on (None: one process)."""
    if name is None:
        return SINGLE_PROCESS
    if name not in ENGINES:
        raise ConfigFieldError(
            f"parallel={name!r} is invalid: expected one of {', '.join(ENGINES)}", field="parallel"
        )
    return ENGINES[name]
