"""One training method on a fake model: its first step untracked, then tracked steps at any batch size.

For: `sonar_fx.planner`. The step that runs is the one that trains: `sonar_fx.methods.build_method(...)
.train_step`, eager (Sonar's post-accumulate-grad hooks update and free each expert gradient in
backward; the baselines clip and step at the end). The first step creates the optimizer states, as
in a real run, and is not tracked; each tracked step then starts where a real run's step 2 starts
(weights and optimizer states alive, no gradients) and is accounted by `StepTracker`. A step may run
several micro-batches (gradient accumulation) as `train_step` does with a list of batches; the deferred
schedule's step reports the operands it kept and the tensors that crossed over (`StepMemory`). On a
planned FSDP2 rank the method is built on that engine (`fully_shard`, and every micro-batch but the
last under its `no_sync`: `set_requires_gradient_sync(False)`), as a run on it builds it.
Never: allocate real memory (everything runs under `PlanFakeMode`); run a step other than the method's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sonar_fx.config import OptimizerConfig
from sonar_fx.engines import SINGLE_PROCESS, Engine
from sonar_fx.methods import Method, TrainingMethod, build_method
from sonar_fx.models.tiny import enable_activation_checkpointing
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.keep_budget import KeepRecord, KeptGradients
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.planner.device import cuda_block_bytes, exact_bytes
from sonar_fx.planner.fake import PlanError, PlanFakeMode, fake_parameters, lowbit_scratch, real_step_paths
from sonar_fx.planner.kernels import op_scratch, select_kernels
from sonar_fx.planner.models import ModelSource
from sonar_fx.planner.parallel import Layout
from sonar_fx.planner.scratch import cpu_kernel_scratch
from sonar_fx.planner.tracker import StepTracker

PLAN_METHODS: dict[str, tuple[str, dict[str, object]]] = {
    "standard": ("standard", {}),
    "standard_no_expert_clip": ("standard_no_expert_clip", {}),
    "oib_all": ("oib_all", {}),
    "sonar": ("sonar", {}),
    "sonar_8bit": ("sonar", {"state_bits": 8}),
    "sonar_global_clip": ("sonar", {"expert_clip": "global"}),
    "sonar_deferred": ("sonar_deferred", {}),
    "sonar_deferred_global_clip": ("sonar_deferred", {"expert_clip": "global"}),
}
"""Plan method name -> (`sonar_fx.methods` method, optimizer config fields it sets). sonar_8bit: 8-bit
expert moments; sonar_global_clip: exact global clipping of all gradients (two forward/backward
passes); sonar_deferred: expert gradients computed at step() from operands kept in backward (its
_global_clip twin clips all gradients by one norm, a norm pass and an update pass at step())."""


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """What one tracked step allocated, in bytes."""

    peak: int
    """Most bytes allocated at once during the step (absolute: weights and states included)."""
    start: int
    """Bytes allocated when the step started (weights, optimizer states, the batch)."""
    by_category: dict[str, int]
    """Bytes alive at the peak, by `tracker.CATEGORIES`."""
    kept_operand_bytes: int | None = None
    """The deferred schedule: the most operand bytes it kept at once (its `DeferredGrads` accounting:
    storage bytes, not rounded to allocator blocks); None for other methods."""
    crossed_over: tuple[str, ...] = ()
    """The deferred schedule: expert tensors whose kept operands outgrew their gradient in this step."""
    kept_whole: tuple[str, ...] = ()
    """The deferred schedule: expert tensors whose gradient arrived whole, not deferred (an expert kernel
    whose weight-gradient op the eager capture does not know)."""
    keep: KeepRecord | None = None
    """The deferred schedule's norm pass (clip over all): what its keep budget kept (None: no norm pass)."""


