"""/generate with return_routed_experts: the top-k expert ids of every token the model was fed, per
MoE layer, equal to a transformers forward over the same tokens, however the engine batched them."""

from __future__ import annotations

import httpx
import pytest
import torch


@pytest.fixture(scope="module")
def moe_server(tiny_moe_model_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=tiny_moe_model_dir, prefix_block_size=4))
    yield server
    server.stop()


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """(tokens, MoE layers, top_k) expert ids of one teacher-forced transformers forward."""
    from miles.models.moe import hook_routers, routers

    ids = []
    with torch.no_grad(), hook_routers(routers(model), lambda _layer, out: ids.append(out[2])):
        model(input_ids=torch.tensor([tokens]))
    return torch.stack(ids, dim=1)


def test_routed_experts_match_transformers_for_every_token(moe_server, tiny_moe_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from miles.models.loading import load_model
    from miles.models.moe import decode_routed_experts

    hf = load_model(tiny_moe_model_dir).eval()
    # Mixed lengths decoded together, a GRPO-style pair of identical prompts (prefilled once), and a
    # prompt whose prefix the cache already holds (it must still be computed to be recorded).
    prompts = [list(range(3, 3 + n)) for n in (9, 14, 5)] + [list(range(3, 12))] * 2 + [list(range(3, 12)) + [40, 41]]
    body = lambda p, seed: {"input_ids": p, "return_logprob": True, "return_routed_experts": True,  # noqa: E731
                            "sampling_params": {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": seed}}
    with httpx.Client(base_url=moe_server.url, timeout=120) as c, ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda a: c.post("/generate", json=body(*a)).json(),
                             [(p, i) for i, p in enumerate(prompts)]))
        later = c.post("/generate", json=body(prompts[-1], 99)).json()
    assert later["meta_info"]["cached_tokens"] == 0  # computed, not read from the cache
    for p, out in zip(prompts + [prompts[-1]], outs + [later]):
        tokens = p + out["output_ids"]
        got = decode_routed_experts(out["meta_info"]["routed_experts"], 4, 2)
        assert got.shape == (len(tokens) - 1, 4, 2)  # the last sampled token was never fed back
        want = hf_routing(hf, tokens[:-1])
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_routed_experts_only_when_asked_and_only_for_moe(moe_server, tiny_model_dir):
    from miles.engine.engine import Engine
    from miles.engine.config import EngineConfig
    from miles.engine_api.errors import InvalidRequest

    r = httpx.post(f"{moe_server.url}/generate", json={"input_ids": [3, 4, 5],
                                                       "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert "routed_experts" not in r.json()["meta_info"]
    r = httpx.post(f"{moe_server.url}/generate", json={"input_ids": [3, 4], "return_routed_experts": "yes"}, timeout=60)
    assert r.status_code == 400 and "return_routed_experts" in r.json()["error"]
    dense = Engine(EngineConfig(model_path=tiny_model_dir))
    try:
        with pytest.raises(InvalidRequest, match="no mixture-of-experts layers"):
            dense.make_request([3, 4], return_routed_experts=True)
    finally:
        dense.stop()
