"""Generate functions: the registry and its load-time checks (coroutine, four arguments)."""

from __future__ import annotations

import pytest

from miles.rollout.agent.episode import multi_turn
from miles.rollout.generate import get_generate_fn, single_turn


def sync_generate(ctx, prompt, params, rid):
    return None


async def three_args(ctx, prompt, params):
    return None


async def custom_generate(ctx, prompt, params, rid):
    return None


def test_generate_functions_by_name_or_path_are_checked_against_the_protocol():
    assert get_generate_fn("single_turn") is single_turn and get_generate_fn("agent") is multi_turn
    assert get_generate_fn(f"{__name__}:custom_generate") is custom_generate
    with pytest.raises(ValueError, match="choose one of .*agent.*single_turn"):
        get_generate_fn("multi")
    with pytest.raises(ValueError, match="cannot be loaded"):
        get_generate_fn("no.such.module:fn")
    with pytest.raises(ValueError, match="must be an `async def`"):
        get_generate_fn(f"{__name__}:sync_generate")
    with pytest.raises(ValueError, match=r"must take 4 required positional arguments; it takes 3 "
                                         r"\(an `async def` taking \(ctx, prompt, params, rid\)"):
        get_generate_fn(f"{__name__}:three_args")