class MethodRun:
    """A fake model trained by one method, ready for tracked steps after its first one."""

    def __init__(
        self,
        source: ModelSource,
        method: str,
        cfg: OptimizerConfig,
        *,
        dtype: torch.dtype,
        gradient_checkpointing: bool,
        seq: int,
        grad_accum: int = 1,
        kernels: str = "torch",
        rank: Layout | None = None,
        engine: Engine = SINGLE_PROCESS,
    ) -> None:
        self.mode = PlanFakeMode()
        self.name = method
        self.grad_accum = grad_accum
        self.kernels = kernels
        self.vocab = _vocab_size(source)
        model = source.build(dtype)
        if gradient_checkpointing:
            enable_checkpointing(model, source.name)
        self.model = fake_parameters(model, self.mode)
        select_kernels(self.model, kernels, dtype)
        base, fields = PLAN_METHODS[method]
        config = method_config(base, cfg, fields)
        kwargs = accumulation_kwargs(method, base, config, grad_accum)
        if Method.named(base).sonar:  # a plan reports a lost saving (crossed_over, kept_whole): never refuses
            kwargs["on_saving_lost"] = "warn"
        with self._planning():
            self.method: TrainingMethod = build_method(base, self.model, config, engine=engine, **kwargs)
            if rank is not None:  # one rank of a parallel run: its engine's reduction
                rank.set_up(self.method.optimizer)
            self.method.train_step(self._micro_batches(1, seq))  # creates the optimizer states

    def tracked_step(self, batch: int, seq: int, *, device: str = "cuda", keep_budget: int = 0) -> StepMemory:
        """Run one training step of `grad_accum` micro-batches of (batch, seq) tokens and account its
        memory as `device`'s allocator and kernels would: "cuda" rounds each storage to the caching
        allocator's blocks (`device.cuda_block_bytes`); "cpu" counts exact bytes, the scratch this host's
        CPU matmul kernels take (see `scratch`) and that of torchao's compiled CPU update (see `fake`).
        `keep_budget`: the deferred schedule's keep budget for this step (bytes)."""
        deferred, kept = self._deferred(), self._kept_gradients()
        if deferred is not None:
            deferred.crossed.clear()  # what crossed over in this step (the planner's copy of the report)
        if kept is not None:
            kept.budget, kept.last = keep_budget, None
        cpu = device == "cpu"
        round_bytes = exact_bytes if cpu else cuda_block_bytes
        backend = op_scratch(self.kernels, round_bytes)

        def scratch(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
            return backend(func, args, kwargs) + (cpu_kernel_scratch(func, args, kwargs) if cpu else 0)

        with self._planning(), lowbit_scratch(counted=cpu):
            micro = self._micro_batches(batch, seq)
            tracker = StepTracker(round_bytes=None if cpu else round_bytes, scratch=scratch)
            tracker.track_step_start(
                self.model, self.method.optimizers, *(t for b in micro for t in b.values())
            )
            start = tracker.bytes_now()
            with tracker:
                self.method.train_step(micro[0] if len(micro) == 1 else micro)
        return StepMemory(
            peak=tracker.peak_bytes(), start=start, by_category=tracker.peak_by_category(),
            kept_operand_bytes=None if deferred is None else deferred.last_peak_bytes,
            crossed_over=() if deferred is None else tuple(sorted(deferred.crossed)),
            kept_whole=() if deferred is None else tuple(sorted(deferred.whole)),
            keep=None if kept is None else kept.last,
        )  # fmt: skip

    def expert_order(self) -> list[tuple[str, int]]:
        """(name, gradient bytes) of each expert tensor, in the order the deferred step updates them."""
        opt = self.method.optimizer
        assert isinstance(opt, SonarOptimizer)
        return [(opt.expert_name(p), p.numel() * p.element_size()) for p in opt.experts.params]

    def _kept_gradients(self) -> KeptGradients | None:
        """The deferred schedule's keep budget (None for other methods)."""
        opt = self.method.optimizer
        return opt.kept_grads if self._deferred() is not None and isinstance(opt, SonarOptimizer) else None

    def _deferred(self) -> DeferredGrads | None:
        """The deferred schedule's kept-operand accounting (None for other methods)."""
        if self.method.kind.schedule != "deferred" or not isinstance(self.method.optimizer, SonarOptimizer):
            return None
        return self.method.optimizer.deferred

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        with self.mode, real_step_paths(), warnings.catch_warnings():
            # torch's tracker reads p.grad in its own post-accumulate-grad hook, after Sonar's hook has
            # freed it: it warns that it got None, which is exactly what Sonar promises.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            # The saving guard's word on the planned step: the plan's own fields say it (crossed_over).
            warnings.filterwarnings("ignore", message=r"sonar: (schedule='deferred' ke|the experts impl)")
            yield

    def _micro_batches(self, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for _ in range(self.grad_accum):
            ids = torch.randint(0, self.vocab, (batch, seq))
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out


def enable_checkpointing(model: torch.nn.Module, name: str) -> None:
    """transformers' activation (gradient) checkpointing, with its default settings (non-reentrant)."""
    if not enable_activation_checkpointing(model):
        raise PlanError(f"{name}: gradient checkpointing needs a transformers model.")


def method_config(base: str, cfg: OptimizerConfig, fields: dict[str, object]) -> OptimizerConfig:
    """`cfg` with a plan method's fields; a baseline that cannot clip expert gradients as `cfg` asks
    keeps its own clipping (standard clips every gradient, standard_no_expert_clip the dense ones)."""
    cfg = dataclasses.replace(cfg, **fields)  # type: ignore[arg-type]
    if cfg.expert_clip not in Method.named(base).expert_clips:
        cfg = dataclasses.replace(cfg, expert_clip=None)
    return cfg


def accumulation_kwargs(method: str, base: str, cfg: OptimizerConfig, grad_accum: int) -> dict[str, Any]:
    """What `build_method` needs to run `grad_accum` micro-batches per step: nothing for the baselines
    and the deferred schedule (both accumulate exactly); Sonar's in-backward schedule updates once per
    micro-batch (`accumulation="per_microbatch"`, a different optimizer, planned as such), which its
    two-pass global clip cannot do."""
    if grad_accum == 1 or base != "sonar":
        return {}
    if cfg.expert_clip == "global":
        raise PlanError(
            f"{method} with grad_accum={grad_accum}: the two-pass global clip runs one micro-batch per step. "
            "Plan sonar_deferred_global_clip (exact all-parameter clip with accumulation) instead."
        )
    return {"accumulation": "per_microbatch"}


def _vocab_size(source: ModelSource) -> int:
    config = source.reference if source.reference is not None else source.config
    return int(getattr(config, "vocab_size", 2))
