"""Training methods as first-class objects: Sonar and the baselines it is measured against.

One `TrainingMethod.train_step(batch)` runs any of them, so tests, benchmarks and the CLI compare
like with like:
- standard: all gradients kept, global-norm clip of ALL gradients, one fused optimizer at step()
  (the exact twin of sonar with expert_clip="global");
- standard_no_expert_clip: the same, clipping only the dense gradients (the exact twin of sonar with
  expert_clip=None), and each expert gradient by its own norm under expert_clip="per_tensor";
- oib_all: every parameter updated in its own post-accumulate-grad hook, no clipping;
- sonar / sonar_per_expert: `sonar_fx.compile` (batched, or the per-expert ablation).
The optimizer is the config's (AdamW, Adam, SGD, Lion): baselines use torch's fused optimizer for it
(`UpdateRule.torch_optimizer`; Lion: the reference `LionRef`; low-bit expert states: torchao's).
How a method runs is one `Execution`: compiler "eager", or "aot_eager" / "inductor" through
torch.compile; for sonar under a compiler, `sonar_pass=False` keeps the hooks on the compiled model
instead of the graph pass. Never: change a method's arithmetic with the execution mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from sonar_fx import api
from sonar_fx.config import ConfigFieldError, OptimizerConfig
from sonar_fx.experts.discovery import DEFAULT_EXPERT_BIASES, discover_experts
from sonar_fx.optim.optimizer import Granularity, SonarOptimizer
from sonar_fx.optim.rules import rule_for

METHODS = ("standard", "standard_no_expert_clip", "oib_all", "sonar", "sonar_per_expert")


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
        """Short name for tables and progress bars: "eager", "inductor", "inductor+hooks"."""
        return self.compiler if self.sonar_pass else f"{self.compiler}+hooks"


@dataclass
class TrainingMethod:
    """A model to run and the optimizer that trains it, behind one step function."""

    name: str
    execution: Execution
    model: Callable[..., Any]
    optimizer: torch.optim.Optimizer | None
    clip_params: list[nn.Parameter] = field(default_factory=list)
    """Parameters whose gradients `optimizer_step` clips by global norm (empty: no clipping)."""
    max_grad_norm: float | None = None
    hook_optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    per_tensor_clip: list[nn.Parameter] = field(default_factory=list)
    """Parameters whose gradients `optimizer_step` clips each by its own norm (after `clip_params`)."""
    expert_optimizer: torch.optim.Optimizer | None = None
    """A second end-of-step optimizer for the expert tensors (low-bit states: torchao's)."""

    def __post_init__(self) -> None:
        if isinstance(self.execution, str):  # a compiler name, as callers built it before `Execution`
            self.execution = Execution(compiler=cast(api.Compiler, self.execution))

    @property
    def compiler(self) -> str:
        return self.execution.compiler

    def forward_backward(self, batch: Mapping[str, Tensor]) -> Tensor:
        if isinstance(self.optimizer, SonarOptimizer):
            # Two forward/backward passes under expert_clip="global" (see SonarOptimizer.backward).
            return self.optimizer.backward(lambda: self.model(**batch).loss)
        loss = self.model(**batch).loss
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        if self.clip_params and self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clip_params, self.max_grad_norm)
        for p in self.per_tensor_clip:
            if p.grad is not None and self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([p], self.max_grad_norm)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Mapping[str, Tensor]) -> Tensor:
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

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
    experts: Any = None,
    **sonar_kwargs: Any,
) -> TrainingMethod:
    """Wrap `model` for training with method `name` (see the module docstring).

    The execution mode is `execution`, or `Execution(compiler=..., sonar_pass=...)` from the two
    keywords (default: eager); passing both forms is refused.
    """
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}: expected one of {', '.join(METHODS)}.")
    execution = _execution(execution, compiler, sonar_pass)
    check_clip(name, cfg)
    if name.startswith("sonar"):
        granularity: Granularity = "per_expert" if name == "sonar_per_expert" else "batched"
        if execution.compiled and not execution.sonar_pass:
            optimizer = api.prepare(model, cfg, experts=experts, granularity=granularity, **sonar_kwargs)
            run = _compiled(model, execution.compiler)
        else:
            run = api.compile(
                model, cfg, compiler=execution.compiler, experts=experts, granularity=granularity,
                **sonar_kwargs,
            )  # fmt: skip
            optimizer = api.sonar_of(run)
        return TrainingMethod(name, execution, run, optimizer)
    run = _compiled(model, execution.compiler) if execution.compiled else model
    params = [p for p in model.parameters() if p.requires_grad]
    # Expert states stored unlike dense ones (low-bit): the experts get their own optimizer(s).
    split = getattr(cfg, "state_bits", 32) != getattr(cfg, "dense_state_bits", 32)
    if name == "oib_all" and not split:
        return TrainingMethod(name, execution, run, None, hook_optimizers=_hook_every_param(params, cfg))
    biases = sonar_kwargs.get("expert_biases", DEFAULT_EXPERT_BIASES)  # the same split as Sonar's
    layers = discover_experts(model, experts, expert_biases=biases)
    expert_ids = {id(t.param) for layer in layers for t in layer.tensors}
    if name == "oib_all":
        hooked = _hook_every_param(params, cfg, expert_ids)
        return TrainingMethod(name, execution, run, None, hook_optimizers=hooked)
    dense = [p for p in params if id(p) not in expert_ids]
    expert_params = [p for p in params if id(p) in expert_ids]
    baseline = rule_for(cfg).torch_optimizer(dense if split else params, cfg)
    expert_optimizer = rule_for(cfg, experts=True).torch_optimizer(expert_params, cfg) if split else None
    clip = params if name == "standard" else dense
    per_tensor = expert_params if cfg.expert_clip == "per_tensor" and cfg.clips else []
    return TrainingMethod(
        name, execution, run, baseline, clip if cfg.clips else [], cfg.max_grad_norm,
        per_tensor_clip=per_tensor, expert_optimizer=expert_optimizer,
    )  # fmt: skip


