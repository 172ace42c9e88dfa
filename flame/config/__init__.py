"""The job configuration: TOML file + command-line overrides -> a validated `JobConfig`."""

from flame.config.job import (
    Checkpoint,
    Data,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallel,
    Training,
)
from flame.config.loader import ConfigError, config_from_dict, load_config, to_dict, to_toml

__all__ = [
    "Checkpoint",
    "ConfigError",
    "Data",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallel",
    "Training",
    "config_from_dict",
    "load_config",
    "to_dict",
    "to_toml",
]
