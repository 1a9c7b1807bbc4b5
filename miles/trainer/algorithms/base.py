"""The per-token policy-loss core every algorithm builds on, the algorithm contract and its registry.

An algorithm supplies per-sample advantages from a group's rewards and a per-token loss from
`LossInputs`, and declares what the trainer must produce for it (a reference model, a critic,
entropy, off-policy correction). Shared here: the base config every algorithm's `Config` extends,
the clipped surrogate (with dual-clip), KL estimators, and aggregation; trainer/loss.py composes them.

Aggregation is expressed as a weight per token that depends only on the sequence it belongs to and
on counts over the *global* batch (loss tokens, sequences, a constant), never on how samples were
split into ranks or micro-batches. So the step's gradient is the same for any split.
With `trainer.minibatches_per_step` > 1 a step's batch trains in several updates; the trainer then
records the proximal policy (the weights at the start of the step) for the algorithms that read it.
Non-goal: several epochs over one batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Protocol

from miles.config.loader import ConfigError
from miles.registry import Registry, RegistryError

if TYPE_CHECKING:
    import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass
class AlgorithmConfig:
    """What the shared loss core composes; each algorithm's own knobs live in its nested `Config`."""

    name: str = "grpo"
    """Algorithm by name (grpo, dr_grpo, dapo, gspo, reinforce_pp, reinforce_pp_baseline, rloo, ppo, sft,
    decoupled_ppo, seq_mis, opd) or
    a `module:function` factory taking this config and returning an Algorithm."""
    clip_eps_low: float | None = None
    """Lower clip range of the importance ratio (None = the algorithm's default, 0.2 for most)."""
    clip_eps_high: float | None = None
    """Upper clip range of the ratio (None = the algorithm's default; DAPO's clip-higher is 0.28)."""
    dual_clip_c: float = 0.0
    """Dual-clip bound c > 1 for negative advantages: the loss per token is at most c·|A| (0 = off)."""
    kl_coef: float = 0.0
    """Weight of the KL divergence to the reference model (0 = no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: k1 = log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (r = ref/policy)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """loss: add kl_coef·KL to the loss; reward: subtract kl_coef·KL (summed to the end) from advantages."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef × the policy's per-token entropy from the loss."""
    loss_agg: LossAgg | None = None
    """token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (None = the algorithm's default)."""
    loss_constant: int = 0
    """seq_mean_token_sum_norm (Dr.GRPO) divides each sequence's token sum by this (0 = the longest
    response in the global batch)."""
    tis_mode: Literal["off", "truncate", "mask"] = "off"
    """Off-policy correction (trainer/correction.py): off; truncate = weight tokens by π_train/π_rollout
    clipped to [tis_clip_low, tis_clip_high]; mask = that weight inside the band, 0 outside."""
    tis_clip_low: float = 0.0
    """Lower bound of the importance weight (truncate) or of the kept band (mask)."""
    tis_clip_high: float = 2.0
    """Upper bound of the importance weight (truncate) or of the kept band (mask)."""
    mask_truncated: bool = False
    """Overlong filtering (DAPO): a sample cut off by a length limit (max_new_tokens, the context, an
    agent's turn or token budget) adds no loss tokens. Its reward still counts in its group's baseline."""

    @classmethod
    def variant(cls, data: dict[str, Any]) -> type["AlgorithmConfig"]:
        """The config class of the algorithm the table names (its own `Config`, else this base).
        An unknown name builds the base, so that `validate` refuses it naming the key."""
        try:
            algorithm = ALGORITHMS.get(data.get("name", cls.name))
        except RegistryError:
            return AlgorithmConfig
        return getattr(algorithm, "Config", AlgorithmConfig)

    @classmethod
    def variants(cls) -> dict[str, type["AlgorithmConfig"]]:
        """Every registered algorithm's config (the configuration reference lists their own keys)."""
        return {name: cls.variant({"name": name}) for name in ALGORITHMS.names()}

    def validate(self) -> None:
        try:
            ALGORITHMS.get(self.name)
        except RegistryError as e:
            if ":" in self.name:  # a user's module:function that does not load or fit
                raise ConfigError(f"trainer.algorithm.name: {e}") from None
            raise ConfigError(f"trainer.algorithm.name {self.name!r} is unknown: choose one of {ALGORITHMS.names()} "
                              f"or give module:function{ALGORITHMS.hint}") from None
        for key in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"trainer.algorithm.{key} must be >= 0 (or unset for the algorithm's default)")
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError("trainer.algorithm.dual_clip_c must be > 1 (e.g. 3.0), or 0 to turn dual-clip off")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ConfigError("trainer.algorithm.kl_coef and entropy_coef must be >= 0")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError("trainer.algorithm.kl_estimator must be k1, k2 or k3")
        if self.kl_mode not in ("loss", "reward"):
            raise ConfigError("trainer.algorithm.kl_mode must be 'loss' or 'reward'")
        if self.loss_agg not in (None, "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            raise ConfigError("trainer.algorithm.loss_agg must be token_mean, seq_mean_token_mean or "
                              "seq_mean_token_sum_norm")
        if not 0 <= self.tis_clip_low < self.tis_clip_high:
            raise ConfigError("trainer.algorithm: need 0 <= tis_clip_low < tis_clip_high (e.g. 0 and 2)")


