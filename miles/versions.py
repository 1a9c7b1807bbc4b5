"""Weight versions: integers inside miles, strings on the wire.

miles numbers every weight version by the trainer's step (0 = the weights the run started from), and
compares them (staleness, the fleet's version). SGLang's protocol carries versions as strings, and a
server starts at "default". These two functions are the only place the two meet: senders turn the
trainer's number into its string, readers turn an engine's string back into a number.
Non-goal: interpreting labels someone else gave a server (`--weight-version v7`): weights this run
never pushed are the run's starting weights as far as miles can know, version 0.
"""

from __future__ import annotations

INITIAL = "default"
"""The version SGLang's servers (and the built-in engine) report before any update."""


def to_wire(version: int) -> str:
    """The string an engine is told for policy version `version`."""
    if type(version) is not int or version < 0:
        raise ValueError(f"weight version {version!r}: expected a non-negative integer")
    return str(version)


def is_miles_version(value) -> bool:
    """Whether an engine's `weight_version` is one miles sent (digits), not its own ("default", None)."""
    return isinstance(value, str) and value.isdigit()


def from_wire(value) -> int:
    """The policy version an engine's `weight_version` stands for: the number miles sent, or 0 for
    "default", a missing value or a label miles never sent."""
    if is_miles_version(value):
        return int(value)
    if type(value) is int and value >= 0:  # servers older than string versions
        return value
    return 0


def never_backwards(current: str, new: str) -> bool:
    """Whether an engine at `current` may commit `new`: once an engine holds a version miles numbered,
    only that number (a retried push of the same version) or a higher one follows it, so a stale or
    replayed commit can never roll an engine back."""
    if not is_miles_version(current):
        return True  # "default" or a label someone else gave: any version miles sends is newer
    return is_miles_version(new) and int(new) >= int(current)
