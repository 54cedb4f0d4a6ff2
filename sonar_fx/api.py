"""The public entry points: `sonar_fx.compile(model, cfg)` and `sonar_fx.prepare(model, cfg)`.

`prepare` finds the expert tensors, builds the `SonarOptimizer` (which binds them and hooks them: the
hooks are the safety net for any gradient a compiled graph did not consume), and validates what would
otherwise train silently wrong. `compile` then compiles the model's forward (or each repeated block's)
in place with the "sonar" backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from sonar_fx.compiled import compile_forward_, repeated_blocks
from sonar_fx.config import OPTIMIZER_CONFIGS, MuonConfig, OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import DEFAULT_EXPERT_BIASES, ExpertBiases, ExpertSet
from sonar_fx.optim.backward_root import mark_backward_root
from sonar_fx.optim.defer_eager import defer_modules, register_defer_hooks
from sonar_fx.optim.deferred_loop import ZeroGradWithKept
from sonar_fx.optim.matrices import matrix_params
from sonar_fx.optim.optimizer import Accumulation, Granularity, NonFinite, Schedule, SonarOptimizer
from sonar_fx.optim.reduction import GradReduction
from sonar_fx.optim.saving import OnSavingLost
from sonar_fx.optim.untracked import UntrackedGradients

Compiler = Literal["inductor", "aot_eager", "eager"]
COMPILERS = ("inductor", "aot_eager", "eager")


def prepare(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    experts: Iterable[nn.Parameter | str] | None = None,
    granularity: Granularity = "batched",
    accumulation: Accumulation = None,
    nonfinite: NonFinite = "raise",
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
    distributed: GradReduction | None = None,
    on_saving_lost: OnSavingLost | None = None,
    schedule: Schedule = "in_backward",
) -> SonarOptimizer:
    """Build the `SonarOptimizer` for `model` (it binds the expert tensors and hooks them) and set
    `model.sonar`. `nonfinite` says what an inf/NaN gradient does: "raise" (default; the tensor is left
    untouched and the error names it), "skip" (the step is skipped and counted) or "ignore".
    `expert_biases`: per-expert biases (gpt-oss) train with their experts ("experts", default) or with
    the dense parameters ("dense": clipped, updated at `step()`).
    `on_saving_lost`: a compiled backward graph that returns expert gradients instead of updating them
    (so no memory is saved for them) warns ("warn") or raises `SavingLostError` ("raise"); default: the
    environment variable SONAR_FX_ON_SAVING_LOST, else "warn".
    `schedule="deferred"` keeps, in backward, the operands of each expert weight gradient instead of
    updating, and computes and applies each expert gradient at `step()`: exact all-parameter clipping
    (expert_clip="global" with a plain `loss.backward(); opt.step()`), gradient accumulation over any
    number of backwards, and GradScaler; it saves memory under `compile` (aot_eager, inductor), where
    the graph pass hands the operands over (docs/modes.md).
    `distributed` is set by `sonar_fx.distributed` (how expert gradients are reduced across ranks)."""
    return _prepare(
        model, opt_cfg, experts=experts, granularity=granularity, accumulation=accumulation,
        nonfinite=nonfinite, expert_biases=expert_biases, distributed=distributed, compiler="eager",
        on_saving_lost=on_saving_lost, schedule=schedule,
    )  # fmt: skip


def _prepare(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    experts: Iterable[nn.Parameter | str] | None,
    granularity: Granularity,
    accumulation: Accumulation,
    nonfinite: NonFinite,
    expert_biases: ExpertBiases,
    distributed: GradReduction | None,
    compiler: str,
    on_saving_lost: OnSavingLost | None,
    schedule: Schedule = "in_backward",
) -> SonarOptimizer:
    if not isinstance(opt_cfg, tuple(OPTIMIZER_CONFIGS.values())):
        raise TypeError(
            f"opt_cfg must be sonar_fx.AdamWConfig, AdamConfig, SGDConfig, LionConfig or MuonConfig, got "
            f"{type(opt_cfg).__name__}. Sonar updates each expert tensor alone during backward, which is "
            "exact only for an optimizer whose update of a tensor needs that tensor's gradient alone: build "
            "one, e.g. sonar_fx.AdamWConfig(lr=..., betas=..., weight_decay=..., max_grad_norm=...)."
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
    found = ExpertSet.discover(model, experts, expert_biases=expert_biases)
    if distributed is None:
        _refuse_gradient_reducing_wrappers(model, found, opt_cfg, schedule)
    else:
        _refuse_untested_distributed(opt_cfg, distributed, schedule)
    _check_dtypes_and_devices(found)
    split = found.split(model)
    optimizer = SonarOptimizer(
        split.dense_params, found.layers, opt_cfg, granularity=granularity, accumulation=accumulation,
        nonfinite=nonfinite, dense_names=[n for n, _ in split.dense], param_order=split.params,
        compiler=compiler, distributed=distributed, matrices=matrix_params(opt_cfg, model, found.layers),
        on_saving_lost=on_saving_lost, schedule=schedule,
    )  # fmt: skip
    optimizer.untracked = UntrackedGradients(model)
    model.__dict__["sonar"] = optimizer  # a plain attribute: not a submodule, not in state_dict()
    model.register_forward_hook(mark_backward_root)  # where each backward begins, for the step tracker
    if schedule == "deferred":  # eager forwards keep their GEMM operands; compiled ones get the pass
        register_defer_hooks(defer_modules(model, found.layers))
        model.zero_grad = ZeroGradWithKept(model)  # type: ignore[method-assign]  # drops the kept gradients too
    return optimizer


def sonar_of(model: nn.Module) -> SonarOptimizer:
    """The `SonarOptimizer` of a prepared or compiled model (`model.sonar`)."""
    optimizer = getattr(model, "sonar", None)
    if not isinstance(optimizer, SonarOptimizer):
        raise SonarUsageError("This model is not prepared for Sonar: call sonar_fx.compile or prepare first.")
    return optimizer


def compile(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    compiler: Compiler = "inductor",
    experts: Iterable[nn.Parameter | str] | None = None,
    granularity: Granularity = "batched",
    fallback: bool = True,
    accumulation: Accumulation = None,
    nonfinite: NonFinite = "raise",
    regional: bool = False,
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
    distributed: GradReduction | None = None,
    on_saving_lost: OnSavingLost | None = None,
    schedule: Schedule = "in_backward",
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Sonar-MoE training for `model`: returns `model` itself, compiled in place; its optimizer is `.sonar`.

    `compiler="inductor"` (default) or `"aot_eager"` compile the model's forward with the graph pass
    that updates expert tensors inside the backward graph; `"eager"` keeps the model eager and updates
    them from post-accumulate-grad hooks (the paper's method). `regional=True` compiles each repeated
    block that holds experts instead of the whole model: one graph, compiled once and reused for all L
    blocks, so compile time stays flat in depth. With `fallback=True` a compiler failure warns once and
    training continues on the hooks; with `fallback=False` it raises. `on_saving_lost` (see `prepare`)
    says what a compiled graph that leaves expert gradients to the hooks does; `schedule` (see
    `prepare`): "deferred" for exact all-parameter clipping, accumulation and GradScaler. The model keeps its
    class, signature and `state_dict()` keys.
    """
    if compiler not in COMPILERS:
        raise ValueError(f"compiler={compiler!r}: expected one of {', '.join(COMPILERS)}.")
    optimizer = _prepare(
        model, opt_cfg, experts=experts, granularity=granularity, accumulation=accumulation,
        nonfinite=nonfinite, expert_biases=expert_biases, distributed=distributed, compiler=compiler,
        on_saving_lost=on_saving_lost, schedule=schedule,
    )  # fmt: skip
    if compiler == "eager":
        return model
    if not regional:
        compile_forward_(model, compiler, fallback=fallback, **torch_compile_kwargs)
        return model
    blocks = repeated_blocks(model, [layer.name for layer in optimizer.expert_layers])
    _check_blocks_alike(blocks, optimizer)
    _turn_off_kv_cache(model)
    for _, block in blocks:
        compile_forward_(block, compiler, fallback=fallback, **torch_compile_kwargs)
    return model


