"""Training methods as first-class objects: Sonar and the baselines it is measured against.

One `TrainingMethod.train_step(batch)` runs any of them, so tests, benchmarks and the CLI compare
like with like:
- standard: all gradients kept, global-norm clip of ALL gradients, one fused optimizer at step()
  (the exact twin of sonar with expert_clip="global");
- standard_no_expert_clip: the same, clipping only the dense gradients (the exact twin of sonar with
  expert_clip=None), and each expert gradient by its own norm under expert_clip="per_tensor";
- oib_all: every parameter updated in its own post-accumulate-grad hook, no clipping;
- sonar / sonar_per_expert: `sonar_fx.compile` (batched, or the per-expert ablation);
- sonar_deferred: `sonar_fx.compile(schedule="deferred")`: expert gradients computed at step() from
  operands kept in backward (exact all-parameter clipping and accumulation).
What a method is (Sonar or not, which gradients it clips) is its `Method`, looked up by name; the
string tests on names live nowhere else. The optimizer is the config's (AdamW, Adam, SGD, Lion, Muon):
baselines use torch's fused optimizer for it (`rules.end_of_step_optimizer`; Lion: the reference
`LionRef`; low-bit expert states: torchao's; Muon: `MuonTwin`, torch.optim.Muon per matrix and fused
AdamW for the rest). How a method runs is one `Execution`: compiler "eager",
or "aot_eager" / "inductor" through torch.compile; for sonar under a compiler, `sonar_pass=False`
keeps the hooks on the compiled model instead of the graph pass. Where it runs is an `Engine`
(`sonar_fx.engines`: one process, DDP, FSDP2, expert parallel): `build_method` is the one builder for
every method on every engine. A step of several micro-batches runs all but the last under the
engine's `no_sync` (gradients reduced once, at the last backward) for every method that accumulates
to the step, baselines and the deferred schedule alike: the same arithmetic on both sides of a
comparison. Never: change a method's arithmetic with the execution mode or engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from sonar_fx import api
from sonar_fx.config import ConfigFieldError, ExpertClip, OptimizerConfig
from sonar_fx.engines import SINGLE_PROCESS, Engine
from sonar_fx.experts.discovery import DEFAULT_EXPERT_BIASES, ExpertSet, Split
from sonar_fx.optim.matrices import matrix_params
from sonar_fx.optim.optimizer import Granularity, Schedule, SonarOptimizer
from sonar_fx.optim.rules import end_of_step_optimizer, rule_for


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How a training method runs: eager, or compiled (with or without Sonar's graph pass)."""

    compiler: api.Compiler = "eager"
    """"eager": no torch.compile; "aot_eager" / "inductor": the torch.compile backend."""
    sonar_pass: bool = True
    """Sonar under a compiler: True updates experts inside the backward graph; False keeps the eager
    hooks on the compiled model (what the pass improves on). Other methods ignore it."""

    def __post_init__(self) -> None:
        if self.compiler not in api.COMPILERS:
            raise ConfigFieldError(
                f"Execution.compiler={self.compiler!r} is invalid: expected one of "
                f"{', '.join(api.COMPILERS)}.",
                field="compiler",
            )
        if self.compiler == "eager" and not self.sonar_pass:
            raise ConfigFieldError(
                "Execution.sonar_pass=False (hooks on a compiled model) needs compiler 'aot_eager' or "
                "'inductor'.",
                field="sonar_pass",
            )

    @property
    def compiled(self) -> bool:
        return self.compiler != "eager"

    @property
    def label(self) -> str:
        """Short name for tables, progress bars and benchmark flags: "eager", "inductor", "inductor+hooks"."""
        return self.compiler if self.sonar_pass else f"{self.compiler}+hooks"

    @classmethod
    def from_label(cls, label: str) -> Execution:
        """The execution a `label` names (its inverse)."""
        compiler, hooks, _ = label.partition("+hooks")
        return cls(compiler=cast(api.Compiler, compiler), sonar_pass=not hooks)


Clip = Literal["all", "dense", "none"]


