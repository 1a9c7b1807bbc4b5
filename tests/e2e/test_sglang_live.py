"""miles against live SGLang servers (sglang==0.5.23 on the CPU, in the venv scripts/install-sglang.sh
makes; the stand-in for its kernel package on the path): launched by miles as a run's engines,
trained through, and fed weights over SGLang's own routes.

1. `miles train` with rollout.engine.kind = "sglang": miles starts the server (a Ray actor behind the
   run's router and fleet), trains two GRPO steps with weights pushed by broadcast (SGLang's
   init_weights_update_group + update_weights_from_distributed in a begin/end weight-update session),
   verified against the trainer's tensors; then the server's greedy ids equal a transformers forward
   of the trainer's exported checkpoint.
2. On one shared server: what the rollout uses (TITO with logprobs, a batched group, streaming, abort,
   /v1), an OpenAI session through `miles sessions`, then a broadcast push verified tensor by tensor
   against the trainer's checksums, and a push that skips a tensor named by the verification; the same
   over the disk transport (SGLang's /update_weights_from_disk); and the transports SGLang cannot take
   on the CPU refused at connect, naming the fix. Tests that need the launch state reload it first
   (tests/helpers/live_sglang.py).
3. (slow) A server killed mid-run is replaced, and the run completes with nothing lost or trained twice.

One SGLang server runs at a time (about 3.8 GB): the train run's server is stopped before the shared
one starts.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import torch

from tests.helpers.live_sglang import relaunched
from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e

TOKEN = "live-sglang-token"


def _slow_down(url: str, admin: dict, seconds: float | None) -> None:
    """SGLang's testing hook: every forward sleeps `seconds` (None: back to full speed)."""
    httpx.post(url + "/slow_down", json={"forward_sleep_time": seconds}, headers=admin, timeout=30).raise_for_status()


def _sglang_python() -> str:
    from miles.sglang.config import SGLangConfig

    try:
        return SGLangConfig().resolve_python()
    except Exception as exc:  # noqa: BLE001 - said in the failure
        pytest.fail(f"no SGLang environment: {exc}")


