"""Router families: how each mixture-of-experts model turns its router logits into the top-k gate
weights, described once from the HF config and used wherever routing is recorded or replayed.

Every router miles knows returns (logits, top-k weights, top-k expert ids) from its forward; they
differ in how the weights follow from the logits once the ids are chosen:
  * softmax: softmax over all experts, the chosen ones gathered, renormalised over the top-k or not
    (Qwen3-MoE by `norm_topk_prob`, Mixtral and Qwen3.5 always);
  * sigmoid: a sigmoid per expert, the chosen ones gathered, renormalised (DeepSeek adds 1e-20 to the
    sum) and multiplied by `routed_scaling_factor` (DeepSeek-V3/Kimi, GLM-4.5, GLM-5, Nemotron-H, MiniMax-M2).
    The score-correction bias and group-limited top-k change only which experts are chosen, never
    their weights, so replaying ids needs neither;
  * softmax over the chosen logits (GPT-OSS: top-k of the logits first, softmax over those k).
Rollout Routing Replay (trainer/r3.py) hands the experts the engine's ids with the weights this
module computes for them: exactly what the model's own router would give for those ids, so replay
never changes a forward whose routing already agreed.

A router class missing from ROUTER_FAMILIES is refused for capture and replay, with its class named:
an approximate replay is worse than none (wrong weights move every logprob).
Non-goals: hash routing (DeepSeek-V4's first layers), routers whose weights depend on more than
their logits and the chosen ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

Scoring = Literal["softmax", "sigmoid", "softmax_topk"]


@dataclass(frozen=True)
class RouterFamily:
    """How one router class weighs the experts it chose, read from the model's config."""

    scoring: Scoring
    """softmax over all experts, sigmoid per expert, or softmax over the chosen logits only."""
    renormalize: bool = True
    """Divide the chosen experts' scores by their sum."""
    scaling: float = 1.0
    """Multiply the weights by this after renormalising (DeepSeek's routed_scaling_factor)."""
    eps: float = 0.0
    """Added to the renormalising sum (DeepSeek's routers add 1e-20)."""

    def weights(self, logits: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gate weights (N, k) of experts `ids` (N, k) given router logits (N, E), as the router's own
        forward computes them, in `dtype` (what that forward returns). Differentiable in `logits`."""
        if self.scoring == "softmax_topk":
            # GPT-OSS takes the softmax in the logits' dtype, over the chosen logits only.
            return torch.softmax(logits.gather(1, ids), dim=-1, dtype=logits.dtype).to(dtype)
        if self.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
        w = scores.gather(1, ids)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + self.eps)
        if self.scaling != 1.0:
            w = w * self.scaling
        return w.to(dtype)


def _deepseek(c) -> RouterFamily:
    return RouterFamily("sigmoid", renormalize=bool(c.norm_topk_prob), scaling=float(c.routed_scaling_factor),
                        eps=1e-20)


# Router class name -> its family from the (text) config. Checked against each class's forward in
# tests/unit/models/test_routers.py; a class not listed is refused for routing replay.
ROUTER_FAMILIES: dict[str, Callable[[object], RouterFamily]] = {
    "Qwen3MoeTopKRouter": lambda c: RouterFamily("softmax", renormalize=bool(c.norm_topk_prob)),
    "Qwen3NextTopKRouter": lambda c: RouterFamily("softmax", renormalize=bool(c.norm_topk_prob)),
    "Qwen3_5MoeTopKRouter": lambda c: RouterFamily("softmax"),
    "MixtralTopKRouter": lambda c: RouterFamily("softmax"),
    "DeepseekV3TopkRouter": _deepseek,
    "Glm4MoeTopkRouter": _deepseek,
    "GlmMoeDsaTopkRouter": _deepseek,
    "NemotronHTopkRouter": _deepseek,
    "MiniMaxM2TopKRouter": lambda c: RouterFamily("sigmoid"),
    "GptOssTopKRouter": lambda c: RouterFamily("softmax_topk", renormalize=False),
}

# Where HF MoE blocks keep their router: `mlp.gate` (most), `mlp.router` (GPT-OSS), `mixer.gate`
# (Nemotron-H), `block_sparse_moe.gate` (older Mixtral-style checkpoints).
_ROUTER_NAMES = ("mlp.gate", "mlp.router", "mixer.gate", "block_sparse_moe.gate")


@dataclass(frozen=True)
class Router:
    """One MoE layer's router module and its family."""

    name: str
    module: torch.nn.Module
    family: RouterFamily


class UnknownRouter(NotImplementedError):
    """A model whose routers miles cannot record or replay exactly."""


def router_modules(model) -> list[torch.nn.Module]:
    """Every module where an HF MoE block keeps its router, known family or not (never raises): for
    code that only needs to leave routers alone (quantization keeps them in full precision)."""
    return [m for name, m in model.named_modules() if name.endswith(_ROUTER_NAMES)]


def find_routers(model, moe_layers: int) -> list[Router]:
    """The router of each of the model's `moe_layers` MoE layers, in layer order. Raises UnknownRouter
    naming the router class when a router's family is unknown or the count does not match."""
    config = model.config.get_text_config()
    found, unknown = [], []
    for name, m in model.named_modules():
        if not name.endswith(_ROUTER_NAMES):
            continue
        cls = type(m).__name__
        if cls in ROUTER_FAMILIES:
            found.append(Router(name, m, ROUTER_FAMILIES[cls](config)))
        else:
            unknown.append(cls)
    if unknown or len(found) != moe_layers:
        what = (f"router class {sorted(set(unknown))[0]}" if unknown else
                f"{len(found)} known routers for {moe_layers} MoE layers")
        raise UnknownRouter(
            f"{type(model).__name__} ({config.model_type}): {what}; routed-expert capture and replay (R3) know "
            f"only {', '.join(sorted(ROUTER_FAMILIES))} and never replay a router approximately. Serve and train "
            "it without routed experts: set rollout.return_routed_experts = false and trainer.routing_replay = false")
    return found
