"""lora.sync = "adapter": the trainer writes the adapter as PEFT writes it, every engine loads it through
/load_lora_adapter and serves it labelled with the pushed version; a refused load leaves every engine
on its previous adapter; engines without the `lora_default` extension are refused at connect."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from miles.sync.adapter import AdapterSync
from miles.sync.transports.base import TransportError
from miles.trainer.lora import LoraConfig, adapter_tensors, apply_lora, save_adapter

PROMPT = [19, 20, 15, 21, 31, 27, 5]
LORA = LoraConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj", sync="adapter")


def _trained_peft_model(model_dir, seed: int):
    """The trainer's PEFT model with adapters moved away from PEFT's zero init (as training does)."""
    from miles.models.loading import load_model

    model = apply_lora(load_model(model_dir), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _logprobs(model, ids, out) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None]).squeeze(1)


def test_the_adapter_is_written_as_peft_writes_it(base_model_dir, tmp_path):
    model = _trained_peft_model(base_model_dir, seed=0)
    n = save_adapter(adapter_tensors(model.state_dict().items()), LORA, str(tmp_path / "ours"), base_model_dir)
    model.save_pretrained(str(tmp_path / "peft"))
    ours, theirs = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ours", "peft"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert n == sum(t.numel() * t.element_size() for t in ours.values())
    from peft import PeftConfig

    a, b = (PeftConfig.from_pretrained(str(tmp_path / d)) for d in ("ours", "peft"))
    assert (a.r, a.lora_alpha, set(a.target_modules), a.bias) == (b.r, b.lora_alpha, set(b.target_modules), b.bias)


@pytest.fixture(scope="module")
def engines(base_model_dir, admin_token):
    servers = [start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token)) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _gen(url):
    r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 8}}, timeout=60)
    r.raise_for_status()
    out = r.json()
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]), \
        out["meta_info"]["weight_version"]


def _loaded(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=60).json()["loaded_lora_adapters"]


def test_each_push_is_served_by_every_engine_under_its_version_and_replaces_the_last(base_model_dir, engines,
                                                                                      admin_token, tmp_path):
    sync = AdapterSync(LoraConfig(**{**LORA.__dict__, "adapter_dir": str(tmp_path)}), admin_token, base_model_dir)
    urls = [s.url for s in engines]
    sync.connect(urls)
    try:
        for version, seed in ((1, 1), (2, 2)):
            model = _trained_peft_model(base_model_dir, seed)
            metrics = sync.push(adapter_tensors(model.state_dict().items()), version)
            assert metrics["sync/bytes"] > 0
            merged = model.merge_and_unload().eval()
            for url in urls:
                assert list(_loaded(url)) == [f"policy-v{version}-{sync.token}"]  # the previous one is unloaded
                out, lps, label = _gen(url)
                assert label == str(version)
                torch.testing.assert_close(lps, _logprobs(merged, PROMPT, out), atol=1e-4, rtol=0)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]  # earlier versions' files are removed
    finally:
        for url in urls:
            for name in _loaded(url):
                httpx.post(url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60,
                           headers={"Authorization": f"Bearer {admin_token}"})
        sync.close()


def test_a_load_one_engine_refuses_is_taken_back_everywhere(base_model_dir, engines, admin_token, tmp_path):
    full = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token, max_lora_adapters=0))
    sync = AdapterSync(LoraConfig(**{**LORA.__dict__, "adapter_dir": str(tmp_path)}), admin_token, base_model_dir)
    url = engines[0].url
    try:
        sync.connect([url, full.url])
        before = _gen(url)
        with pytest.raises(TransportError, match="no engine serves it.*max_lora_adapters"):
            sync.push(adapter_tensors(_trained_peft_model(base_model_dir, 3).state_dict().items()), 5)
        assert _loaded(url) == {} and _loaded(full.url) == {}
        after = _gen(url)
        assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2]
    finally:
        sync.close()
        full.stop()


def test_engines_that_would_serve_the_base_model_are_refused_at_connect(base_model_dir, admin_token):
    plain = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token, sglang_only=True))
    sync = AdapterSync(LORA, admin_token, base_model_dir)
    try:
        with pytest.raises(TransportError, match="lora_default.*trainer.lora.sync = 'merged'"):
            sync.connect([plain.url])
    finally:
        sync.close()
        plain.stop()


def test_an_adapter_dir_without_adapter_sync_is_refused_naming_the_key():
    from miles.config.loader import ConfigError

    with pytest.raises(ConfigError, match="trainer.lora.adapter_dir .* set trainer.lora.sync = 'adapter'"):
        LoraConfig(rank=4, adapter_dir="/shared/adapters").validate()