@dataclass(frozen=True)
class Method:
    """What a training method is: Sonar or a baseline, and which gradients it clips."""

    name: str
    """As `--method` and `build_method` spell it."""
    clip: Clip
    """Which gradients one global norm clips: every one, the dense ones, or none. Sonar's follows
    `expert_clip` (see `clipped`); each baseline's is fixed and refuses an `expert_clip` it cannot honour."""
    expert_clips: tuple[ExpertClip, ...]
    """The `expert_clip` values the method honours."""
    sonar: bool = False
    """Expert tensors are updated during backward by `SonarOptimizer`."""
    granularity: Granularity = "batched"
    """Sonar: one update per expert tensor ("batched") or per expert slice (the ablation)."""
    per_param_hooks: bool = False
    """Every parameter updated in its own post-accumulate-grad hook (oib_all)."""
    schedule: Schedule = "in_backward"
    """Sonar: experts updated in backward, or at step() from kept operands ("deferred")."""

    @classmethod
    def named(cls, name: str) -> Method:
        """The method called `name` (one of `METHODS`)."""
        if name not in METHOD_KINDS:
            raise ConfigFieldError(
                f"unknown method {name!r}: expected one of {', '.join(METHODS)}", field="method"
            )
        return METHOD_KINDS[name]

    def clipped(self, cfg: OptimizerConfig) -> Clip:
        """Which gradients one global norm clips under `cfg` (expert_clip="per_tensor" clips each expert
        tensor by its own norm besides)."""
        if not cfg.clips:
            return "none"
        if self.sonar:
            return "all" if cfg.expert_clip == "global" else "dense"
        return self.clip

    @property
    def accumulates_to_step(self) -> bool:
        """Its gradients of a step's micro-batches are summed and used at step() (baselines, the deferred
        schedule), so an engine reduces them once, at the last backward; in-backward updates use each
        backward's gradient as it comes."""
        return not self.per_param_hooks and not (self.sonar and self.schedule == "in_backward")

    def updates_in_hooks(self, execution: Execution) -> bool:
        """Whether its in-backward updates run in post-accumulate-grad hooks (not in the graph)."""
        in_backward = self.sonar and self.schedule == "in_backward"
        return self.per_param_hooks or (in_backward and not (execution.compiled and execution.sonar_pass))

    def check_clip(self, cfg: OptimizerConfig) -> None:
        """A baseline clips as its name says; an `expert_clip` it cannot honour is refused, not ignored."""
        if cfg.expert_clip not in self.expert_clips:
            raise ConfigFieldError(
                f"method {self.name!r} cannot clip expert gradients {cfg.expert_clip!r}: standard clips all "
                "gradients together (expert_clip None or 'global'), standard_no_expert_clip the dense ones "
                "(plus each expert tensor alone with 'per_tensor'), oib_all none. Pick the matching method "
                "or expert_clip.",
                field="expert_clip",
            )


_ANY_CLIP: tuple[ExpertClip, ...] = (None, "global", "per_tensor")
METHOD_KINDS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("standard", clip="all", expert_clips=(None, "global")),
        Method("standard_no_expert_clip", clip="dense", expert_clips=(None, "per_tensor")),
        Method("oib_all", clip="none", expert_clips=(None,), per_param_hooks=True),
        Method("sonar", clip="dense", expert_clips=_ANY_CLIP, sonar=True),
        Method(
            "sonar_per_expert", clip="dense", expert_clips=_ANY_CLIP, sonar=True, granularity="per_expert"
        ),
        Method("sonar_deferred", clip="dense", expert_clips=_ANY_CLIP, sonar=True, schedule="deferred"),
    )
}
METHODS = tuple(METHOD_KINDS)


