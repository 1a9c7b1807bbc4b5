"""Config machinery, the ground floor every component may import: the loader (TOML tables and
`--section.key value` overrides into typed, nested dataclasses, validated with refusals that name
the fix; ConfigError) and flags.py (the standalone servers' flags, read through the same loader).

It imports no component. The run's config tree itself, which composes every component's section, is
the composition root beside the CLI: miles/run_config.py, with its cross-section checks in
miles/run_checks.py."""

from miles.config.loader import ConfigError, load_config, parse_overrides, to_dict

__all__ = ["ConfigError", "load_config", "parse_overrides", "to_dict"]
