"""The reference policy for KL terms: a frozen, unsharded copy of the initial model.

It lives in CPU memory and visits the trainer's device only for its forward, so on an accelerator
it costs no device memory between forwards. It can be refreshed from the current policy (e.g.
every N steps) so KL anchors to a recent policy rather than the start.
Non-goal: a reference on its own actor/devices (needed only for models too big to copy per rank).
"""

from __future__ import annotations

import torch

from miles.models.loading import load_model
from miles.trainer import packed_attention
from miles.trainer.forward import forward_logprobs


class ReferenceModel:
    def __init__(self, model_path: str):
        self.model = load_model(model_path, "float32").eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        packed_attention.enable(self.model)  # packed rows a sequence at a time, where the family allows
        self.version = 0  # the policy step whose weights this holds

    def logprobs(self, input_ids, attention_mask, position_ids, temperature: float, images=None, packed=None):
        """Next-token logprobs (B, T-1) on the inputs' device; no gradient. `images`: a vision-language
        micro-batch's ImageBatch (trainer/vision.py); `packed`: a packed micro-batch's Plan."""
        device = input_ids.device
        with torch.no_grad():
            if device.type != "cpu":
                self.model.to(device)
            try:
                logp, _ = forward_logprobs(self.model, input_ids, attention_mask, position_ids, temperature,
                                           images=images, packed=packed)
            finally:
                if device.type != "cpu":
                    self.model.to("cpu")
        return logp

    def load(self, named_tensors, version: int) -> None:
        """Take the policy's full weights (an iterator of (HF name, tensor); consumed to the end)."""
        state = {n: t for n, t in named_tensors if t is not None}
        with torch.no_grad():
            own = self.model.state_dict()
            for name, t in state.items():
                if name in own:
                    own[name].copy_(t)
        self.version = version

    def state_dict(self):
        return {"version": self.version, "weights": self.model.state_dict()}

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state["weights"])
        self.version = state["version"]
