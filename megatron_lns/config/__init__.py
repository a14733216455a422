"""NeMo-style YAML configs: schema, loading with overrides, validation, translation."""

from megatron_lns.config.loader import ConfigError, load_config, to_dict, to_yaml
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.validate import validate

__all__ = ["ConfigError", "ExperimentConfig", "load_config", "to_dict", "to_yaml", "validate"]
