"""LoRA adapters on the built-in engine, through SGLang's /load_lora_adapter and /unload_lora_adapter:
with an adapter loaded the engine's logprobs are the merged model's, an unload gives back the base
model's outputs, requests can name an adapter (lora_path) next to requests on another one, and a bad
load or a request naming no loaded adapter gets a 400 that names the problem and changes nothing."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
import torch

from miles.engine.config import EngineConfig
from miles.engine.server import start_server_thread
from tests.unit.engine.conftest import Reference

TOKEN = "lora-admin-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [19, 20, 15, 21, 31, 27, 5]


def _write_adapter(model_dir: str, out, targets=("q_proj", "v_proj", "down_proj"), rank: int = 4, seed: int = 0):
    """A PEFT adapter with non-zero B (PEFT starts B at zero, which would change nothing), written by
    PEFT's own save_pretrained; returns the merged model (what the engine must reproduce)."""
    from peft import LoraConfig, get_peft_model

    from miles.models.loading import load_model

    peft_model = get_peft_model(load_model(model_dir), LoraConfig(r=rank, lora_alpha=8, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(str(out))
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    merged_a = _write_adapter(model_dir, root / "a", seed=1)
    merged_b = _write_adapter(model_dir, root / "b", targets=("o_proj", "up_proj"), rank=2, seed=2)
    return {"a": (str(root / "a"), Reference(merged_a)), "b": (str(root / "b"), Reference(merged_b)),
            "root": root}


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server_thread(EngineConfig(model_path=model_dir, admin_token=TOKEN, prefix_cache_mb=16))
    yield srv
    srv.stop()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)


def _gen(server, ids=PROMPT, lora=None, **sp):
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5, **sp}}
    if lora is not None:
        body["lora_path"] = lora
    r = _post(server, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _loaded(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=60).json()["loaded_lora_adapters"]


def test_logprobs_with_an_adapter_loaded_equal_the_merged_models_and_unload_restores_the_base(server, adapters, ref):
    base_out, base_lps = _gen(server)
    torch.testing.assert_close(base_lps, ref.logprobs(PROMPT, base_out), atol=1e-4, rtol=0)
    path, merged = adapters["a"]
    r = _post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": path})
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": None,
                                                 "loaded_adapters": {"a": path}}, r.text
    try:
        for lora in ("a", None):  # named, and by default (the most recently loaded adapter)
            out, lps = _gen(server, lora=lora)
            torch.testing.assert_close(lps, merged.logprobs(PROMPT, out), atol=1e-4, rtol=0)
            assert not torch.allclose(ref.logprobs(PROMPT, out), lps, atol=1e-2)  # the adapter did change them
            # The second request reads the first one's cached prefix (same adapter): still exact.
            out2, lps2 = _gen(server, lora=lora)
            assert out2 == out and torch.allclose(lps2, lps, atol=1e-5)
    finally:
        r = _post(server, "/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    out, lps = _gen(server)
    assert out == base_out
    torch.testing.assert_close(lps, base_lps, atol=1e-6, rtol=0)


def test_requests_on_different_adapters_decode_together_each_on_its_own(server, adapters, ref):
    (path_a, merged_a), (path_b, merged_b) = adapters["a"], adapters["b"]
    assert _post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": path_a}).status_code == 200
    r = _post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": path_b, "pinned": True})
    assert r.status_code == 200
    try:
        # One batched request: a, b, the default (b, loaded last), and a again on another prompt.
        prompts = [PROMPT, PROMPT, PROMPT, PROMPT[:4]]
        r = _post(server, "/generate", {"input_ids": prompts, "lora_path": ["a", "b", None, "a"],
                                        "return_logprob": True,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 10}})
        assert r.status_code == 200, r.text
        for out, ids, reference in zip(r.json(), prompts, [merged_a, merged_b, merged_b, merged_a]):
            lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(lps, reference.logprobs(ids, out["output_ids"], 0.0), atol=1e-4, rtol=0)
        # The two adapters disagree, so a row served with the other one would have failed above.
        out0 = r.json()[0]["output_ids"]
        assert not torch.allclose(merged_a.logprobs(PROMPT, out0), merged_b.logprobs(PROMPT, out0), atol=1e-2)
    finally:
        for name in ("a", "b"):
            _post(server, "/unload_lora_adapter", {"lora_name": name})