@dataclass
class LossInputs:
    """Per-token tensors aligned to next-token positions, each (B, T-1). `mask` is 1 on loss tokens.

    `seq_ids` numbers sequences within the micro-batch (-1 on tokens of no sequence), so packed
    rows (several sequences per row) and padded rows are treated alike.
    """

    logprobs: "torch.Tensor"
    old_logprobs: "torch.Tensor"
    advantages: "torch.Tensor"
    mask: "torch.Tensor"
    seq_ids: "torch.Tensor"
    ref_logprobs: "torch.Tensor | None" = None
    entropy: "torch.Tensor | None" = None
    teacher_logprobs: "torch.Tensor | None" = None  # a distillation teacher's, on the sampled tokens
    prox_logprobs: "torch.Tensor | None" = None  # the proximal policy's (weights at the start of the step),
    # recorded when a step makes several updates; None = the policy being trained is the proximal one


class Algorithm(Protocol):
    """What the trainer, its loss composition and the step's batching read from an algorithm: its
    advantages, its token loss and the capability flags below (AlgorithmBase has every default, so
    the trainer reads each flag directly and never probes for one)."""

    cfg: AlgorithmConfig
    needs_critic: ClassVar[bool]
    """Trains a value model next to the policy; the loss runs GAE over its values (PPO)."""
    on_rollouts: ClassVar[bool]
    """Trains on sampled rollouts: logprobs at the rollout temperature, compared with the engine's."""
    metric_prefix: ClassVar[str]
    """Namespace of its step metrics (`train`, `sft`)."""
    needs_teacher: ClassVar[bool]
    """Scores its tokens with a frozen teacher (`teacher_path`, else teacher engines), as distillation does."""
    group_relative: ClassVar[bool]
    """Its advantages compare a sample with the others of its group: a group of one has no signal."""

    @property
    def loss_agg(self) -> str: ...

    @property
    def needs_reference(self) -> bool: ...

    @property
    def needs_entropy(self) -> bool: ...

    @property
    def corrects_off_policy(self) -> bool: ...

    @property
    def needs_proximal(self) -> bool:
        """Reads the proximal policy's logprobs (the weights at the start of the step) when a step
        makes several updates: the trainer records them in one no-grad forward first."""

    @property
    def reweights_groups(self) -> bool:
        """Re-estimates each group's advantages under the proximal policy before the step
        (`reweighted_advantages`, from one no-grad forward of the whole batch)."""

    @property
    def teacher_path(self) -> str:
        """A teacher checkpoint the trainer loads and runs itself; empty = none (or teacher engines)."""

    def advantages(self, rewards: list[float]) -> list[float]:
        """Per-sample advantages of one group (PPO: the raw rewards; GAE runs in the trainer)."""

    def batch_advantages(self, advantages: list[float]) -> list[float]:
        """A pass over the whole global batch after the per-group pass (identity for most)."""

    def token_loss(self, x: LossInputs) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
        """Per-token policy loss (B, T-1) and per-token metrics (e.g. clipfrac)."""

    def reweighted_advantages(self, rewards: list[float], log_weights: list[float]) -> list[float]:
        """A group's advantages under the proximal policy, given each sample's sequence log-ratio
        log π_prox(y) − log π_behav(y); called only when `reweights_groups`."""