def test_a_grpo_run_on_an_sglang_server_miles_launched_serves_the_trainers_weights(tiny_model_dir, tmp_path,
                                                                                  ray_cluster):
    from miles.models.loading import load_model
    from miles.orchestration.driver import run_train
    from miles.trainer.forward import token_logprobs
    from tests.helpers.sglang_probe import NEW_TOKENS, PROMPTS

    _sglang_python()
    summary = run_train(small_config(tiny_model_dir, tmp_path, **{
        "rollout.engine.kind": "sglang", "rollout.engine.memory_fraction": "0.05", "rollout.num_engines": "1",
        "loop.num_steps": "2", "eval.every_steps": "0", "trainer.lr": "5e-3",
        "rollout.reward": "tests.e2e.test_async:text_parity_reward",  # a learning signal from a random model
        "sync.transport": "broadcast", "sync.verify_first_update": "true", "sync.verify_checksums": "true",
        "loop.schedule": "tests.helpers.sglang_probe:sync_then_probe"}))
    assert summary["steps"] == 2
    run_dir = next(p.parent for p in tmp_path.rglob("probe.json"))
    probe = json.loads((run_dir / "probe.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Every push was checked against the trainer's tensors on the SGLang server itself.
    verified = [m["sync/verified_tensors"] for m in metrics if "sync/verified_tensors" in m]
    assert len(verified) >= 2 and min(verified) >= 30, verified
    model, start = load_model(probe["export"]).eval(), load_model(tiny_model_dir).eval()
    assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.state_dict().values())), \
        "the two steps did not change the weights: the check below would prove nothing"
    (url, answers), = probe["answers"].items()
    for prompt, answer in zip(PROMPTS, answers):
        assert answer["meta_info"]["weight_version"] == "2", answer["meta_info"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        got = answer["output_ids"]
        assert got == ref[:len(got)], (prompt, got, ref)
        # The logprobs SGLang reports are the exported weights', not the starting ones'.
        full = torch.tensor([prompt + got])
        served = torch.tensor([lp for lp, *_ in answer["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            exported = token_logprobs(model, full, torch.ones_like(full), temperature=0)[0, len(prompt) - 1:]
            starting = token_logprobs(start, full, torch.ones_like(full), temperature=0)[0, len(prompt) - 1:]
        assert torch.allclose(served, exported, atol=1e-4), (served, exported)
        assert not torch.allclose(served, starting, atol=1e-4)


@pytest.fixture(scope="module")
def sglang_server(base_model_dir):
    """One live SGLang server on the tiny model, launched as miles launches it, shared by this module's
    protocol and weight tests."""
    from miles.engine.config import EngineConfig
    from miles.sglang.config import SGLangConfig
    from miles.sglang.server import SGLangServer

    _sglang_python()
    server = SGLangServer(EngineConfig(model_path=base_model_dir, device="cpu", memory_fraction=0.05,
                                       admin_token=TOKEN), SGLangConfig())
    yield server
    server.stop()


def test_what_the_rollout_uses_answers_on_live_sglang_as_miles_reads_it(sglang_server, base_model_dir):
    """TITO with logprobs, a batched group, streaming, abort and SGLang's /v1 (OpenAI) on the live server;
    run before any push, so the server still holds the base checkpoint."""
    from miles.models.loading import load_model

    url, admin = sglang_server.url, {"Authorization": f"Bearer {TOKEN}"}
    prompt = [19, 20, 15, 21, 31, 27]
    one = _greedy(url, prompt)
    meta = one["meta_info"]
    assert meta["weight_version"] == "default" and meta["finish_reason"]["type"] == "length"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == one["output_ids"]
    model = load_model(base_model_dir).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=0)
    assert one["output_ids"] == ref[0, len(prompt):].tolist()[:len(one["output_ids"])]
    # A group as one batched request (SGLang's list form): one answer per prompt, in order.
    batch = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": [prompt, prompt, [1, 2, 3]], "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
    assert len(batch) == 3 and batch[0]["output_ids"] == batch[1]["output_ids"] == one["output_ids"]
    # Streaming: SSE chunks ending with [DONE], the last one holding every id.
    with httpx.stream("POST", url + "/generate", timeout=120, json={
            "input_ids": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}) as r:
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]" and len(lines) >= 3
    assert json.loads(lines[-2])["output_ids"][-6:] == one["output_ids"][-6:]
    # Abort: a long request ends early with finish_reason abort once /abort_request names it. SGLang's
    # /slow_down makes each forward sleep 20 ms meanwhile, so the 400 tokens take 8 s or more and the
    # abort 2 s in lands mid-request however fast the machine decodes.
    answer = {}
    long_req = threading.Thread(target=lambda: answer.update(httpx.post(url + "/generate", timeout=300, json={
        "input_ids": prompt, "rid": "long-one",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).json()))
    _slow_down(url, admin, 0.02)
    try:
        long_req.start()
        time.sleep(2.0)
        assert httpx.post(url + "/abort_request", json={"rid": "long-one"}, headers=admin,
                          timeout=30).status_code == 200
        long_req.join(120)
    finally:
        _slow_down(url, admin, None)
    assert answer.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", answer
    assert len(answer["output_ids"]) < 400
    assert len(answer["output_ids"]) < 400
    # SGLang's OpenAI routes, which miles' sessions drive.
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": models["data"][0]["id"], "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text


def test_an_openai_session_on_live_sglang_records_what_sglang_generated(sglang_server, base_model_dir):
    """`miles sessions` in front of the live server, driven by the openai client for two turns: each model
    turn it recorded is what SGLang generates greedily from the tokens before it (TITO, no retokenizing)."""
    import openai

    from miles.rollout.sessions.server import start_session_server

    url = relaunched(sglang_server, base_model_dir, TOKEN)
    sessions = start_session_server(url, base_model_dir)
    try:
        sid = sessions.new_session().id
        client = openai.OpenAI(base_url=sessions.base_url(sid), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 12+30?"}]
        for follow_up in ("And 5+5?", None):
            r = client.chat.completions.create(model="miles", messages=messages, max_tokens=6, temperature=0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content}]
            if follow_up:
                messages += [{"role": "user", "content": follow_up}]
        traj = httpx.get(f"{sessions.url}/sessions/{sid}/trajectory", timeout=30).json()
    finally:
        sessions.stop()
    ids, mask, fed = traj["response_ids"], traj["loss_mask"], list(traj["prompt_ids"])
    turns = 0
    for i, (t, m) in enumerate(zip(ids, mask)):
        if m and (i == 0 or not mask[i - 1]):  # a model turn starts: SGLang's own greedy answer to `fed`
            run = ids[i:i + next((k for k, mk in enumerate(mask[i:]) if not mk), len(ids) - i)]
            assert _greedy(url, fed, n=len(run))["output_ids"] == run
            turns += 1
        fed.append(t)
    assert turns == 2 and len(traj["weight_versions"]) == 2


def _state(model_dir: str, seed: int | None) -> dict[str, torch.Tensor]:
    from miles.models.loading import load_model

    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name, t in load_model(model_dir).state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding in the tiny model
        out[name] = t.clone() if seed is None else t + 0.05 * torch.randn(t.shape, generator=g)
    return out


def _updater(model_dir: str, transport: str = "broadcast", **sync):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.sync.updater import WeightUpdater

    overrides = {"model.path": model_dir, "sync.transport": transport, "sync.bucket_size_mb": "1",
                 **{f"sync.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in sync.items()}}
    return WeightUpdater(load_config(RunConfig, None, overrides).sync, TOKEN, model_dir)


def _greedy(url: str, prompt: list[int], n: int = 6) -> dict:
    return httpx.post(url + "/generate", timeout=120, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": n}}).json()


def test_a_broadcast_push_into_live_sglang_is_verified_against_the_trainers_tensors(sglang_server, base_model_dir):
    from miles.models.loading import load_model
    from miles.sync.verify import VerificationError

    url = sglang_server.url
    updater = _updater(base_model_dir, verify_first_update=True, verify_checksums=True)
    updater.connect([url])
    try:
        assert updater.plain and updater.needs_start_check
        metrics = updater.check_start(iter(_state(base_model_dir, None).items()))
        assert metrics["sync/verified_tensors"] >= 30
        new = _state(base_model_dir, seed=3)
        metrics = updater.push(iter(new.items()), version=5)
        assert metrics["sync/verified_tensors"] >= 30
        assert httpx.get(url + "/get_model_info").json()["weight_version"] == "5"
        # SGLang now generates from the pushed weights: greedy ids of a transformers model holding them.
        model = load_model(base_model_dir).eval()
        model.load_state_dict(new, strict=False)
        model.tie_weights()
        prompt = [19, 20, 15, 21, 31, 27]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        got = _greedy(url, prompt)
        assert got["output_ids"] == ref[:len(got["output_ids"])] and got["meta_info"]["weight_version"] == "5"
        # A push that leaves one tensor out is named by the verification.
        partial = {n: t for n, t in _state(base_model_dir, seed=4).items() if n != "model.norm.weight"}
        with pytest.raises(VerificationError, match="model.norm.weight"):
            updater.push(iter(partial.items()), version=6)
    finally:
        updater.close()
        httpx.post(url + "/continue_generation", json={}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def test_a_disk_push_into_live_sglang_is_loaded_by_its_own_route_and_verified(sglang_server, base_model_dir,
                                                                                tmp_path):
    """sync.transport = "disk": each version a checkpoint directory, loaded by SGLang's
    /update_weights_from_disk, checked at the start and after the push against the trainer's tensors."""
    from miles.models.loading import load_model
    from miles.sync.verify import VerificationError

    url = relaunched(sglang_server, base_model_dir, TOKEN)
    updater = _updater(base_model_dir, "disk", disk_dir=tmp_path / "weights", verify_first_update=True,
                       verify_checksums=True)
    updater.connect([url])
    try:
        assert updater.plain and updater.needs_start_check
        assert updater.check_start(iter(_state(base_model_dir, None).items()))["sync/verified_tensors"] >= 30
        new = _state(base_model_dir, seed=7)
        assert updater.push(iter(new.items()), version=1)["sync/verified_tensors"] >= 30
        model = load_model(base_model_dir).eval()
        model.load_state_dict(new, strict=False)
        model.tie_weights()
        prompt = [5, 6, 7, 8]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        got = _greedy(url, prompt)
        assert got["output_ids"] == ref[:len(got["output_ids"])] and got["meta_info"]["weight_version"] == "1"
        # The checkpoint SGLang loaded is the one the trainer wrote: one that lacks a tensor is named.
        partial = {n: t for n, t in _state(base_model_dir, seed=8).items() if n != "model.norm.weight"}
        with pytest.raises(VerificationError, match="model.norm.weight"):
            updater.push(iter(partial.items()), version=2)
    finally:
        updater.close()
        relaunched(sglang_server, base_model_dir, TOKEN)


@pytest.mark.parametrize("transport,fix", [
    ("p2p", "sync.transport = 'broadcast'"), ("disk_delta", "sync.transport = 'broadcast'"),
    ("colocated", "sync.transport = 'broadcast'"), ("broadcast+nccl", "sync.backend = 'gloo'")])
def test_transports_live_sglang_cannot_take_on_the_cpu_are_refused_at_connect_naming_the_fix(
        sglang_server, base_model_dir, tmp_path, transport, fix):
    from miles.sync.transports.base import TransportError

    transport, _, backend = transport.partition("+")
    extra = {"delta_dir": tmp_path / "deltas"} if transport == "disk_delta" else {}
    updater = _updater(base_model_dir, transport, **extra, **({"backend": backend} if backend else {}))
    try:
        with pytest.raises(TransportError, match=re.escape(fix)):
            updater.connect([sglang_server.url])
    finally:
        updater.close()
    # The refusal left the server serving.
    assert _greedy(sglang_server.url, [1, 2, 3], n=2)["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.slow  # a second server start (the replacement): about as long as the GRPO run above
def test_an_sglang_server_killed_mid_run_is_replaced_and_nothing_is_lost_or_trained_twice(tiny_model_dir, tmp_path,
                                                                                          ray_cluster):
    from miles.orchestration.driver import run_train

    _sglang_python()
    summary = run_train(small_config(tiny_model_dir, tmp_path, **{
        "rollout.engine.kind": "sglang", "rollout.engine.memory_fraction": "0.05", "rollout.num_engines": "1",
        "loop.num_steps": "3", "eval.every_steps": "0", "fault.kill_engine_at_steps": "2",
        "health.interval_s": "0.5", "rollout.reward": "tests.e2e.test_async:text_parity_reward"}))
    assert summary["steps"] == 3
    assert (summary["faults"]["kills"], summary["faults"]["recovered"]) == (1, 1), summary["faults"]
    fleet = summary["fleet"]
    assert (fleet["replacements"], fleet["recovered"]) == (1, 1), fleet
    event = fleet["events"][0]
    assert event["new_url"] != event["old_url"] and event["pushed_at"] <= event["admitted_at"]
    ledger = summary["ledger"]
    assert ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"], ledger
    # Each prompt is trained at most once: the trainings counted equal the prompts in state "trained";
    # at least two steps' prompts were decided (a group whose rewards are all equal is discarded by the filter).
    assert ledger["events"]["trained"] == ledger["trained"], ledger
    assert ledger["trained"] + ledger["discarded"] >= 4 * 2 and ledger["trained"] >= 4, ledger
