"""Built-in tiny MoE models (transformers classes from tiny configs) and the reference model."""

from sonar_fx.models.reference import ReferenceMoEConfig, ReferenceMoEModel
from sonar_fx.models.tiny import TINY_MODELS, build_model

__all__ = ["TINY_MODELS", "ReferenceMoEConfig", "ReferenceMoEModel", "build_model"]