class AlgorithmBase:
    """Defaults shared by the algorithms: token-mean aggregation, no critic, clipped surrogate;
    a reference model, entropy and off-policy correction exactly when the config asks for them."""

    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    default_loss_agg: ClassVar[str] = "token_mean"
    needs_critic: ClassVar[bool] = False
    on_rollouts: ClassVar[bool] = True
    """Trains on sampled rollouts: logprobs at the rollout temperature, compared with the engine's."""
    metric_prefix: ClassVar[str] = "train"
    needs_teacher: ClassVar[bool] = False
    """Scores its tokens with a frozen teacher (its `teacher_path`), as distillation does."""
    group_relative: ClassVar[bool] = False
    """Its advantages compare a sample with the others of its group: a group of one has no signal."""
    default_clip: ClassVar[tuple[float, float]] = (0.2, 0.2)

    def __init__(self, cfg: AlgorithmConfig):
        if not isinstance(cfg, self.Config):
            # A bare base config (built in code rather than loaded): this algorithm's own knobs at their defaults.
            cfg = self.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(AlgorithmConfig)})
        self.cfg = cfg
        lo, hi = self.default_clip
        self.clip_low = lo if cfg.clip_eps_low is None else cfg.clip_eps_low
        self.clip_high = hi if cfg.clip_eps_high is None else cfg.clip_eps_high

    @property
    def loss_agg(self) -> str:
        return self.cfg.loss_agg or self.default_loss_agg

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0

    @property
    def corrects_off_policy(self) -> bool:
        return self.cfg.tis_mode != "off"

    @property
    def needs_proximal(self) -> bool:
        """Reads the proximal policy's logprobs (`LossInputs.prox_logprobs`) when a step makes several
        updates: the off-policy correction weights tokens π_prox/π_rollout and clips around π_prox."""
        return self.corrects_off_policy

    @property
    def reweights_groups(self) -> bool:
        return False

    @property
    def teacher_path(self) -> str:
        return ""

    def batch_advantages(self, advantages: list[float]) -> list[float]:
        return advantages

    def reweighted_advantages(self, rewards: list[float], log_weights: list[float]) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} sets reweights_groups but does not define "
                                  "reweighted_advantages(rewards, log_weights)")

    def token_loss(self, x: LossInputs):
        loss, clipped = clipped_surrogate(x.logprobs, x.old_logprobs, x.advantages, self.clip_low, self.clip_high,
                                          self.cfg.dual_clip_c)
        return loss, {"clipfrac": clipped}


AlgorithmFactory = Callable[[AlgorithmConfig], Algorithm]

# A new algorithm is one file plus one line here; entries load on first use.
ALGORITHMS: Registry[AlgorithmFactory] = Registry(
    "algorithm", protocol=Algorithm, arity=1,
    hint=" (a class or function taking the algorithm config and returning an Algorithm)")
ALGORITHMS.register("grpo", "miles.trainer.algorithms.grpo:GRPO")
ALGORITHMS.register("dr_grpo", "miles.trainer.algorithms.dr_grpo:DrGRPO")
ALGORITHMS.register("dapo", "miles.trainer.algorithms.dapo:DAPO")
ALGORITHMS.register("gspo", "miles.trainer.algorithms.gspo:GSPO")
ALGORITHMS.register("reinforce_pp", "miles.trainer.algorithms.reinforce_pp:ReinforcePP")
ALGORITHMS.register("reinforce_pp_baseline", "miles.trainer.algorithms.reinforce_pp:ReinforcePPBaseline")
ALGORITHMS.register("rloo", "miles.trainer.algorithms.rloo:RLOO")
ALGORITHMS.register("ppo", "miles.trainer.algorithms.ppo:PPO")
ALGORITHMS.register("sft", "miles.trainer.algorithms.sft:SFT")
ALGORITHMS.register("decoupled_ppo", "miles.trainer.algorithms.decoupled_ppo:DecoupledPPO")
ALGORITHMS.register("seq_mis", "miles.trainer.algorithms.seq_mis:SeqMIS")
ALGORITHMS.register("opd", "miles.trainer.algorithms.opd:OPD")


