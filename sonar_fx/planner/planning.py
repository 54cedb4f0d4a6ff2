"""`sonar_fx.plan`: a training step's peak memory per method, predicted on fake tensors.

For: deciding, before renting a GPU, whether a model fits at a batch size with Sonar and without it,
and the largest batch that fits a memory budget. Each method's real training step runs on a fake model
of the real size (`run.MethodRun`) and torch's memory tracker accounts every allocation and free
(`tracker.StepTracker`). What is planned is eager execution with transformers' default kernels (torch's
grouped GEMM experts, SDPA attention): see docs/plan.md for what that means against other kernels.
Never: allocate a model's memory; guess a number the step did not produce.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from sonar_fx.config import AdamWConfig, OptimizerConfig
from sonar_fx.engines import ENGINES, SINGLE_PROCESS
from sonar_fx.experts.discovery import NoExpertsFoundError, discover_experts
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.methods import Method
from sonar_fx.planner.device import GPU, GPUS, RESERVE_FRACTION
from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.keep import KeepChoice, choose_keep_budget
from sonar_fx.planner.kernels import KERNELS
from sonar_fx.planner.models import ModelSource, model_source
from sonar_fx.planner.modes import Crossover, Semantics, crossover, norm_pass_flops, semantics, top_k_of
from sonar_fx.planner.parallel import layout
from sonar_fx.planner.run import PLAN_METHODS, MethodRun, StepMemory, method_config

DEFAULT_METHODS = ("standard", "standard_no_expert_clip", "oib_all", "sonar")
"""Methods planned when none are named (`default_methods`: less those a planned engine does not run)."""
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
DEVICES = ("cuda", "cpu")
"""Planned devices: "cuda" (the caching allocator's blocks, GPU kernels), "cpu" (exact bytes, the CPU
kernels' scratch); see `run.MethodRun.tracked_step`."""
MAX_BATCH = 1 << 16
"""The budget search's ceiling."""
EXECUTION = (
    "eager (Sonar: post-accumulate-grad hooks; sonar_deferred: its grouped-GEMM operand capture), SDPA "
    "attention, experts: "
)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class MethodPlan:
    """One method's planned step."""

    method: str
    peak_allocated_bytes: int
    """Most bytes allocated at once in the step (as `torch.cuda.max_memory_allocated` counts them)."""
    categories: dict[str, int]
    """Bytes alive at the peak: weights, gradients, optimizer_states, activations, temporaries."""
    step_start_bytes: int
    """Bytes allocated when the step starts: weights, optimizer states and the batch."""
    saving_bytes: int | None = None
    """standard's peak minus this one's (None when standard was not planned)."""
    max_batch: int | None = None
    """With a budget: the largest batch whose step fits it (0: none fits)."""
    batch_peaks: dict[int, int] = field(default_factory=dict)
    """Every batch size a step was planned at -> its peak (the budget search's steps included)."""
    semantics: Semantics | None = None
    """What the method trains: clip scope, accumulation, when experts are updated ("which mode when")."""
    kept_operand_bytes: int | None = None
    """The deferred schedule: the most weight-gradient operand bytes it kept at once in the step."""
    crossed_over: tuple[str, ...] = ()
    """The deferred schedule: expert tensors whose kept operands outgrew their gradient in the step."""
    kept_whole: tuple[str, ...] = ()
    """The deferred schedule: expert tensors whose gradient arrived whole, not deferred, in the step."""
    fits: bool | None = None
    """With a budget (or a GPU): whether the asked batch's step fits it."""
    extra_gemm_flops: int | None = None
    """The deferred schedule with the all-parameter clip: FLOPs of its extra weight-gradient GEMMs per
    step (`modes.norm_pass_flops`); None for other methods."""
    recomputed_share: float | None = None
    """The deferred schedule with the all-parameter clip: share of the gradient bytes its norm pass
    computed that the update pass computes again (1.0 at keep budget 0; None for other methods)."""
    held_grad_bytes: int | None = None
    """The same: gradients held whole past their crossover (never computed twice; counted against a
    keep budget)."""
    keep: KeepChoice | None = None
    """The same, with a memory budget: the largest keep budget whose step fits it (`keep`)."""

    @property
    def transient_bytes(self) -> int:
        """The peak above the step's start: what a profiler measuring from the step's start sees."""
        return self.peak_allocated_bytes - self.step_start_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What `sonar_fx.plan` predicts for each method, and what it was asked."""

    model: str
    batch: int
    seq: int
    dtype: str
    device: str
    gradient_checkpointing: bool
    grad_accum: int
    """Micro-batches of `batch` sequences per optimizer step (gradients accumulated)."""
    optimizer: dict[str, Any]
    """The optimizer config's fields (state bits, clipping)."""
    expert_grad: ExpertGradBytes
    """Expert-gradient bytes: all layers' and the largest layer's (Sonar should save the difference)."""
    methods: list[MethodPlan]
    crossover: Crossover | None = None
    """Where the deferred schedule's kept operands outgrow the expert gradients (None: the router's
    top-k or the expert tensors' layout is unknown)."""
    budget_bytes: int | None = None
    kernels: str = "torch"
    """Expert kernels modelled (`kernels.KERNELS`)."""
    gpu: GPU | None = None
    """The card planned for (`--gpu`): its usable memory is the budget."""
    seconds: float = 0.0
    """Wall time the plan took."""
    cpu_seconds: float = 0.0
    """CPU time this process spent on it (on a shared machine, the part of `seconds` that was its own)."""
    execution: str = EXECUTION
    parallel: str | None = None
    """The engine of a planned rank ("ddp", "ep", "fsdp2"; None: one process): every figure is one rank's."""
    world: int = 1
    """Ranks of that run, each with `batch` sequences per micro-batch."""

    def extra_gemm_ms(self, m: MethodPlan) -> float | None:
        """`m`'s extra weight-gradient GEMMs at the GPU's dense bf16 datasheet rate (a floor), in ms."""
        if self.gpu is None or m.extra_gemm_flops is None:
            return None
        return self.gpu.gemm_ms(m.extra_gemm_flops)

    def method(self, name: str) -> MethodPlan:
        for m in self.methods:
            if m.method == name:
                return m
        raise KeyError(f"{name!r} was not planned: {', '.join(m.method for m in self.methods)}")

    def to_json(self) -> dict[str, Any]:
        """One JSON-ready object; per method its name, peak and categories side by side."""
        skip = ("methods", "expert_grad", "crossover", "gpu")
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        out["expert_grad_bytes"] = self.expert_grad.total
        out["expert_grad_one_layer_bytes"] = self.expert_grad.one_layer
        out["predicted_saving_bytes"] = self.expert_grad.predicted_saving
        out["crossover"] = self.crossover.to_json() if self.crossover is not None else None
        out["gpu"] = self.gpu.to_json() if self.gpu is not None else None
        out["methods"] = [
            {"method": m.method, "peak_allocated_bytes": m.peak_allocated_bytes, **m.categories,
             "step_start_bytes": m.step_start_bytes, "saving_bytes": m.saving_bytes, "max_batch": m.max_batch,
             "batch_peaks": {str(b): p for b, p in sorted(m.batch_peaks.items())},
             **(dataclasses.asdict(m.semantics) if m.semantics is not None else {}),
             "kept_operand_bytes": m.kept_operand_bytes, "crossed_over": list(m.crossed_over),
             "kept_whole": list(m.kept_whole), "fits": m.fits,
             "extra_gemm_flops": m.extra_gemm_flops, "extra_gemm_ms": self.extra_gemm_ms(m),
             "recomputed_share": m.recomputed_share, "held_grad_bytes": m.held_grad_bytes,
             "keep": m.keep.to_json() if m.keep is not None else None}
            for m in self.methods
        ]  # fmt: skip
        return out


def plan(
    model_or_config: Any,
    *,
    batch: int = 2,
    seq: int = 256,
    dtype: str | torch.dtype = "bf16",
    opt_cfg: OptimizerConfig | None = None,
    methods: Sequence[str] | None = None,
    device: str = "cuda",
    gradient_checkpointing: bool = False,
    budget: int | str | None = None,
    grad_accum: int = 1,
    kernels: str = "torch",
    gpu: str | None = None,
    parallel: str | None = None,
    world: int = 1,
) -> Plan:
    """Predict the peak allocated memory of one training step (step 2: optimizer states alive) of
    `model_or_config` for each method, without allocating it; with `budget` (bytes, or text like
    "46GiB"), also the largest batch that fits. `grad_accum`: micro-batches of `batch` sequences per
    step. `kernels`: the expert kernels modelled ("torch", "scattermoe", "sonicmoe"); `gpu`: a card of
    `device.GPUS`, whose usable memory becomes the budget. `parallel` ("ddp", "ep", "fsdp2") and
    `world`: plan one rank of that many processes (`parallel.Layout`), each with its own `batch`.
    `methods`: None plans `default_methods(parallel)`. See the module docstring and docs/plan.md."""
    started, cpu_started = time.perf_counter(), time.process_time()
    methods = default_methods(parallel) if methods is None else methods
    torch_dtype, cfg = parse_dtype(dtype), opt_cfg if opt_cfg is not None else AdamWConfig()
    _check_request(batch, seq, device, methods, cfg, grad_accum)
    card = _gpu(gpu, device, budget, kernels)
    budget_bytes = (
        card.usable_bytes if card is not None else free_cuda_bytes() if budget == "auto"
        else parse_bytes(budget) if budget is not None else None
    )  # fmt: skip
    rank = layout(parallel, world, methods)
    _check_engine_runs(parallel, methods)
    source = model_source(model_or_config)
    source = rank.source(source) if rank is not None else source
    planned, expert_grad, cross = [], None, None
    layers, top_k = [], None
    with rank.running() if rank is not None else nullcontext(SINGLE_PROCESS) as engine:
        for name in methods:
            try:
                run = MethodRun(
                    source, name, cfg, dtype=torch_dtype, gradient_checkpointing=gradient_checkpointing,
                    seq=seq, grad_accum=grad_accum, kernels=kernels, rank=rank, engine=engine,
                )  # fmt: skip
            except NoExpertsFoundError as err:
                raise PlanError(f"{source.name}: {err}") from err
            if expert_grad is None:
                layers = discover_experts(run.model)
                top_k = _top_k(source)
                expert_grad = ExpertGradBytes.of(layers)
                cross = None if top_k is None else crossover(layers, top_k, seq=seq, grad_accum=grad_accum)
            base, fields = PLAN_METHODS[name]
            method_cfg = method_config(base, cfg, fields)
            meaning = semantics(name, base, method_cfg)
            buckets = rank.bucket_bytes(run.model, sonar=Method.named(base).sonar) if rank is not None else 0
            mine = _plan_method(run, batch, seq, device, budget_bytes, meaning, buckets)
            if base == "sonar_deferred" and method_cfg.expert_clip == "global":
                keep_budget = None if budget_bytes is None else budget_bytes - buckets  # (a rank's DDP)
                mine = _with_norm_pass(mine, run, layers, top_k, (batch, seq, device, keep_budget))
            planned.append(mine)
    assert expert_grad is not None  # `_check_request` refused an empty method list
    standard = next((m for m in planned if m.method == "standard"), None)
    if standard is not None:
        planned = [dataclasses.replace(m, saving_bytes=standard.peak_allocated_bytes - m.peak_allocated_bytes)
                   for m in planned]  # fmt: skip
    if budget_bytes is not None and all(m.max_batch == 0 for m in planned):
        asked = str(budget) if card is None else f"(the usable memory of a {card.product})"
        raise BudgetError(_no_fit(planned, budget_bytes, seq, asked))
    return Plan(
        model=source.name, batch=batch, seq=seq, dtype=str(torch_dtype).removeprefix("torch."), device=device,
        gradient_checkpointing=gradient_checkpointing, grad_accum=grad_accum, optimizer=_cfg_fields(cfg),
        expert_grad=expert_grad, methods=planned, crossover=cross, budget_bytes=budget_bytes, kernels=kernels,
        gpu=card, execution=EXECUTION + KERNELS[kernels], seconds=time.perf_counter() - started,
        parallel=parallel, world=world,
        cpu_seconds=time.process_time() - cpu_started,
    )  # fmt: skip


def default_methods(parallel: str | None) -> tuple[str, ...]:
    """`DEFAULT_METHODS` that the engine of `--parallel` runs (the distributed engines run no `oib_all`;
    naming a method the engine does not run is refused: `_check_engine_runs`)."""
    if parallel is None:
        return DEFAULT_METHODS
    return tuple(m for m in DEFAULT_METHODS if _engine_runs(parallel, m))


def _engine_runs(parallel: str, method: str) -> bool:
    runs = ENGINES[parallel].methods
    return runs is None or PLAN_METHODS[method][0] in runs


def _check_engine_runs(parallel: str | None, methods: Sequence[str]) -> None:
    """Refuse planning a rank of an engine with a method that engine does not run (before any model is
    built: DDP and expert parallelism plan one process's step, which would run it)."""
    refused = [m for m in methods if parallel in ENGINES and not _engine_runs(parallel, m)]
    if refused:
        raise PlanError(
            f"methods {refused!r} are not available on the {parallel} engine (`sonar-fx finetune "
            f"--parallel {parallel}` refuses them too): plan {', '.join(default_methods(parallel))}."
        )


class BudgetError(PlanError):
    """No method fits the budget at any batch size."""


def _gpu(name: str | None, device: str, budget: int | str | None, kernels: str) -> GPU | None:
    if kernels not in KERNELS:
        raise PlanError(f"kernels {kernels!r}: choose from {', '.join(KERNELS)}.")
    if name is None:
        return None
    if name not in GPUS:
        raise PlanError(f"gpu {name!r}: choose from {', '.join(GPUS)}.")
    if device != "cuda" or budget is not None:
        raise PlanError(
            f"gpu {name!r} plans for that card's memory: drop --device {device} and --budget (the budget is "
            "its usable memory)."
            if budget is not None
            else f"gpu {name!r} plans a CUDA step: drop --device cpu."
        )
    return GPUS[name]


def _with_norm_pass(
    mine: MethodPlan,
    run: MethodRun,
    layers: list[Any],
    top_k: int | None,
    asked: tuple[int, int, str, int | None],
) -> MethodPlan:
    """The deferred all-parameter clip's second computation of each expert gradient: its share and
    FLOPs at keep budget 0, and with a memory budget the largest keep budget that fits (`keep`)."""
    batch, seq, device, budget = asked
    tokens = batch * seq * run.grad_accum

    def flops(kept: tuple[str, ...]) -> int | None:
        # gradients kept whole (crossed over, arrived whole) or kept by the budget are computed once
        return (
            norm_pass_flops(layers, top_k, tokens, mine.crossed_over + mine.kept_whole + kept)
            if top_k
            else None
        )

    mine = dataclasses.replace(mine, extra_gemm_flops=flops(()))
    if budget is None:
        return mine
    order = run.expert_order()
    chosen, step, probes = choose_keep_budget(
        lambda keep: run.tracked_step(batch, seq, device=device, keep_budget=keep), order, budget
    )
    kept = step.keep
    assert kept is not None, "the deferred norm pass ran no keep budget"
    choice = KeepChoice(
        budget_bytes=chosen, peak_allocated_bytes=step.peak, fits=step.peak <= budget, kept=kept.kept,
        tensors=len(order), kept_bytes=kept.kept_bytes, held_bytes=kept.held_bytes,
        recomputed_share=kept.recomputed_share, extra_gemm_flops=flops(kept.kept), probes=probes,
    )  # fmt: skip
    return dataclasses.replace(mine, keep=choice)


def _top_k(source: ModelSource) -> int | None:
    return source.reference.top_k if source.reference is not None else top_k_of(source.config)


def _plan_method(
    run: MethodRun,
    batch: int,
    seq: int,
    device: str,
    budget: int | None,
    meaning: Semantics,
    buckets: int = 0,
) -> MethodPlan:
    """`run`'s step at `batch` (and the largest batch that fits `budget`); `buckets`: DDP's bucket bytes,
    alive for the whole run beside what the step allocates (0 in one process)."""
    peaks: dict[int, StepMemory] = {}

    def step(b: int) -> int:
        if b not in peaks:
            peaks[b] = run.tracked_step(b, seq, device=device)
        return peaks[b].peak + buckets

    step(batch)
    max_batch = (
        largest_batch(step, budget, start=batch, base=peaks[batch].start + buckets)
        if budget is not None
        else None
    )
    asked = peaks[batch]
    categories = {**asked.by_category, "gradients": asked.by_category.get("gradients", 0) + buckets}
    return MethodPlan(
        method=run.name, peak_allocated_bytes=asked.peak + buckets, categories=categories,
        step_start_bytes=asked.start + buckets, max_batch=max_batch,
        batch_peaks={b: m.peak + buckets for b, m in peaks.items()},
        semantics=meaning, kept_operand_bytes=asked.kept_operand_bytes, crossed_over=asked.crossed_over,
        kept_whole=asked.kept_whole, fits=None if budget is None else asked.peak + buckets <= budget,
        recomputed_share=None if asked.keep is None else asked.keep.recomputed_share,
        held_grad_bytes=None if asked.keep is None else asked.keep.held_bytes,
    )  # fmt: skip


def largest_batch(peak_of: Callable[[int], int], budget: int, *, start: int, base: int) -> int:
    """The largest batch b with `peak_of(b) <= budget` (0 if even 1 does not fit), `peak_of` being
    non-decreasing in b. Each probe is a planned step, so guesses come from the peaks seen so far
    (a secant: a step's peak grows about linearly with the batch) and every answer is bracketed by
    two probes: b fits, b + 1 does not. `base` is the bytes at the step's start (batch-independent)."""
    fits, too_big = 0, None
    seen = {0: base}
    b = start
    while True:
        seen[b] = peak_of(b)
        if seen[b] <= budget:
            fits = max(fits, b)
        else:
            too_big = b if too_big is None else min(too_big, b)
        if too_big is not None and too_big - fits <= 1:
            return fits
        if too_big is None and fits >= MAX_BATCH:
            return fits
        b = _next_guess(seen, budget, fits, too_big)


def _next_guess(seen: dict[int, int], budget: int, fits: int, too_big: int | None) -> int:
    lo, hi = fits, too_big if too_big is not None else MAX_BATCH + 1
    below = max(b for b in seen if b <= lo)
    above = min((b for b in seen if b > lo), default=None)
    a, c = (below, above) if above is not None else (max((b for b in seen if b < below), default=0), below)
    slope = (seen[c] - seen[a]) / (c - a) if c != a and seen[c] > seen[a] else None
    guess = lo + 1 if slope is None else int(lo + (budget - seen[lo]) / slope)
    if too_big is None:
        guess = min(guess, max(2 * lo, lo + 1) * 4)  # an extrapolation far out is checked in steps
    guess = min(max(guess, lo + 1), hi - 1)
    if guess in seen:  # the secant repeats itself: halve the bracket instead
        guess = (lo + hi) // 2
    return guess


def _no_fit(planned: list[MethodPlan], budget: int, seq: int, asked: str) -> str:
    best = min(planned, key=lambda m: m.batch_peaks.get(1, m.peak_allocated_bytes))
    need = best.batch_peaks.get(1, best.peak_allocated_bytes)
    return (
        f"--budget {asked} ({_size(budget)}) fits no batch for any method at seq {seq}: the closest is "
        f"{best.method}, which needs {_size(need)} at batch 1 ({_size(best.categories['weights'])} of "
        f"weights, {_size(best.categories['optimizer_states'])} of optimizer states). Raise the budget, "
        "shorten --seq, or store states in 8 bits (--state-bits 8 --dense-state-bits 8)."
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise PlanError(
        f"unsupported dtype {dtype!r}: plan bf16 or fp32 (Sonar trains weights, gradients and states in one "
        "of them; fp16 would need a GradScaler, which an update applied in backward cannot honour)."
    )


def free_cuda_bytes() -> int:
    """--budget auto: what this machine's CUDA device has free now (`torch.cuda.mem_get_info`) less the
    caching allocator's reserve (`device.RESERVE_FRACTION` of the card): what a run started now could
    reach."""
    if not torch.cuda.is_available():
        raise PlanError(
            "budget 'auto' reads this machine's free CUDA memory (torch.cuda.mem_get_info), and it has no "
            "CUDA device: give a size (--budget 46GiB, 48GB or bytes) or plan for a card (--gpu NAME)."
        )
    free, total = torch.cuda.mem_get_info()
    return int(free - RESERVE_FRACTION * total)


def parse_bytes(text: int | str) -> int:
    """Bytes from an int or text like "46GiB", "48GB", "5e10" (GB = 1e9 bytes, GiB = 2**30)."""
    if isinstance(text, int) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", str(text).lower())
    if match is None or float(match.group(1)) <= 0:
        raise PlanError(f"budget {text!r}: expected a size such as 46GiB, 48GB or 5e10 (bytes).")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _check_request(
    batch: int, seq: int, device: str, methods: Sequence[str], cfg: OptimizerConfig, grad_accum: int
) -> None:
    if batch < 1 or seq < 1 or grad_accum < 1:
        raise PlanError(f"batch={batch}, seq={seq}, grad_accum={grad_accum}: each must be at least 1.")
    if device not in DEVICES:
        raise PlanError(f"device {device!r}: plan for 'cuda' (the caching allocator's blocks) or 'cpu'.")
    unknown = [m for m in methods if m not in PLAN_METHODS]
    if unknown or not methods:
        raise PlanError(f"methods {list(methods)!r}: choose from {', '.join(PLAN_METHODS)}.")
    for name in ("state_bits", "dense_state_bits"):
        if getattr(cfg, name, 32) == 4:
            raise PlanError(
                f"{name}=4: the plan models 8-bit states (the memory torchao's compiled 4-bit update "
                "allocates is not modelled); plan 8 or 32."
            )


def _cfg_fields(cfg: OptimizerConfig) -> dict[str, Any]:
    return {"optimizer": cfg.name, **dataclasses.asdict(cfg)}
