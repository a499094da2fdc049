"""The job config: dataclass sections, TOML + command-line loading, validation. Imports no torch."""

from titan_kimi.config.errors import ConfigError
from titan_kimi.config.loader import load_job_config, read_toml
from titan_kimi.config.render import format_help, to_dict, to_toml
from titan_kimi.config.sections import JobConfig
from titan_kimi.config.validation import known_flavors, validate_job_config

__all__ = ["ConfigError", "JobConfig", "format_help", "known_flavors", "load_job_config", "read_toml",
           "to_dict", "to_toml", "validate_job_config"]
