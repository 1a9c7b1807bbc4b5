"""Owner liveness: resources named after the process that made them (shared-memory buffers, sandbox
mounts and cgroups) are reclaimed once that process is gone. Non-goal: deciding what to reclaim."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
