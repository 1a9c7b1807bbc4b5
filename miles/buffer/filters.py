"""Group filters: decide on arrival whether a finished group is worth training on.

A filter is any callable `(Group) -> bool` (True = keep), chosen by name from FILTERS or given as
`module:function`. Rejected groups are discarded with reason `filtered`, never retried: a filter
judges the group's content, and generating the same prompt again would mostly repeat it.
"""

from __future__ import annotations

from typing import Callable, Protocol

from miles.buffer.types import Group


class GroupFilter(Protocol):
    def __call__(self, group: Group) -> bool: ...


def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards differ: with all rewards equal every advantage is zero."""
    return len(set(group.rewards)) > 1


def keep_all(group: Group) -> bool:
    return True


FILTERS: dict[str, Callable[[Group], bool]] = {"nonzero_std": nonzero_std, "none": keep_all}


def get_filter(spec: str) -> GroupFilter:
    """A filter by registry name or `module:function`; a bad spec raises ValueError naming the fix."""
    from miles.registry import resolve

    fn = resolve(spec, FILTERS, "group filter")
    if not callable(fn):
        raise ValueError(f"group filter {spec!r} is not callable; it must be a function (Group) -> bool")
    return fn
