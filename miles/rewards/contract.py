"""The reward contract: what a reward function receives, what it returns, how it is named and
how it declares itself, checked when the run config is loaded.

A reward is named in `rollout.reward` by registry name (REWARDS), `module:function` or
`path/to/file.py:function`. The function's signature says what it receives:

- `(response, label)`: the response text and the prompt's label (the original contract);
- `(sample)`: one RewardInput: prompt text, response text and ids, label, metadata, and the whole
  group's RewardInputs (`group`) for rewards that judge a sample against its siblings.

It returns a float, or a dict with `score` (the float) and any other numbers, each logged as the
step mean `reward/<key>`. A dict may say whether the sample is right with `correct` (True/False, or
1/0), which eval's accuracy, pass@k and maj@k count instead of `score > 0`, so a shaped reward (a
format bonus, partial credit) keeps its score for training and its verdict for evaluation; a reward
whose score is its verdict declares `reward(correct_threshold=...)` instead (the built-ins do).
It may be `async def`. A function with `batched = True` (attribute, or the
`reward(batched=True)` decorator) takes lists instead (`(responses, labels)` or `(samples)`), one
group per call, and returns a list. One with `inline = True` (`reward(inline=True)`) is a plain `def`
that takes microseconds and cannot block (a string comparison): the runner calls it on the rollout's
event loop instead of handing each call to a thread. Non-goals: running it (runner.py), the built-ins
(builtins.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles.registry import Registry, RegistryError, required_positional

_HINT = (" (a function (response, label) or (sample) returning a float or a dict with 'score'; "
         "`batched = True` makes it take lists; see docs/rewards.md)")


@dataclass
class RewardInput:
    """What a one-argument reward receives about one sample."""

    prompt: str
    response: str
    label: Any = None
    response_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    group: list["RewardInput"] = field(default_factory=list, repr=False)  # every sample of its group, itself included


@dataclass(frozen=True)
class Scored:
    """One sample's score and whether the reward says it is right (None: the reward does not say)."""

    score: float
    correct: bool | None = None


def reward(*, batched: bool = False, inline: bool = False, correct_threshold: float | None = None):
    """Decorator declaring how a reward is called: `@reward(batched=True)` takes one group's lists;
    `@reward(inline=True)` is called on the event loop (only for a cheap `def` that cannot block:
    no thread hop, and no timeout can interrupt it). `correct_threshold` declares that a score at
    or above it means the sample is right (a dict's own `correct` still wins)."""
    def deco(fn):
        fn.batched, fn.inline, fn.correct_threshold = batched, inline, correct_threshold
        return fn
    return deco


@dataclass
class Reward:
    """A loaded, checked reward: its name, the function and how to call it."""

    name: str
    fn: Callable
    takes_sample: bool   # (sample) rather than (response, label)
    batched: bool
    is_async: bool
    inline: bool = False  # a cheap `def` called on the event loop (see `reward`)
    correct_threshold: float | None = None  # a score >= this is right, unless the call returns `correct`


class Configured:
    """A registry entry built from the run's RewardConfig (regex, weighted) rather than used as is."""

    def __init__(self, build: Callable):
        self.build = build

    def __call__(self, *args):  # never called: keeps the registry's callable check meaningful
        raise TypeError("a configured reward is built with .build(cfg)")


REWARDS: Registry[Callable] = Registry("reward", hint=_HINT)


def _load_file(spec: str) -> Any:
    path_text, _, attr = spec.rpartition(":")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise RegistryError(f"reward {spec!r}: no file {path}; give an existing path/to/file.py:function "
                            "(relative paths resolve against the current directory)")
    name = f"miles_user_reward_{abs(hash(str(path)))}"
    module = sys.modules.get(name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise RegistryError(f"reward {spec!r}: importing {path} failed ({type(e).__name__}: {e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"reward {spec!r}: {path} defines no {attr!r}") from None


def check_reward(name: str, fn: Any) -> Reward:
    """How `fn` is called, from its signature and `batched` attribute; RegistryError naming the fix otherwise."""
    if not callable(fn):
        raise RegistryError(f"reward {name!r} is not callable{_HINT}")
    try:
        n = required_positional(fn)
    except (TypeError, ValueError):
        n = 2  # builtins without a signature: assume (response, label)
    if n not in (1, 2):
        raise RegistryError(f"reward {name!r} takes {n} required positional arguments; it must take "
                            f"(response, label) or (sample){_HINT}")
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    inline = bool(getattr(fn, "inline", False))
    if inline and is_async:
        raise RegistryError(f"reward {name!r} is declared inline but is `async def`: an async reward already "
                            "runs on the event loop; drop inline = True")
    threshold = getattr(fn, "correct_threshold", None)
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise RegistryError(f"reward {name!r} declares correct_threshold = {threshold!r}; give a number (the "
                            "score at or above which a sample is right) or leave it unset")
    return Reward(name, fn, takes_sample=n == 1, batched=bool(getattr(fn, "batched", False)), is_async=is_async,
                  inline=inline, correct_threshold=None if threshold is None else float(threshold))


def load_reward(spec: str, cfg=None) -> Reward:
    """The reward `spec` names (registry name, module:function or file.py:function), checked.
    `cfg` (a RewardConfig) builds the configured built-ins."""
    module = spec.rpartition(":")[0]
    if module.endswith(".py"):
        fn = _load_file(spec)
    else:
        fn = REWARDS.get(spec)
    if isinstance(fn, Configured):
        if cfg is None:
            raise RegistryError(f"reward {spec!r} needs rollout.reward_config")
        try:
            fn = fn.build(cfg)
        except (ValueError, re.error) as e:
            raise RegistryError(str(e) if isinstance(e, ValueError) else
                                f"reward {spec!r}: rollout.reward_config.regex_pattern does not compile ({e})") from None
    return check_reward(spec, fn)


def component_specs(spec: str, cfg) -> dict[str, float]:
    """The rewards the run's score is made of, with their weights: `weighted` is its components."""
    if spec == "weighted":
        if cfg is None or not cfg.weights:
            raise RegistryError("reward 'weighted' needs rollout.reward_config.weights, e.g. "
                                "{ math = 0.9, regex = 0.1 }")
        return dict(cfg.weights)
    return {spec: 1.0}


def load_components(spec: str, cfg=None) -> list[tuple[Reward, float]]:
    """Each reward the run's score is made of, loaded and checked, with its weight."""
    return [(load_reward(name, cfg), w) for name, w in component_specs(spec, cfg).items()]


REWARDS.register("exact_match", "miles.rewards.builtins:exact_match")
REWARDS.register("text_parity", "miles.rewards.builtins:text_parity")
REWARDS.register("math", "miles.rewards.builtins:math_reward")
REWARDS.register("boxed_format", "miles.rewards.builtins:boxed_format")
REWARDS.register("regex", "miles.rewards.builtins:REGEX")


def _weighted_is_composite(cfg):
    raise RegistryError("reward 'weighted' is made of other rewards: load it with load_components")


REWARDS.register("weighted", Configured(_weighted_is_composite))
