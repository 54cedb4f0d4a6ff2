"""sonar-fx: in-backward expert updates for memory-efficient MoE training, as a torch.compile pass."""

# Installs its log filters on import: before anything imports torchao (transformers does, building a model).
from sonar_fx import log_filters  # noqa: F401
from sonar_fx.api import compile, prepare
from sonar_fx.config import (
    AdamConfig,
    AdamWConfig,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    SGDConfig,
    WeightDecayGroup,
)
from sonar_fx.errors import (
    InterruptedStepError,
    NonFiniteGradientError,
    ProcessGroupRequired,
    SavingLostError,
    SonarUsageError,
)
from sonar_fx.experts.discovery import (
    ExpertLayer,
    ExpertSet,
    ExpertTensor,
    NoExpertsFoundError,
    discover_experts,
)
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.optim.torch_state import load_torch_state_dict, to_torch_state_dict
from sonar_fx.runtime.registry import UnboundExpertError

__all__ = [
    "AdamConfig",
    "AdamWConfig",
    "ExpertLayer",
    "ExpertSet",
    "ExpertTensor",
    "InterruptedStepError",
    "LionConfig",
    "MuonConfig",
    "NoExpertsFoundError",
    "NonFiniteGradientError",
    "OptimizerConfig",
    "ProcessGroupRequired",
    "SGDConfig",
    "SavingLostError",
    "SonarOptimizer",
    "SonarUsageError",
    "UnboundExpertError",
    "WeightDecayGroup",
    "compile",
    "discover_experts",
    "load_torch_state_dict",
    "prepare",
    "to_torch_state_dict",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `sonar_fx.plan` / `sonar_fx.Plan` load the planner (and transformers) only when first used.
    if name in ("plan", "Plan"):
        from sonar_fx import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'sonar_fx' has no attribute {name!r}")
