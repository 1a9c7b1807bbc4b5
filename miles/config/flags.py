"""The flags of the standalone servers (`miles serve`, `miles router`) read as dotted-key overrides, so
they load through the same loader as `miles train`: every config key is a flag (`--router.port 0`,
`--port=0`), and the documented short flags (`--port P`, `--admin-token T`) are aliases of keys.

Non-goals: subcommand dispatch (miles/cli.py) and TOML files (a server's settings fit on one line).
"""

from __future__ import annotations

import sys

from miles.config.loader import ConfigError, load_config, parse_overrides


def flag_overrides(argv: list[str], *, aliases: dict[str, str] | None = None,
                   switches: dict[str, tuple[str, str]] | None = None, lists: tuple[str, ...] = ()) -> dict[str, str]:
    """Dotted overrides from server flags.

    aliases: flag (dashes read as underscores) -> dotted key; switches: a flag that takes no value ->
    (dotted key, value); lists: flags whose value is every token up to the next flag, as
    `--worker-urls A B` (joined with commas, the loader's list form).
    """
    aliases, switches = aliases or {}, switches or {}
    tokens: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok[2:].split("=", 1)[0].replace("-", "_") if tok.startswith("--") else None
        if name in switches and "=" not in tok:
            key, value = switches[name]
            tokens += [f"--{key}", value]
            i += 1
        elif name in lists and "=" not in tok:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            tokens += [f"--{name}", ",".join(argv[i + 1:j])]
            i = j
        else:
            tokens.append(tok)
            i += 1
    return {aliases.get(key, key): value for key, value in parse_overrides(tokens).items()}


def load_server_config(cls, argv: list[str], *, prog: str, usage: str, defaults: dict[str, str] | None = None,
                       **flag_kinds):
    """Build and validate `cls` from a server's flags (see `flag_overrides`); `--help` prints `usage`.

    defaults: overrides applied before the flags (a server's own defaults that differ from the
    dataclass's). A refused config exits with the loader's message, which names the key and the fix.
    """
    if "-h" in argv or "--help" in argv:
        print(usage)
        raise SystemExit(0)
    try:
        overrides = {**(defaults or {}), **flag_overrides(argv, **flag_kinds)}
        return load_config(cls, None, overrides)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