def get_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    """The algorithm `cfg.name` names (a registry name or a user's `module:function`), built with `cfg`."""
    return ALGORITHMS.get(cfg.name)(cfg)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float,
                      dual_clip_c: float = 0.0):
    """PPO's clipped objective per token, as a loss; any shape, elementwise.

    With dual_clip_c > 1, a token with a negative advantage loses at most c·|A|: a huge ratio on a
    bad action (stale or off-policy sample) cannot blow up the update.
    Returns the per-token loss and the per-token indicator of clipping (for clipfrac).
    """
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    if dual_clip_c > 0:
        bound = -dual_clip_c * advantages  # positive where A < 0
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = torch.where(dual, torch.ones_like(was_clipped), was_clipped)
    return loss, was_clipped


def proximal_logprobs(x: LossInputs) -> "torch.Tensor":
    """log π_prox (B, T-1), no gradient: the weights at the start of the step where the trainer recorded
    them (several updates per step), else the policy being trained (one update: the same weights)."""
    return x.prox_logprobs if x.prox_logprobs is not None else x.logprobs.detach()


def sequence_sums(values: "torch.Tensor", seq_ids: "torch.Tensor") -> "torch.Tensor":
    """(B, T-1): at each token, the sum of `values` over the tokens of its sequence (seq_ids numbers them;
    -1 tokens add to sequence 0's sum and read it, so mask `values` and the result where that matters)."""
    import torch

    ids = torch.where(seq_ids >= 0, seq_ids, 0).flatten()
    n_seq = max(int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0, 1)
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, ids, values.flatten())
    return sums[ids].view_as(values)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3)."""
    import torch

    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        # Clamp before exp: a token the reference finds far likelier would overflow.
        log_r = torch.clamp(log_r, -20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}: choose k1, k2 or k3")


def kl_reward_penalty(advantages, logprobs, ref_logprobs, mask, seq_ids, coef: float):
    """Advantages minus coef × the k1 KL of this token and every later token of its sequence.

    This is the return of a per-token reward of -coef·KL with γ = 1, as in REINFORCE++.
    All (B, T-1); no gradient flows through the penalty.
    """
    import torch

    with torch.no_grad():
        kl = (logprobs - ref_logprobs) * mask
        # Suffix sums along each row, then cut at sequence boundaries: subtract the suffix sum that
        # starts right after the sequence's last token.
        suffix = torch.flip(torch.cumsum(torch.flip(kl, [1]), 1), [1])
        after = torch.zeros_like(suffix)
        for b in range(seq_ids.shape[0]):
            ids = seq_ids[b]
            for sid in torch.unique(ids[ids >= 0]).tolist():
                pos = (ids == sid).nonzero().flatten()
                end = int(pos[-1]) + 1
                tail = suffix[b, end] if end < suffix.shape[1] else suffix.new_zeros(())
                after[b, pos] = tail
        return advantages - coef * (suffix - after) * mask


def entropy_from_logits(logits):
    """Per-token entropy of softmax(logits) over the last dim, in float32."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_weights(loss_agg: str, seq_lens: list[int], global_tokens: int, global_seqs: int,
                  constant: int) -> list[float]:
    """The weight of each loss token of each sequence, so that sum(weight × token loss) over the
    global batch is the aggregated loss. Depends only on global counts, never on the split."""
    if loss_agg == "token_mean":
        return [1.0 / max(global_tokens, 1)] * len(seq_lens)
    if loss_agg == "seq_mean_token_mean":
        return [1.0 / (max(n, 1) * max(global_seqs, 1)) for n in seq_lens]
    if loss_agg == "seq_mean_token_sum_norm":
        return [1.0 / (max(constant, 1) * max(global_seqs, 1))] * len(seq_lens)
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")
