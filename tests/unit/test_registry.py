"""The one registry type: names, lazy `module:attr` entries, user entries, and the contract checks."""

from __future__ import annotations

from typing import Protocol

import pytest

from miles.registry import Registry, RegistryError


class Greeter(Protocol):
    def greet(self, name: str) -> str: ...


class Hello:
    def greet(self, name: str) -> str:
        return f"hello {name}"


class Mute:
    pass


def two_args(a, b):
    return a + b


async def coro(a):
    return a


def test_named_lazy_and_user_entries_resolve():
    reg: Registry[type] = Registry("greeter", protocol=Greeter)
    reg.register("hello", Hello)
    reg.register("lazy", f"{__name__}:Hello")
    assert reg.get("hello") is Hello
    assert reg.get("lazy") is Hello  # imported on first use
    assert reg.get(f"{__name__}:Hello") is Hello  # a user's module:attr
    assert "hello" in reg and reg.names() == ["hello", "lazy"]


def test_unknown_and_unloadable_names_say_what_to_do():
    reg: Registry[type] = Registry("greeter", protocol=Greeter)
    reg.register("hello", Hello)
    with pytest.raises(RegistryError, match=r"unknown greeter 'nope': choose one of \['hello'\]"):
        reg.get("nope")
    with pytest.raises(RegistryError, match="cannot be loaded"):
        reg.get("no_such_module_xyz:Thing")
    with pytest.raises(RegistryError, match="cannot be loaded"):
        reg.get(f"{__name__}:Missing")


def test_protocol_arity_and_coroutine_checks_refuse_misfits():
    reg: Registry[type] = Registry("greeter", protocol=Greeter)
    with pytest.raises(RegistryError, match=r"lacks \['greet'\]"):
        reg.get(f"{__name__}:Mute")
    fns: Registry = Registry("reward", arity=2)
    assert fns.get(f"{__name__}:two_args") is two_args
    with pytest.raises(RegistryError, match="must take 2 required positional arguments; it takes 1"):
        fns.get(f"{__name__}:coro")
    asyncs: Registry = Registry("generate function", coroutine=True, arity=1)
    assert asyncs.get(f"{__name__}:coro") is coro
    with pytest.raises(RegistryError, match="must be an `async def`"):
        asyncs.get(f"{__name__}:two_args")


def test_decorator_registration():
    reg: Registry = Registry("fn", arity=2)

    @reg.register("add")
    def add(a, b):
        return a + b

    assert reg.get("add") is add