@dataclass(frozen=True)
class GradClip:
    """What a baseline does to gradients at step(), before its optimizers, in this order: scale the
    expert gradients (expert parallelism), clip `together` by their global norm, then each of `each` by
    its own norm. The clip rule of every baseline on every engine (`GradClip.of`)."""

    max_norm: float | None = None
    together: list[nn.Parameter] = field(default_factory=list)
    each: list[nn.Parameter] = field(default_factory=list)
    experts: list[nn.Parameter] = field(default_factory=list)
    expert_scale: float = 1.0
    engine: Engine = SINGLE_PROCESS
    """Whose global norm clips `together` (`Engine.total_norm`; expert parallelism combines ranks)."""

    @classmethod
    def of(
        cls, method: Method, cfg: OptimizerConfig, split: Split, engine: Engine = SINGLE_PROCESS
    ) -> GradClip:
        clipped = method.clipped(cfg)
        together = {"all": split.params, "dense": split.dense_params, "none": []}[clipped]
        each = split.expert_params if cfg.clips and cfg.expert_clip == "per_tensor" else []
        return cls(cfg.max_grad_norm, together, each, split.expert_params, engine.expert_grad_scale(), engine)

    def apply_(self) -> None:
        if self.expert_scale != 1.0:
            for p in self.experts:
                if p.grad is not None:
                    p.grad.mul_(self.expert_scale)
        if self.max_norm is None:
            return
        if self.together:
            # get_total_norm + clip_grads_with_norm_ is clip_grad_norm_ (the same calls, the same bits).
            expert_ids = {id(p) for p in self.experts}
            norm = self.engine.total_norm(self.together, expert_ids)
            self.engine.clip_with_norm_(self.together, self.max_norm, norm, expert_ids)
        for p in self.each:
            if p.grad is not None:
                torch.nn.utils.clip_grad_norm_([p], self.max_norm)


