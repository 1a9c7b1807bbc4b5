"""RL algorithms, one small file each on the shared per-token loss core, chosen by name from
`ALGORITHMS` (algorithms/base.py) or given as a user's `module:function`."""

from __future__ import annotations

from miles.trainer.algorithms.base import ALGORITHMS, Algorithm, AlgorithmBase, AlgorithmConfig, get_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmBase", "AlgorithmConfig", "get_algorithm"]
