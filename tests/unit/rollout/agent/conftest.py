"""Fixtures for agent tests: a tiny model with varied random weights served by a real engine process."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory) -> str:
    # The preset's default init gives near-uniform logits; std 0.1 weights give varied multi-token turns.
    from miles.models.loading import load_model, load_tokenizer
    from miles.models.presets import build_tiny_model

    out = build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("agent-model"))
    model, tok = load_model(str(out)), load_tokenizer(str(out))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def agent_tokenizer(agent_model_dir):
    from miles.models.loading import load_tokenizer

    return load_tokenizer(agent_model_dir)


@pytest.fixture(scope="session")
def agent_engine_url(agent_model_dir):
    from miles.rollout.engine.process import EngineProcess

    with EngineProcess(agent_model_dir) as proc:
        yield proc.url
