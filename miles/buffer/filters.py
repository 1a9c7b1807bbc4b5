"""Group filters: decide on arrival whether a finished group is worth training on.

A filter is any callable `(Group) -> bool` (True = keep), chosen by name from FILTERS or given as
`module:function`. Rejected groups are discarded with reason `filtered`, never retried: a filter
judges the group's content, and generating the same prompt again would mostly repeat it. The filter
is the only place groups are dropped between the buffer and the trainer, so the ledger is exact.
"""

from __future__ import annotations

from typing import Callable, Protocol

from miles.buffer.types import Group
from miles.registry import Registry


class GroupFilter(Protocol):
    def __call__(self, group: Group) -> bool: ...


def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards differ: with all rewards equal every group-relative advantage is zero."""
    return len(set(group.rewards)) > 1


def keep_all(group: Group) -> bool:
    return True


FILTERS: Registry[Callable[[Group], bool]] = Registry("group filter", arity=1,
                                                       hint=" (a function (Group) -> bool, True = keep)")
FILTERS.register("nonzero_std", nonzero_std)
FILTERS.register("none", keep_all)


def get_filter(spec: str) -> GroupFilter:
    """A filter by registry name or `module:function`; a bad spec raises ValueError naming the fix."""
    return FILTERS.get(spec)
