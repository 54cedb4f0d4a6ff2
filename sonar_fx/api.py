"""The public entry points: `sonar_fx.compile(model, cfg)` and `sonar_fx.prepare(model, cfg)`.

`prepare` finds the expert tensors, builds the `SonarOptimizer`, registers its slots and the eager
hooks (the safety net that covers any gradient a compiled graph did not consume), and validates what
would otherwise train silently wrong. `compile` adds torch.compile with the "sonar" backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, cast

import torch
from torch import nn

from sonar_fx.backend import make_sonar_backend, record_fallback
from sonar_fx.config import AdamWConfig
from sonar_fx.eager import register_expert_hooks
from sonar_fx.experts.discovery import DEFAULT_EXPERT_BIASES, ExpertBiases, ExpertLayer, discover_experts
from sonar_fx.optim import slots
from sonar_fx.optim.optimizer import Accumulation, Granularity, SonarOptimizer, SonarUsageError

Compiler = Literal["inductor", "aot_eager", "eager"]
COMPILERS = ("inductor", "aot_eager", "eager")


def prepare(
    model: nn.Module,
    opt_cfg: AdamWConfig,
    *,
    experts: Iterable[nn.Parameter | str] | None = None,
    granularity: Granularity = "batched",
    accumulation: Accumulation = None,
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
) -> SonarOptimizer:
    """Build the `SonarOptimizer` for `model`, register its expert hooks and set `model.sonar`.

    `expert_biases`: per-expert biases (gpt-oss) train with their experts ("experts", default) or with
    the dense parameters ("dense": clipped, updated at `step()`)."""
    if not isinstance(opt_cfg, AdamWConfig):
        raise TypeError(
            f"opt_cfg must be sonar_fx.AdamWConfig, got {type(opt_cfg).__name__}. Sonar updates each expert "
            "tensor alone during backward, which is exact only for an element-wise optimizer (AdamW): build "
            "one with sonar_fx.AdamWConfig(lr=..., betas=..., weight_decay=..., max_grad_norm=...)."
        )
    if getattr(model, "sonar", None) is not None:
        raise SonarUsageError(
            "This model is already prepared for Sonar (model.sonar exists); build a fresh one."
        )
    if any(p.is_meta for p in model.parameters()):
        raise SonarUsageError(
            "The model has parameters on the meta device. Materialise and load it first (model.to_empty("
            "device=...), then load_state_dict), then call sonar_fx.prepare / compile: to_empty replaces the "
            "parameter objects, and Sonar trains the objects it was given."
        )
    layers = discover_experts(model, experts, expert_biases=expert_biases)
    expert_ids = {id(t.param) for layer in layers for t in layer.tensors}
    _check_dtypes_and_devices(layers)
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
    optimizer = SonarOptimizer(dense, layers, opt_cfg, granularity=granularity, accumulation=accumulation)
    for layer in layers:
        for t in layer.tensors:
            slots.register(optimizer, t.param)
    optimizer.hook_handles = register_expert_hooks(optimizer)
    model.__dict__["sonar"] = optimizer  # a plain attribute: not a submodule, not in state_dict()
    return optimizer


def sonar_of(model: nn.Module) -> SonarOptimizer:
    """The `SonarOptimizer` of a prepared or compiled model (`model.sonar`)."""
    optimizer = getattr(model, "sonar", None)
    if not isinstance(optimizer, SonarOptimizer):
        raise SonarUsageError("This model is not prepared for Sonar: call sonar_fx.compile or prepare first.")
    return optimizer


def compile(
    model: nn.Module,
    opt_cfg: AdamWConfig,
    *,
    compiler: Compiler = "inductor",
    experts: Iterable[nn.Parameter | str] | None = None,
    granularity: Granularity = "batched",
    fallback: bool = True,
    accumulation: Accumulation = None,
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Sonar-MoE training for `model`: returns the model to train; its optimizer is `.sonar`.

    `compiler="inductor"` (default) or `"aot_eager"` compile the model with the graph pass that updates
    expert tensors inside the backward graph; `"eager"` keeps the model eager and updates them from
    post-accumulate-grad hooks (the paper's method). With `fallback=True` a compiler failure warns once
    and training continues on the hooks; with `fallback=False` it raises.
    """
    if compiler not in COMPILERS:
        raise ValueError(f"compiler={compiler!r}: expected one of {', '.join(COMPILERS)}.")
    optimizer = prepare(
        model, opt_cfg, experts=experts, granularity=granularity, accumulation=accumulation,
        expert_biases=expert_biases,
    )  # fmt: skip
    if compiler == "eager":
        return model
    backend = make_sonar_backend(compiler, fallback=fallback)
    optimizer.compiler = compiler
    # The compiled wrapper forwards missing attributes to `model`, so `compiled.sonar` is the optimizer.
    compiled = cast(nn.Module, torch.compile(model, backend=backend, **torch_compile_kwargs))
    if fallback:
        _fall_back_on_dynamo_errors(compiled, model, optimizer)
    return compiled


def _fall_back_on_dynamo_errors(compiled: nn.Module, model: nn.Module, optimizer: SonarOptimizer) -> None:
    """Run `model` eagerly (hooks update the experts) from the first dynamo failure on.

    Backend failures (AOTAutograd, inductor, the pass) are caught per graph by the backend; this
    catches what fails before any backend runs (tracing errors, e.g. a graph break under
    fullgraph=True). A forward that failed to compile has run no backward, so nothing was updated
    yet and running it again eagerly is safe.
    """
    compiled_forward = compiled.forward
    failed: list[str] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if failed:
            return model(*args, **kwargs)
        try:
            return compiled_forward(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            failed.append(record_fallback(optimizer, err))
            return model(*args, **kwargs)

    compiled.forward = forward


def _check_dtypes_and_devices(layers: list[ExpertLayer]) -> None:
    for layer in layers:
        params = [t.param for t in layer.tensors]
        if any(p.dtype == torch.float16 for p in params):
            raise SonarUsageError(
                f"{layer.name}: fp16 expert weights need a GradScaler, whose unscale and inf check would "
                "run after Sonar has already applied the update in backward. Train in bf16 or fp32."
            )
        if len({(p.dtype, p.device) for p in params}) > 1:
            found = ", ".join(f"{t.name}: {t.param.dtype} on {t.param.device}" for t in layer.tensors)
            raise SonarUsageError(
                f"{layer.name}: expert tensors disagree in dtype or device ({found}); move the model "
                "with model.to(device, dtype) first."
            )
