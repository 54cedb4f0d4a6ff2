"""One training method on a fake model: its first step untracked, then tracked steps at any batch size.

For: `sonar_fx.planner`. The step that runs is the one that trains: `sonar_fx.methods.build_method(...)
.train_step`, eager (Sonar's post-accumulate-grad hooks update and free each expert gradient in
backward; the baselines clip and step at the end). The first step creates the optimizer states, as
in a real run, and is not tracked; each tracked step then starts where a real run's step 2 starts
(weights and optimizer states alive, no gradients) and is accounted by `StepTracker`.
Never: allocate real memory (everything runs under `PlanFakeMode`); run a step other than the method's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sonar_fx.config import OptimizerConfig
from sonar_fx.methods import Method, TrainingMethod, build_method
from sonar_fx.planner.fake import PlanError, PlanFakeMode, fake_parameters, real_step_paths
from sonar_fx.planner.models import ModelSource
from sonar_fx.planner.scratch import cpu_kernel_scratch
from sonar_fx.planner.tracker import StepTracker

PLAN_METHODS: dict[str, tuple[str, dict[str, object]]] = {
    "standard": ("standard", {}),
    "standard_no_expert_clip": ("standard_no_expert_clip", {}),
    "oib_all": ("oib_all", {}),
    "sonar": ("sonar", {}),
    "sonar_8bit": ("sonar", {"state_bits": 8}),
    "sonar_global_clip": ("sonar", {"expert_clip": "global"}),
}
"""Plan method name -> (`sonar_fx.methods` method, optimizer config fields it sets). sonar_8bit: 8-bit
expert moments; sonar_global_clip: exact global clipping of all gradients (two forward/backward
passes)."""


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """What one tracked step allocated, in bytes."""

    peak: int
    """Most bytes allocated at once during the step (absolute: weights and states included)."""
    start: int
    """Bytes allocated when the step started (weights, optimizer states, the batch)."""
    by_category: dict[str, int]
    """Bytes alive at the peak, by `tracker.CATEGORIES`."""


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
    ) -> None:
        self.mode = PlanFakeMode()
        self.name = method
        self.vocab = _vocab_size(source)
        model = source.build(dtype)
        if gradient_checkpointing:
            enable_checkpointing(model, source.name)
        self.model = fake_parameters(model, self.mode)
        base, fields = PLAN_METHODS[method]
        with self._planning():
            self.method: TrainingMethod = build_method(base, self.model, method_config(base, cfg, fields))
            self.method.train_step(self._batch(1, seq))  # creates the optimizer states

    def tracked_step(self, batch: int, seq: int, *, block_bytes: int, cpu: bool = False) -> StepMemory:
        """Run one training step of (batch, seq) tokens and account its memory; `cpu`: a CPU plan, which
        counts the scratch this host's CPU kernels take (see `scratch`)."""
        with self._planning():
            data = self._batch(batch, seq)
            tracker = StepTracker(block_bytes=block_bytes, scratch=cpu_kernel_scratch if cpu else None)
            tracker.track_step_start(self.model, self.method.optimizers, *data.values())
            start = tracker.bytes_now()
            with tracker:
                self.method.train_step(data)
        return StepMemory(peak=tracker.peak_bytes(), start=start, by_category=tracker.peak_by_category())

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        with self.mode, real_step_paths(), warnings.catch_warnings():
            # torch's tracker reads p.grad in its own post-accumulate-grad hook, after Sonar's hook has
            # freed it: it warns that it got None, which is exactly what Sonar promises.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            yield

    def _batch(self, batch: int, seq: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}


def enable_checkpointing(model: torch.nn.Module, name: str) -> None:
    """transformers' activation (gradient) checkpointing, with its default settings (non-reentrant)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        raise PlanError(f"{name}: gradient checkpointing needs a transformers model.")
    enable()


def method_config(base: str, cfg: OptimizerConfig, fields: dict[str, object]) -> OptimizerConfig:
    """`cfg` with a plan method's fields; a baseline that cannot clip expert gradients as `cfg` asks
    keeps its own clipping (standard clips every gradient, standard_no_expert_clip the dense ones)."""
    cfg = dataclasses.replace(cfg, **fields)  # type: ignore[arg-type]
    if cfg.expert_clip not in Method.named(base).expert_clips:
        cfg = dataclasses.replace(cfg, expert_clip=None)
    return cfg


def _vocab_size(source: ModelSource) -> int:
    config = source.reference if source.reference is not None else source.config
    return int(getattr(config, "vocab_size", 2))