def _broken(adapters, name: str, edit) -> str:
    """A copy of adapter a with its config edited by `edit(cfg)` (or its files changed by it)."""
    src, dst = adapters["a"][0], adapters["root"] / name
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg_file = dst / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    if edit(cfg, dst) is not False:
        cfg_file.write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("case, body_of, reason", [
    ("unknown name on unload", lambda a: ("/unload_lora_adapter", {"lora_name": "nobody"}),
     "no adapter named 'nobody'"),
    ("missing directory", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}),
     "is not a directory"),
    ("missing weights file", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "noweights", lambda c, d: (d / "adapter_model.safetensors").unlink())}), "no adapter_model.safetensors"),
    ("weights file is a FIFO", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "fifo", lambda c, d: ((d / "adapter_model.safetensors").unlink(),
                                 os.mkfifo(d / "adapter_model.safetensors")))}), "not a regular file"),
    ("wrong rank", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "rank", lambda c, d: c.update(r=8))}), "rank r = 8"),
    ("target module the model lacks", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "targets", lambda c, d: c.update(target_modules=["q_proj", "wq"]))}), "'wq' names no linear layer"),
    ("tensor outside target_modules", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "untargeted", lambda c, d: c.update(target_modules=["q_proj", "v_proj"]))}), "does not name"),
    ("DoRA", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": _broken(
        a, "dora", lambda c, d: c.update(use_dora=True))}), "use_dora"),
    ("name taken", lambda a: ("/load_lora_adapter", {"lora_name": "keep", "lora_path": a["b"][0]}), "already loaded"),
    ("field SGLang lacks", lambda a: ("/load_lora_adapter", {"lora_name": "x", "lora_path": a["b"][0], "rank": 2}),
     "rank: unknown field"),
])
def test_a_bad_lora_request_gets_a_400_naming_the_problem_and_changes_nothing(server, adapters, ref, case, body_of,
                                                                              reason):
    path_a = adapters["a"][0]
    assert _post(server, "/load_lora_adapter", {"lora_name": "keep", "lora_path": path_a}).status_code == 200
    try:
        before = _gen(server)
        path, body = body_of(adapters)
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert reason in r.json()["error_message"], r.json()
        assert _loaded(server) == {"keep": path_a}
        after = _gen(server)
        assert after[0] == before[0] and torch.allclose(after[1], before[1], atol=1e-6)
    finally:
        _post(server, "/unload_lora_adapter", {"lora_name": "keep"})


def test_generate_naming_no_loaded_adapter_is_refused(server):
    r = _post(server, "/generate", {"input_ids": PROMPT, "lora_path": "ghost"})
    assert r.status_code == 400 and "no adapter named 'ghost' is loaded" in r.json()["error"]
    r = _post(server, "/generate", {"input_ids": PROMPT, "lora_path": 3})
    assert r.status_code == 400 and r.json()["error"].startswith("lora_path:")


def test_lora_routes_are_admin_routes(server, adapters):
    r = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"][0]})
    assert r.status_code == 401 and _loaded(server) == {}


def test_in_sglang_only_mode_a_request_without_lora_path_uses_the_base_model(model_dir, adapters, ref):
    srv = start_server_thread(EngineConfig(model_path=model_dir, admin_token=TOKEN, sglang_only=True))
    try:
        path, merged = adapters["a"]
        assert _post(srv, "/load_lora_adapter", {"lora_name": "a", "lora_path": path}).status_code == 200
        out, lps = _gen(srv)
        torch.testing.assert_close(lps, ref.logprobs(PROMPT, out), atol=1e-4, rtol=0)
        out, lps = _gen(srv, lora="a")
        torch.testing.assert_close(lps, merged.logprobs(PROMPT, out), atol=1e-4, rtol=0)
        assert "miles_extensions" not in httpx.get(srv.url + "/get_server_info").json()
    finally:
        srv.stop()
