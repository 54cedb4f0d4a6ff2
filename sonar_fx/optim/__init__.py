"""Optimizer math and state: the fused AdamW update, `SonarOptimizer`, the in-graph update op."""

from sonar_fx.optim.adamw import adamw_ref, fused_adamw_, grad_like_param
from sonar_fx.optim.optimizer import SonarOptimizer, SonarUsageError

__all__ = ["SonarOptimizer", "SonarUsageError", "adamw_ref", "fused_adamw_", "grad_like_param"]