def twin_method(cfg: OptimizerConfig) -> str:
    """The end-of-step baseline that Sonar with `cfg` equals bitwise (see the module docstring)."""
    return "standard" if cfg.expert_clip == "global" else "standard_no_expert_clip"


def check_clip(name: str, cfg: OptimizerConfig) -> None:
    """A baseline clips as its name says; an `expert_clip` it cannot honour is refused, not ignored."""
    allowed = {
        "standard": (None, "global"),
        "standard_no_expert_clip": (None, "per_tensor"),
        "oib_all": (None,),
    }.get(name)
    if allowed is not None and cfg.expert_clip not in allowed:
        raise ConfigFieldError(
            f"method {name!r} cannot clip expert gradients {cfg.expert_clip!r}: standard clips all gradients "
            "together (expert_clip None or 'global'), standard_no_expert_clip the dense ones (plus each "
            "expert tensor alone with 'per_tensor'), oib_all none. Pick the matching method or expert_clip.",
            field="expert_clip",
        )


def _execution(execution: Execution | None, compiler: str | None, sonar_pass: bool | None) -> Execution:
    if execution is not None:
        if compiler is not None or sonar_pass is not None:
            raise ValueError("build_method: pass execution=Execution(...) or compiler/sonar_pass, not both.")
        return execution
    chosen = cast(api.Compiler, compiler or "eager")
    return Execution(compiler=chosen, sonar_pass=True if sonar_pass is None else sonar_pass)


def _compiled(model: nn.Module, compiler: str) -> Callable[..., Any]:
    return torch.compile(model, backend=compiler)


def _hook_every_param(
    params: list[nn.Parameter], cfg: OptimizerConfig, expert_ids: frozenset[int] | set[int] = frozenset()
) -> dict[int, torch.optim.Optimizer]:
    dense_rule, expert_rule = rule_for(cfg), rule_for(cfg, experts=True)  # states stored as Sonar's
    optimizers: dict[int, torch.optim.Optimizer] = {
        id(p): (expert_rule if id(p) in expert_ids else dense_rule).torch_optimizer([p], cfg) for p in params
    }

    def step_and_free(p: Tensor) -> None:
        optimizers[id(p)].step()
        p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step_and_free)
    return optimizers
