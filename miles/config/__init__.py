"""Run configuration: per-component dataclasses composed into one root, loaded from TOML,
overridden from the command line with dotted keys, validated with refusals that name the fix."""

from miles.config.loader import ConfigError, load_config, parse_overrides, to_dict

__all__ = ["ConfigError", "load_config", "parse_overrides", "to_dict"]
