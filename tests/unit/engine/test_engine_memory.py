"""Releasing memory really gives it back to the OS, and resuming restores the same model."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

TOKEN = "mem-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, tiny_model_dir):
    """A ~60 MB Qwen3 so the RSS drop stands out from allocator noise."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.models.loading import load_tokenizer

    out = tmp_path_factory.mktemp("wide-qwen3")
    tok = load_tokenizer(tiny_model_dir)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_release_drops_rss_and_resume_restores_the_same_outputs(wide_model_dir):
    from miles.engine.process import EngineProcess

    body = {"input_ids": list(range(5, 40)), "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    with EngineProcess(wide_model_dir, admin_token=TOKEN) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as c:
        first = c.post("/generate", json=body).json()
        rss_before = _rss_mb(proc.proc.pid)
        assert c.post("/release_memory_occupation", json={}).status_code == 401
        r = c.post("/release_memory_occupation", json={}, headers=AUTH)
        assert r.status_code == 200, r.text
        rss_released = _rss_mb(proc.proc.pid)
        assert rss_before - rss_released > 40, (rss_before, rss_released)
        assert c.get("/get_load").json()["released"] == ["kv_cache", "weights"]

        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=c.post("/generate", json=body)), daemon=True)
        t.start()
        time.sleep(0.5)
        assert "r" not in box, "a request was served with the weights released"
        r = c.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}, headers=AUTH)
        assert r.status_code == 200, r.text
        t.join(60)
        again = box["r"].json()
        assert again["output_ids"] == first["output_ids"]
        # The prefix cache was released with the KV: nothing of the first request's prompt is left.
        assert again["meta_info"]["cached_tokens"] == 0
        assert _rss_mb(proc.proc.pid) - rss_released > 40


def test_kv_only_release_keeps_weights_serving(client, admin_token):
    auth = {"Authorization": f"Bearer {admin_token}"}
    body = {"input_ids": list(range(60, 90)), "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    client.post("/generate", json=body)
    assert client.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=auth).status_code == 200
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=auth).status_code == 200
    assert client.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
