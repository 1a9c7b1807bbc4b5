"""RL algorithms, one small file each on the shared per-token loss core, chosen by name."""

from __future__ import annotations

from miles.trainer.algorithms.base import Algorithm, AlgorithmConfig
from miles.trainer.algorithms.grpo import GRPO

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPO}


def get_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    try:
        cls = ALGORITHMS[cfg.name]
    except KeyError:
        raise ValueError(f"unknown algorithm {cfg.name!r}: choose one of {sorted(ALGORITHMS)}") from None
    return cls(cfg)
