"""Fixtures for the built-in engine tests: one tiny model and one engine process per session."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers.models import build_varied_tiny_model

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return build_varied_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-varied"))


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from miles.models.loading import load_model

    return load_model(model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from miles.models.loading import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def admin_token() -> str:
    return ADMIN_TOKEN


@pytest.fixture(scope="session")
def engine_url(model_dir):
    from miles.engine.process import EngineProcess

    with EngineProcess(model_dir, admin_token=ADMIN_TOKEN) as proc:
        yield proc.url


@pytest.fixture
def client(engine_url):
    with httpx.Client(base_url=engine_url, timeout=120) as c:
        yield c


class Reference:
    """What the engine must reproduce, computed with transformers directly in this process."""

    def __init__(self, model):
        self.model = model

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy decode, cut after the first EOS as the engine stops there."""
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens)[0, len(prompt_ids):].tolist()
        eos = self.model.config.eos_token_id
        return out[: out.index(eos) + 1] if eos in out else out

    def logprobs(self, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / T) in fp32 of each output token, from one teacher-forced forward."""
        ids = torch.tensor([prompt_ids + output_ids])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt_ids) - 1: -1].float()  # (n_out, V)
        t = temperature if temperature > 0 else 1.0
        return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)


@pytest.fixture(scope="session")
def ref(hf_model) -> Reference:
    return Reference(hf_model)
