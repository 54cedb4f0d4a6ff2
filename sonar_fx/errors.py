"""The errors Sonar raises when training would otherwise go on silently different from what was asked.

One home for the library's usage errors, so every layer raises the same types and `sonar_fx` exports
them. Errors that belong to a self-contained layer stay there: the runtime's `UnboundExpertError`
(the runtime imports nothing of the project), discovery's `NoExpertsFoundError`, the data layer's
`DataError`, and the command line's `ConfigError` / `CheckpointError` (they name a flag or a file).
This module imports nothing; it never decides when to raise.
"""

from __future__ import annotations


class SonarUsageError(RuntimeError):
    """Sonar was driven in a way that would train silently differently from what the user asked."""


class InterruptedStepError(SonarUsageError):
    """A backward raised after Sonar had already updated some expert tensors in it.

    In-backward updates cannot be taken back, so the step is partial. `updated` names the expert
    tensors the interrupted backward updated; `SonarOptimizer.abandon_step()` drops the partial step.
    """

    def __init__(self, message: str, updated: list[str]) -> None:
        super().__init__(message)
        self.updated = updated


class NonFiniteGradientError(SonarUsageError, FloatingPointError):
    """A gradient holds inf or NaN and the policy is nonfinite="raise"; `tensors` names them."""

    def __init__(self, message: str, tensors: list[str]) -> None:
        super().__init__(message)
        self.tensors = tensors


class ProcessGroupRequired(SonarUsageError):
    """A distributed engine was set up without an initialised torch.distributed process group
    (see `sonar_fx.optim.reduction.require_process_group`, the one place that checks)."""


class SavingLostError(SonarUsageError):
    """A compiled backward graph returns expert gradients un-rewritten (no memory saved for them) and
    the policy is on_saving_lost="raise"; `tensors` names them."""

    def __init__(self, message: str, tensors: list[str]) -> None:
        super().__init__(message)
        self.tensors = tensors


class UnsupportedOptionError(SonarUsageError, TypeError):
    """An optimizer config was given an option Sonar does not compute (a torch optimizer's `maximize=`,
    `amsgrad=`, ...); `option` names it. A TypeError too, as the unknown keyword it replaces."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option
