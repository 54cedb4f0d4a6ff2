"""Optimizer math and state: the fused AdamW update, `SonarOptimizer`, the in-graph update op."""

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.adamw import adamw_ref, fused_adamw_, grad_like_param
from sonar_fx.optim.optimizer import SonarOptimizer

__all__ = ["SonarOptimizer", "SonarUsageError", "adamw_ref", "fused_adamw_", "grad_like_param"]
