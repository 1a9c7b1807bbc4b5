"""Abort, the three pause modes and continue, on a request that is really mid-decode in the engine process."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

PROMPT = "ls cat echo grep python file directory"


def _admin(admin_token):
    return {"Authorization": f"Bearer {admin_token}"}


def _start(engine_url, body) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        with httpx.Client(base_url=engine_url, timeout=120) as c:
            box["response"] = c.post("/generate", json=body)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_running(client, n=1, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/get_load").json()["num_running_reqs"] >= n:
            return
        time.sleep(0.02)
    pytest.fail("the request never entered the running batch")


def _long_greedy(ids, rid, n=400):
    return {"input_ids": ids, "rid": rid, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}


def _assert_greedy(hf_model, ids, out):
    """Each output token is transformers' argmax given everything before it, and its logprob matches."""
    full = torch.tensor([ids + out["output_ids"]])
    with torch.no_grad():
        logits = hf_model(full).logits[0, len(ids) - 1: -1].float()
    assert out["output_ids"] == logits.argmax(-1).tolist()
    lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
    torch.testing.assert_close(lps, expected, atol=1e-4, rtol=0)


@pytest.fixture
def paused_guard(client, admin_token):
    yield
    client.post("/continue_generation", headers=_admin(admin_token))


def test_abort_one_request_keeps_its_partial_output_and_spares_the_others(engine_url, client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    t1, victim = _start(engine_url, _long_greedy(ids, "victim"))
    t2, bystander = _start(engine_url, _long_greedy(ids[:4], "bystander", n=200))
    # Running means prefilled, which samples a row's first token: the victim has output before the abort,
    # and the abort follows at once, long before 400 tokens on any machine.
    _wait_running(client, 2)
    assert client.post("/abort_request", json={"rid": "victim"}).json()["success"] is True
    t1.join(60)
    t2.join(60)
    out = victim["response"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 400
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    assert bystander["response"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


def test_abort_all_needs_the_admin_token(client, admin_token):
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 401
    assert client.post("/abort_request", json={"abort_all": True}, headers=_admin(admin_token)).status_code == 200


def test_pause_abort_ends_running_requests_and_holds_new_ones_until_continue(
        engine_url, client, admin_token, tokenizer, paused_guard):
    ids = tokenizer.encode(PROMPT)
    t1, running = _start(engine_url, _long_greedy(ids, "pause-abort"))
    _wait_running(client)
    r = client.post("/pause_generation", json={"mode": "abort"}, headers=_admin(admin_token))
    assert r.status_code == 200, r.text
    t1.join(30)
    assert running["response"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    t2, held = _start(engine_url, {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    deadline = time.monotonic() + 30
    while client.get("/get_load").json()["num_waiting_reqs"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.get("/get_load").json()["num_waiting_reqs"] == 1
    time.sleep(0.2)  # queued while paused: a step that served it would have answered by now
    assert "response" not in held, "a request was served while generation was paused"
    assert client.get("/health_generate").status_code == 503
    client.post("/continue_generation", headers=_admin(admin_token))
    t2.join(30)
    assert held["response"].status_code == 200
    assert len(held["response"].json()["output_ids"]) == 4


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_then_continue_finishes_with_exact_greedy_output(
        engine_url, client, admin_token, tokenizer, hf_model, mode, paused_guard):
    ids = tokenizer.encode(PROMPT + " " + mode)
    before = client.get("/get_server_info").json()["engine_stats"]
    t, box = _start(engine_url, _long_greedy(ids, f"pause-{mode}", n=300))
    _wait_running(client)
    r = client.post("/pause_generation", json={"mode": mode}, headers=_admin(admin_token))
    assert r.status_code == 200, r.text
    load = client.get("/get_load").json()
    assert load["paused"] is True
    if mode == "retract":
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    else:
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 0)
    frozen = client.get("/get_server_info").json()["engine_stats"]["generated_tokens"]
    time.sleep(0.4)
    assert client.get("/get_server_info").json()["engine_stats"]["generated_tokens"] == frozen
    assert "response" not in box
    client.post("/continue_generation", headers=_admin(admin_token))
    t.join(60)
    out = box["response"].json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    _assert_greedy(hf_model, ids, out)
    after = client.get("/get_server_info").json()["engine_stats"]
    assert after["retracted_reqs"] - before["retracted_reqs"] == (1 if mode == "retract" else 0)


@pytest.mark.parametrize("path,body,reason", [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mode": "abort", "now": True}, "now"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/release_memory_occupation", {"tags": []}, "tags"),
    ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/abort_request", {}, "rid"),
    ("/generate", {"input_ids": [5], "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"input_ids": [5], "log_metrics": "loud"}, "log_metrics"),
])
def test_bad_control_requests_get_400_and_change_nothing(client, admin_token, path, body, reason):
    r = client.post(path, json=body, headers=_admin(admin_token))
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]
    load = client.get("/get_load").json()
    assert load["paused"] is False and load["released"] == []
    assert client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_fields_sglang_router_adds_are_accepted_at_their_defaults(client):
    """sglang-router re-serialises /generate with these fields set to SGLang's defaults."""
    body = {"model": None, "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_logprob": False,
            "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
            "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2


def test_control_endpoints_need_the_admin_token(client):
    for path in ("/pause_generation", "/continue_generation", "/release_memory_occupation",
                 "/resume_memory_occupation"):
        assert client.post(path, json={}).status_code == 401, path
    assert client.get("/get_load").json()["paused"] is False


def test_engine_and_router_bind_loopback_by_default(engine_url):
    from miles.engine.config import EngineConfig
    from miles.rollout.router import RouterConfig

    assert engine_url.startswith("http://127.0.0.1:")
    assert EngineConfig(model_path="x").host == RouterConfig().host == "127.0.0.1"
