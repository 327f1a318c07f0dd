"""The network's math (plain torch modules) and its checkpoint loader."""
from .config import ConfigError, ModelConfig
from .loader import CheckpointError, load_model
from .model import Transformer

__all__ = ["ConfigError", "ModelConfig", "CheckpointError", "load_model", "Transformer"]