def _check_blocks_alike(blocks: list[tuple[str, nn.Module]], optimizer: SonarOptimizer) -> None:
    """Blocks of one class share one graph: their expert tensors must sit at the same places."""
    experts = optimizer.experts.names_by_id()
    seen: dict[type, tuple[str, list[str]]] = {}
    for name, block in blocks:
        mine = sorted(n for n, p in block.named_parameters() if id(p) in experts)
        first = seen.setdefault(type(block), (name, mine))
        if first[1] != mine:
            raise SonarUsageError(
                f"regional=True: blocks {first[0]} and {name} are one class (so one compiled graph) but "
                f"hold expert tensors at different places ({first[1]} vs {mine}). Make the same tensors "
                "experts in every block, or compile the whole model (regional=False)."
            )


def _turn_off_kv_cache(model: nn.Module) -> None:
    """A KV cache gives each block its own cache slot, guarded per block: one graph per block."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        warnings.warn(
            "sonar_fx.compile(regional=True) set model.config.use_cache = False: training needs no KV cache, "
            "and a cache's per-layer state would compile one graph per block instead of one for all. "
            "Set it back before generating.",
            stacklevel=3,
        )


DTENSOR_ENGINES = ("fsdp2", "fsdp2_ep")
"""Engines whose expert tensors and states are DTensor shards (FSDP2)."""
DEFERRED_ENGINES = ("ddp", "ep", "fsdp2", "fsdp2_ep")
"""Engines that run schedule="deferred" (a multi-process test shows each bitwise against the plain one)."""


def distributed_gap(
    opt_cfg: OptimizerConfig, engine: str, schedule: str = "in_backward"
) -> tuple[str, str] | None:
    """The first setting of `opt_cfg` that the distributed engine `engine` (its `--parallel` or reduction
    name) does not run, as (field, why), or None. The one rule: `prepare` and `sonar_fx.engines` ask it.
    4-bit states on DTensor shards are refused: torchao's own 4-bit optimizer fails on them (torch 2.13,
    torchao 0.18: its compiled kernel asserts "wrong number of dimensions" on FSDP2 shards), so there
    is no twin to be exact against. Muon on DTensor shards: `sharded_matrices_gap`. The deferred
    schedule runs on DDP, expert parallelism, FSDP2 and FSDP2 x EP (`DEFERRED_ENGINES`: each expert
    gradient computed at step() is reduced as the engine reduces it, bitwise against its accumulation
    with gradient sync at the last micro-batch only); DDP's async in-backward overlap ("ddp-async")
    has no test of it, so it stays refused."""
    if schedule == "deferred" and engine not in DEFERRED_ENGINES:
        return "schedule", (
            f"schedule='deferred' is not supported on the {engine} engine yet: each rank keeps its own "
            "operands and nothing reduces the expert gradients computed from them at step(); use the "
            f"default schedule (in-backward updates) there, or the {', '.join(DEFERRED_ENGINES[:-1])} or "
            f"{DEFERRED_ENGINES[-1]} engine"
        )
    sharded = sharded_matrices_gap(opt_cfg) if engine in DTENSOR_ENGINES else None
    if sharded is not None:
        return "parallel", sharded.rstrip(".")
    if getattr(opt_cfg, "state_bits", 32) == 4 and engine in DTENSOR_ENGINES:
        return "state_bits", (
            f"state_bits=4 is not supported on the {engine} engine: torchao's 4-bit states fail on FSDP2's "
            "DTensor shards inside torchao's own optimizer (its compiled kernel rejects them), so nothing "
            "verifies them; use state_bits=8 there, or 4 on ddp or ep"
        )
    bits = getattr(opt_cfg, "dense_state_bits", 32)
    if bits != 32:  # low-bit dense states are planned and trained in one process, not yet on an engine
        return "dense_state_bits", (
            f"dense_state_bits={bits} is not supported on the {engine} engine yet (no engine test covers "
            "it): use dense_state_bits=32 there; state_bits=8 keeps the expert states low-bit"
        )
    return None


def sharded_matrices_gap(opt_cfg: OptimizerConfig) -> str | None:
    """Why `opt_cfg` cannot train on FSDP2 (the fix included), or None. Muon orthogonalises each whole
    matrix: FSDP2's expert shards would be whole expert matrices (Shard(0) splits E), but every dense
    hidden matrix reaches step() as a row shard. `distributed_gap` asks it for the DTensor engines."""
    if not isinstance(opt_cfg, MuonConfig):
        return None
    return (
        "MuonConfig with FSDP2: Muon orthogonalises each whole matrix, but FSDP2 hands every rank a "
        "Shard(0) slice of each dense hidden matrix at step() (its expert shards are whole expert "
        "matrices, the dense ones are not), and gathering them would undo the sharding. Train Muon with "
        "DDP or expert parallelism (sonar_fx.distributed.ddp or expert_parallel, --parallel ddp or ep), "
        "or AdamW on FSDP2."
    )


def _refuse_untested_distributed(opt_cfg: OptimizerConfig, distributed: GradReduction, schedule: str) -> None:
    gap = distributed_gap(opt_cfg, distributed.name, schedule)
    if gap is not None:
        raise SonarUsageError(gap[1] + ".")


def _refuse_gradient_reducing_wrappers(
    model: nn.Module, experts: ExpertSet, opt_cfg: OptimizerConfig, schedule: str
) -> None:
    """Experts under a wrapper that reduces gradients after backward would be updated from local ones:
    point to `sonar_fx.distributed`, which sets the engine up so that they are not, unless the one rule
    (`distributed_gap`) refuses this config there: then its reason, which names what runs instead."""
    from torch.nn.parallel import DistributedDataParallel

    wrappers: list[tuple[str, nn.Module]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, DistributedDataParallel) or _is_fsdp(m)
    ]
    for wrapper_name, wrapper in wrappers:
        prefix = f"{wrapper_name}." if wrapper_name else ""
        inside = [name for name in experts.names if name.startswith(prefix)]
        if inside:
            engine = "ddp" if isinstance(wrapper, DistributedDataParallel) else "fsdp2"
            gap = distributed_gap(opt_cfg, engine, schedule)
            fix = f"Nor does Sonar's own setup of it run this: {gap[1]}" if gap else f"Use {_SETUPS[engine]}"
            raise SonarUsageError(
                f"{inside[0]} is an expert tensor managed by {type(wrapper).__name__}, which reduces "
                "gradients across ranks after backward: a plain prepare/compile would update it from this "
                f"rank's local gradient and train silently wrong. {fix}."
            )


_SETUPS = {
    "ddp": "sonar_fx.distributed.ddp(model, cfg) on the unwrapped model (it keeps the experts out of DDP's "
    "buckets and all-reduces each expert gradient before its update)",
    "fsdp2": "sonar_fx.distributed.fsdp2(model, cfg) on the unwrapped model (FSDP2's fully_shard "
    "reduce-scatters each expert gradient before Sonar's hook updates the shard; FSDP1's flat "
    "parameters are not supported)",
}
"""What sets each wrapping engine up for Sonar (`_refuse_gradient_reducing_wrappers`' fix)."""


def _is_fsdp(module: nn.Module) -> bool:
    fsdp = torch.distributed.fsdp if torch.distributed.is_available() else None
    kinds = tuple(getattr(fsdp, k) for k in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, k))
    return bool(kinds) and isinstance(module, kinds)


def _check_dtypes_and_devices(experts: ExpertSet) -> None:
    for layer in experts.layers:
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
