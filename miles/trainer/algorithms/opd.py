"""On-policy distillation (OPD): the student samples, a teacher scores the student's own tokens, and
the teacher's judgement is the advantage.

For each sampled response token y_t, with student logprob log π_s(y_t) (the trainer's, detached)
and teacher logprob log π_T(y_t), the per-token reverse KL estimate is k_t = log π_s(y_t) − log π_T(y_t)
(its expectation over the student's samples is KL(π_s ‖ π_T)). The advantage of token t is

    A_t = reward_coef · A_task − kl_coef · k_t                       (kl_level = "token")
    A_t = reward_coef · A_task − kl_coef · Σ_{t' in sequence} k_t'   (kl_level = "sequence")

where A_task is GRPO's group-normalised task reward (reward_coef = 0: pure distillation). The loss is
the clipped surrogate against the rollout policy, as GRPO's. The per-token form gives dense credit;
the per-sequence form scores the whole response alike (the sequence's log π_s(y)/π_T(y)).
The teacher is either a frozen model in the trainer process (`opd.teacher_path`, trainer/teacher.py),
scoring at the trainer's forward, or engines of its own (the run's `[teacher]` section,
rollout/teacher.py), scoring each group during the rollout; either way it never receives weight updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from miles.config.loader import ConfigError
from miles.models.loading import check_model_path
from miles.trainer.algorithms.base import LossInputs, clipped_surrogate
from miles.trainer.algorithms.grpo import GRPO


@dataclass
class OPDSettings:
    """The distillation terms of `trainer.algorithm.name = "opd"`."""

    teacher_path: str = ""
    """Checkpoint directory (or hub id) of a teacher run inside the trainer; its tokenizer must match the
    policy's. Empty: the teacher is served by engines (the [teacher] section)."""
    kl_coef: float = 1.0
    """Weight of the teacher's signal: the advantage gains -kl_coef × (student − teacher logprob)."""
    reward_coef: float = 0.0
    """Weight of the task reward's GRPO advantage (0 = pure distillation)."""
    kl_level: Literal["token", "sequence"] = "token"
    """token: each token's own reverse KL; sequence: the sequence's summed reverse KL on every token."""

    def validate(self) -> None:
        # Whether a teacher is given at all depends on the [teacher] section: miles/run_checks.py.
        if self.teacher_path:
            try:
                check_model_path(self.teacher_path)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"trainer.algorithm.opd.teacher_path: {e}") from None
        if self.kl_coef < 0 or self.reward_coef < 0 or self.kl_coef + self.reward_coef == 0:
            raise ConfigError("trainer.algorithm.opd: need kl_coef >= 0 and reward_coef >= 0, not both 0 "
                              "(e.g. kl_coef = 1, reward_coef = 0 for pure distillation)")
        if self.kl_level not in ("token", "sequence"):
            raise ConfigError("trainer.algorithm.opd.kl_level must be 'token' or 'sequence'")


class OPD(GRPO):
    # Pure distillation learns from a single sample per prompt: its signal is the teacher, not the group.
    group_relative = False
    needs_teacher = True

    @dataclass
    class Config(GRPO.Config):
        opd: OPDSettings = field(default_factory=OPDSettings)
        """Teacher and the distillation terms."""

    cfg: Config

    @property
    def teacher_path(self) -> str:
        return self.cfg.opd.teacher_path

    def token_loss(self, x: LossInputs):
        import torch

        s = self.cfg.opd
        if x.teacher_logprobs is None:
            raise ValueError("opd needs the teacher's logprobs in LossInputs.teacher_logprobs")
        rkl = (x.logprobs.detach() - x.teacher_logprobs) * x.mask  # (B, T-1) reverse KL estimate per token
        if s.kl_level == "sequence":
            ids = torch.where(x.seq_ids >= 0, x.seq_ids, 0).flatten()
            n_seq = max(int(x.seq_ids.max().item()) + 1 if x.seq_ids.numel() else 0, 1)
            per_seq = torch.zeros(n_seq, dtype=rkl.dtype, device=rkl.device).index_add(0, ids, rkl.flatten())
            signal = per_seq[ids].view_as(rkl) * x.mask
        else:
            signal = rkl
        adv = s.reward_coef * x.advantages - s.kl_coef * signal
        loss, clipped = clipped_surrogate(x.logprobs, x.old_logprobs, adv, self.clip_low, self.clip_high,
                                          self.cfg.dual_clip_c)
        return loss, {"clipfrac": clipped, "opd/reverse_kl": rkl, "opd/teacher_logprob": x.teacher_logprobs,
                      "opd/advantage": adv}
