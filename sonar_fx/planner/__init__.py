"""Memory planning without the hardware: `sonar_fx.plan` and `sonar-fx plan` (see `planning`)."""

from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.models import PRESETS
from sonar_fx.planner.planning import DEFAULT_METHODS, BudgetError, MethodPlan, Plan, plan
from sonar_fx.planner.run import PLAN_METHODS

__all__ = [
    "DEFAULT_METHODS",
    "PLAN_METHODS",
    "PRESETS",
    "BudgetError",
    "MethodPlan",
    "Plan",
    "PlanError",
    "plan",
]
