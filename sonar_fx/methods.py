"""Training methods as first-class objects: Sonar and the baselines it is measured against.

One `TrainingMethod.train_step(batch)` runs any of them, so tests, benchmarks and the CLI compare
like with like:
- standard: all gradients kept, global-norm clip of ALL gradients, one fused AdamW at step();
- standard_no_expert_clip: the same, clipping only the dense gradients (Sonar's exact twin);
- oib_all: every parameter updated in its own post-accumulate-grad hook, no clipping;
- sonar / sonar_per_expert: `sonar_fx.compile` (batched, or the per-expert ablation).
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
from sonar_fx.config import AdamWConfig, ConfigFieldError
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.optim.optimizer import Granularity

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

    def __post_init__(self) -> None:
        if isinstance(self.execution, str):  # a compiler name, as callers built it before `Execution`
            self.execution = Execution(compiler=cast(api.Compiler, self.execution))

    @property
    def compiler(self) -> str:
        return self.execution.compiler

    def forward_backward(self, batch: Mapping[str, Tensor]) -> Tensor:
        loss = self.model(**batch).loss
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        if self.clip_params and self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clip_params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Mapping[str, Tensor]) -> Tensor:
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer that holds state: the one optimizer, or oib_all's per-parameter optimizers
        in parameter order. LR schedulers drive each of them and checkpoints save each of them."""
        if self.optimizer is not None:
            return [self.optimizer]
        return list(self.hook_optimizers.values())


def build_method(
    name: str,
    model: nn.Module,
    cfg: AdamWConfig,
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
    if name == "oib_all":
        return TrainingMethod(name, execution, run, None, hook_optimizers=_hook_every_param(params, cfg))
    adamw = _adamw(params, cfg)
    if name == "standard":
        clip = params
    else:
        expert_ids = {id(t.param) for layer in discover_experts(model, experts) for t in layer.tensors}
        clip = [p for p in params if id(p) not in expert_ids]
    return TrainingMethod(name, execution, run, adamw, clip if cfg.clips else [], cfg.max_grad_norm)


def _execution(execution: Execution | None, compiler: str | None, sonar_pass: bool | None) -> Execution:
    if execution is not None:
        if compiler is not None or sonar_pass is not None:
            raise ValueError("build_method: pass execution=Execution(...) or compiler/sonar_pass, not both.")
        return execution
    chosen = cast(api.Compiler, compiler or "eager")
    return Execution(compiler=chosen, sonar_pass=True if sonar_pass is None else sonar_pass)


def _adamw(params: list[nn.Parameter], cfg: AdamWConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
    )


def _compiled(model: nn.Module, compiler: str) -> Callable[..., Any]:
    return torch.compile(model, backend=compiler)


def _hook_every_param(params: list[nn.Parameter], cfg: AdamWConfig) -> dict[int, torch.optim.Optimizer]:
    optimizers: dict[int, torch.optim.Optimizer] = {id(p): _adamw([p], cfg) for p in params}

    def step_and_free(p: Tensor) -> None:
        optimizers[id(p)].step()
        p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step_and_free)
    return optimizers
