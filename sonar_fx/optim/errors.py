"""The errors Sonar raises when training would otherwise go on silently different from what was asked."""

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