@dataclass
class TrainingMethod:
    """A model to run and the optimizer that trains it, behind one step function."""

    kind: Method
    execution: Execution
    model: Callable[..., Any]
    optimizer: torch.optim.Optimizer | None
    clip: GradClip = field(default_factory=GradClip)
    """A baseline's gradient scaling and clipping before its optimizers step (Sonar clips inside)."""
    hook_optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    expert_optimizer: torch.optim.Optimizer | None = None
    """A second end-of-step optimizer for the expert tensors (low-bit states: torchao's)."""
    engine: Engine = SINGLE_PROCESS
    """Where `model` runs: its `no_sync` is the accumulation context of a step's early micro-batches."""

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def compiler(self) -> str:
        return self.execution.compiler

    def forward_backward(self, batch: Mapping[str, Tensor], micro_batches: int = 1) -> Tensor:
        """Forward and backward of `batch`, one of `micro_batches` of a step: its loss divided by their
        number (the mean over the step, as transformers' Trainer divides it); returns it, divided."""

        def loss() -> Tensor:
            out = self.model(**batch).loss
            return out if micro_batches == 1 else out / micro_batches

        if isinstance(self.optimizer, SonarOptimizer):
            # Two forward/backward passes under expert_clip="global" (see SonarOptimizer.backward).
            return self.optimizer.backward(loss)
        out = loss()
        out.backward()
        return out.detach()

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        self.clip.apply_()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]]) -> Tensor:
        """One optimizer step on `batch`, or on each of a list of micro-batches (their gradients
        accumulated, each loss divided by their number; the loss returned is their mean). A method that
        accumulates to the step runs every micro-batch but the last under the engine's `no_sync`."""
        micro = [batch] if isinstance(batch, Mapping) else list(batch)
        losses = []
        for i, b in enumerate(micro):
            quiet = self.kind.accumulates_to_step and i < len(micro) - 1
            with self.engine.no_sync(self.model) if quiet else nullcontext():
                losses.append(self.forward_backward(b, len(micro)))
        self.optimizer_step()
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer that holds state: the one optimizer, or oib_all's per-parameter optimizers
        in parameter order. LR schedulers drive each of them and checkpoints save each of them."""
        if self.optimizer is not None:
            return [self.optimizer] + ([self.expert_optimizer] if self.expert_optimizer is not None else [])
        return list(self.hook_optimizers.values())


def build_method(
    name: str,
    model: nn.Module,
    cfg: OptimizerConfig,
    *,
    execution: Execution | None = None,
    compiler: str | None = None,
    sonar_pass: bool | None = None,
    engine: Engine = SINGLE_PROCESS,
    experts: Any = None,
    **sonar_kwargs: Any,
) -> TrainingMethod:
    """Put `model` on `engine` for training with method `name` (see the module docstring).

    The execution mode is `execution`, or `Execution(compiler=..., sonar_pass=...)` from the two
    keywords (default: eager); passing both forms is refused. A combination the engine does not run
    is refused before anything is built (`check_engine`).
    """
    kind = Method.named(name)
    execution = _execution(execution, compiler, sonar_pass)
    kind.check_clip(cfg)
    check_engine(engine, kind, execution)
    engine.check_optimizer(cfg, kind.schedule)
    if kind.sonar:
        if kind.schedule != "in_backward":
            sonar_kwargs["schedule"] = kind.schedule
        run, sonar = engine.sonar(
            model, cfg, compiler=execution.compiler, sonar_pass=execution.sonar_pass,
            granularity=kind.granularity, experts=experts, **sonar_kwargs,
        )  # fmt: skip
        return TrainingMethod(kind, execution, run, sonar, engine=engine)
    run = engine.wrap(model, execution.compiler)
    # The same split as Sonar's, taken after the engine placed the model (FSDP2 swaps in DTensors).
    biases = sonar_kwargs.get("expert_biases", DEFAULT_EXPERT_BIASES)
    found = ExpertSet.discover(model, experts, expert_biases=biases)
    split = found.split(model)
    # The tensors a config with a matrix rule (Muon) updates as matrices: hidden ones and experts.
    matrices = [*matrix_params(cfg, model, found.layers), *split.expert_params]
    if kind.per_param_hooks:  # expert states stored as Sonar stores them
        hooked = _hook_every_param(split.params, cfg, matrices, {id(p) for p in split.expert_params})
        return TrainingMethod(kind, execution, run, None, hook_optimizers=hooked, engine=engine)
    # Expert states stored unlike dense ones (low-bit), or on a mesh of their own (FSDP2 x EP): the
    # experts get their own optimizer.
    separate = getattr(cfg, "state_bits", 32) != getattr(cfg, "dense_state_bits", 32) or engine.experts_apart
    optimizer = end_of_step_optimizer(
        cfg, split.dense_params if separate else split.params, matrices=matrices
    )
    expert_optimizer = (
        rule_for(cfg, experts=True).torch_optimizer(split.expert_params, cfg) if separate else None
    )
    clip = GradClip.of(kind, cfg, split, engine)
    return TrainingMethod(
        kind, execution, run, optimizer, clip, expert_optimizer=expert_optimizer, engine=engine
    )


def check_engine(engine: Engine, method: Method, execution: Execution) -> None:
    """Refuse a method or execution `engine` does not run (`ConfigFieldError` naming the field)."""
    if engine.methods is not None and method.name not in engine.methods:
        raise ConfigFieldError(
            f"method {method.name!r} is not available on the {engine.name} engine; use one of "
            f"{', '.join(engine.methods)}",
            field="method",
        )
    if execution.compiled and not engine.compiles:
        raise ConfigFieldError(
            f"the {engine.name} engine runs eager models only: use compiler 'eager'", field="compiler"
        )
    if not execution.sonar_pass and not engine.hooks_on_compiled:
        raise ConfigFieldError(
            f"hooks on a compiled model are a single-process ablation, not run on the {engine.name} engine",
            field="sonar_pass",
        )


def twin_method(cfg: OptimizerConfig) -> str:
    """The end-of-step baseline that Sonar with `cfg` equals bitwise (see the module docstring)."""
    return "standard" if cfg.expert_clip == "global" else "standard_no_expert_clip"


def _execution(execution: Execution | None, compiler: str | None, sonar_pass: bool | None) -> Execution:
    if execution is not None:
        if compiler is not None or sonar_pass is not None:
            raise ValueError("build_method: pass execution=Execution(...) or compiler/sonar_pass, not both.")
        return execution
    chosen = cast(api.Compiler, compiler or "eager")
    return Execution(compiler=chosen, sonar_pass=True if sonar_pass is None else sonar_pass)


def _hook_every_param(
    params: list[nn.Parameter],
    cfg: OptimizerConfig,
    matrices: list[nn.Parameter],
    expert_ids: frozenset[int] | set[int] = frozenset(),
) -> dict[int, torch.optim.Optimizer]:
    expert_rule = rule_for(cfg, experts=True)  # expert states stored as Sonar's
    optimizers: dict[int, torch.optim.Optimizer] = {
        id(p): expert_rule.torch_optimizer([p], cfg)
        if id(p) in expert_ids
        else end_of_step_optimizer(cfg, [p], matrices=matrices)
        for p in params
    }

    def step_and_free(p: Tensor) -> None:
        optimizers[id(p)].step()
        p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step_and_free)
    return optimizers
