"""Service configuration: one dataclass per service, filled from flags, environment and a YAML file
(:mod:`.loader`)."""

from common.config.loader import ResolvedConfig, Source, add_config_args, load_config, resolve_config

__all__ = ["ResolvedConfig", "Source", "add_config_args", "load_config", "resolve_config"]
