"""RL algorithms, one small file each on the shared per-token loss core, chosen by name."""

from __future__ import annotations

from miles.trainer.algorithms.base import Algorithm, AlgorithmConfig
from miles.trainer.algorithms.dapo import DAPO
from miles.trainer.algorithms.dr_grpo import DrGRPO
from miles.trainer.algorithms.grpo import GRPO
from miles.trainer.algorithms.gspo import GSPO
from miles.trainer.algorithms.ppo import PPO
from miles.trainer.algorithms.reinforce_pp import ReinforcePP, ReinforcePPBaseline
from miles.trainer.algorithms.rloo import RLOO
from miles.trainer.algorithms.sft import SFT

ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO, "dr_grpo": DrGRPO, "dapo": DAPO, "gspo": GSPO, "reinforce_pp": ReinforcePP,
    "reinforce_pp_baseline": ReinforcePPBaseline, "rloo": RLOO, "ppo": PPO, "sft": SFT,
}


def get_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    try:
        cls = ALGORITHMS[cfg.name]
    except KeyError:
        raise ValueError(f"unknown algorithm {cfg.name!r}: choose one of {sorted(ALGORITHMS)}") from None
    return cls(cfg)
