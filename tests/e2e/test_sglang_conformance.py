"""miles speaks SGLang's protocol as SGLang's own source defines it (sglang==0.5.23, read with `ast`
by tests/helpers/sglang_protocol.py; nothing of SGLang is imported).

1. A real `miles train` run against a built-in engine in SGLang-only mode (no miles extension
   offered), through a recording proxy: every request miles sends goes to a route SGLang has, by a
   method SGLang serves, with only fields SGLang declares, each of the JSON type SGLang declares.
   The runs cover generation, evaluation, the broadcast and the full-disk weight sync with
   pause/continue around them, and SGLang's verification flow (weights_checker snapshot,
   reset_tensors, compare, checksum). In miles mode, every request that departs from SGLang's
   protocol is part of an extension the engine advertised (broadcast, p2p, disk_delta runs).
   The same checks run against a live SGLang server (sglang==0.5.23 on the CPU, launched as miles
   launches it, one per module: its start-up takes 40-140 s here), through the same proxy: there the
   run also proves SGLang takes what miles sends, including its stateful rules (each broadcast push
   inside /begin_weight_update ... /end_weight_update).
2. The built-in engine answers SGLang's request shapes with the status codes SGLang's handlers use,
   on success and on a failed update; the live server answers them with codes the same reading of its
   source allows.
3. A vision-language run sends its images as SGLang's `image_data` (one base64 string per image,
   one placeholder token per image in input_ids, which SGLang expands), and the engine's
   /v1/chat/completions takes image parts of the shape SGLang's OpenAI models declare.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.helpers import live_sglang as live_sglang_server
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.runs import small_config
from tests.helpers.sglang_protocol import fetch_wheel, matches, read_protocol

pytestmark = pytest.mark.e2e

TOKEN = "conformance-token"


@pytest.fixture(scope="module")
def sglang():
    return read_protocol(fetch_wheel())


@pytest.fixture(scope="module")
def live_sglang(tiny_model_dir):
    """One live SGLang server on the tiny model, shared by this module's live checks; each check puts it
    back to its launch state first (live_sglang.relaunched)."""
    server = live_sglang_server.launch(tiny_model_dir, TOKEN)
    yield server
    server.stop()


def _violations(proto, recorded, names=None) -> list[tuple[str, str | None, str]]:
    """(path, field or None for the route itself, what is wrong) for every departure from SGLang's protocol;
    with `names` (Protocol.names) type aliases and request models are followed."""
    bad = []
    for r in recorded:
        where = f"{r.method} {r.path}"
        route = proto.routes.get(r.path)
        if route is None:
            bad.append((r.path, None, f"{where}: SGLang has no such route"))
            continue
        if r.method not in route.methods:
            bad.append((r.path, None, f"{where}: SGLang serves it by {sorted(route.methods)}"))
        if r.body is None:
            continue
        if route.body_type is None:
            bad.append((r.path, None, f"{where}: SGLang's handler takes no JSON body, got {r.body!r}"))
            continue
        declared = proto.fields(r.path)
        for key, value in r.body.items():
            if key not in declared:
                bad.append((r.path, key, f"{where}: field {key!r} is not declared by {route.body_type}"))
            elif not matches(value, declared[key], names):
                bad.append((r.path, key, f"{where}: field {key!r} = {value!r:.200} is not of SGLang's type"))
        if r.path == "/generate":
            params = r.body.get("sampling_params") or {}
            for p in params if isinstance(params, list) else [params]:
                for key, value in p.items():
                    if key not in proto.sampling:
                        bad.append((r.path, f"sampling_params.{key}",
                                    f"{where}: sampling_params.{key} is not declared by SGLang's SamplingParams"))
                    elif not matches(value, proto.sampling[key]):
                        bad.append((r.path, f"sampling_params.{key}",
                                    f"{where}: sampling_params.{key} = {value!r} is not of SGLang's type"))
    return bad


@contextlib.contextmanager
def _built_in_engine(model_dir, sglang_only: bool, engine_args: tuple = ()):
    from miles.engine.process import EngineProcess

    flag = ["--sglang-only", "true" if sglang_only else "false", *engine_args]
    with EngineProcess(model_dir, admin_token=TOKEN, extra_args=flag) as engine:
        yield engine.url


def _train_through_proxy(model_dir, tmp_path, monkeypatch, sglang_only: bool, engine_args: tuple = (),
                         live=None, **overrides):
    """A short `miles train` on one engine the run did not start (a built-in engine of its own, or the
    `live` SGLang server), through a recording proxy; returns (what miles sent, the engine's
    /get_server_info, its weight version at the end)."""
    from miles.orchestration.driver import run_train

    engine = (contextlib.nullcontext(live_sglang_server.relaunched(live, model_dir, TOKEN)) if live is not None
              else _built_in_engine(model_dir, sglang_only, engine_args))
    with engine as url:
        proxy = RecordingProxy(url)
        try:
            monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", TOKEN)
            summary = run_train(small_config(model_dir, tmp_path, **{
                "loop.num_steps": "2", "eval.every_steps": "2", "rollout.engine_urls": proxy.url,
                "sync.verify_first_update": "true", "sync.verify_checksums": "true", **overrides}))
        finally:
            proxy.stop()
        assert summary["steps"] == 2
        info = httpx.get(url + "/get_server_info").json()
        version = httpx.get(url + "/get_model_info").json()["weight_version"]
    return proxy.requests, info, version


SYNC_PATHS = {
    "broadcast": {"/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
                  "/end_weight_update", "/update_weight_version", "/flush_cache"},
    "disk": {"/update_weights_from_disk"},
}
# SGLang's weights checker as the start check and the per-update check use it: snapshot / noise /
# compare on the built-in engine; on a live SGLang on the CPU, whose `compare` needs CUDA, noise and
# checksums the trainer recomputes from what it sent (miles/sync/sglang_checksums.py).
CHECKER_ACTIONS = {"sglang-only": {"snapshot", "reset_tensors", "compare", "checksum"},
                   "live": {"reset_tensors", "checksum"}}


@pytest.mark.parametrize("engine,transport", [
    ("sglang-only", "broadcast"), ("live", "broadcast"),
    pytest.param("sglang-only", "disk", marks=pytest.mark.slow), pytest.param("live", "disk", marks=pytest.mark.slow)])
def test_a_train_run_on_sglang_only_engines_sends_only_sglang_requests(sglang, engine, transport, tiny_model_dir,
                                                                       tmp_path, ray_cluster, monkeypatch, request):
    live = request.getfixturevalue("live_sglang") if engine == "live" else None
    recorded, info, version = _train_through_proxy(tiny_model_dir, tmp_path, monkeypatch, sglang_only=True, live=live,
                                                   **{"sync.transport": transport, "sync.disk_dir": str(
                                                       tmp_path / "weights")} if transport == "disk" else {
                                                       "sync.transport": transport})
    assert "miles_extensions" not in info and version == "2"
    violations = [why for _, _, why in _violations(sglang, recorded)]
    assert not violations, "\n".join(violations[:20])
    # The run exercised what it claims: generation, the sync paused around, SGLang's checker.
    paths = {r.path for r in recorded}
    assert {"/health", "/get_server_info", "/generate", "/pause_generation", "/continue_generation",
            "/weights_checker"} | SYNC_PATHS[transport] <= paths, paths
    actions = {r.body["action"] for r in recorded if r.path == "/weights_checker"}
    assert actions == CHECKER_ACTIONS[engine]
    if transport == "broadcast":
        versions = [r.body["new_version"] for r in recorded if r.path == "/update_weight_version"]
    else:
        versions = [r.body["weight_version"] for r in recorded if r.path == "/update_weights_from_disk"]
    assert versions == ["0", "1", "2"]  # the start check's push of the starting weights, then each step


@pytest.mark.parametrize("transport", [pytest.param(t, marks=pytest.mark.slow)
                                       for t in ("broadcast", "p2p", "disk_delta", "broadcast+fp8")])
def test_in_miles_mode_every_departure_from_sglang_is_an_advertised_extension(sglang, transport, tiny_model_dir,
                                                                              tmp_path, ray_cluster, monkeypatch):
    from miles.engine_api.extensions import EXTENSION_SURFACE

    transport, _, served_format = transport.partition("+")
    extra = {"sync.delta_dir": str(tmp_path / "deltas")} if transport == "disk_delta" else {}
    # An engine serving a format gets its bytes and scales (the quantized_weights extension).
    engine_args = ("--quantization", served_format) if served_format else ()
    recorded, info, version = _train_through_proxy(tiny_model_dir, tmp_path, monkeypatch, sglang_only=False,
                                                   engine_args=engine_args, **{"sync.transport": transport, **extra})
    assert version == "2"
    advertised = set(info["miles_extensions"])
    assert bool(served_format) == ("quantized_weights" in advertised), advertised
    allowed_routes = {p for e in advertised for p, f in EXTENSION_SURFACE[e].items() if f is None}
    allowed_fields = {(p, k) for e in advertised for p, f in EXTENSION_SURFACE[e].items() if f for k in f}
    unexplained, used = [], set()
    for path, field, why in _violations(sglang, recorded):
        if field is None and path in allowed_routes or (path, field) in allowed_fields:
            used.add((path, field))
        else:
            unexplained.append(why)
    assert not unexplained, "\n".join(unexplained[:20])
    assert used, "a miles-mode run used no extension at all: the check above proves nothing"
    if served_format:  # and the quantized payloads did travel, under SGLang's fields
        names = [n for r in recorded if r.path == "/update_weights_from_distributed" for n in r.body["names"]]
        assert any(n.endswith(f"@{served_format}") for n in names), names[:10]


def test_the_built_in_engine_answers_sglang_requests_with_sglang_status_codes(sglang, base_model_dir, tmp_path):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=TOKEN, sglang_only=True))
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def call(path: str, body: dict | None = None, method: str = "POST") -> httpx.Response:
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
        codes = sglang.routes[path].status_codes or {200}
        assert r.status_code in codes, f"{path} answered {r.status_code}; SGLang's handler answers {codes}: {r.text}"
        return r

    try:
        ok = call("/update_weights_from_disk", {"model_path": base_model_dir, "weight_version": "3"})
        assert ok.status_code == 200 and ok.json()["success"] is True and isinstance(ok.json()["message"], str)
        failed = call("/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
        assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["message"]
        bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nobody"}
        outside = call("/update_weights_from_distributed", bucket)  # SGLang's rule: only inside a session
        assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"], outside.text
        assert call("/begin_weight_update", {}).status_code == 200
        failed = call("/update_weights_from_distributed", bucket)
        assert failed.status_code == 400 and failed.json()["success"] is False and "nobody" in failed.json()["message"]
        assert call("/end_weight_update", {}).status_code == 200
        assert call("/update_weight_version", {"new_version": "v9"}).json()["new_version"] == "v9"
        assert call("/get_model_info", method="GET").json()["weight_version"] == "v9"
        assert call("/weights_checker", {"action": "compare"}).status_code == 400  # no snapshot: refused
        assert call("/weights_checker", {"action": "snapshot"}).status_code == 200
        assert call("/weights_checker", {"action": "compare"}).json()["success"] is True
        checksum = call("/weights_checker", {"action": "checksum"}).json()
        assert isinstance(checksum["per_engine_checksum"], str) and checksum["ranks"][0]["checksums"]
        assert call("/pause_generation", {"mode": "retract"}).status_code == 200
        assert call("/flush_cache").status_code == 200
        assert call("/continue_generation", {}).status_code == 200
        assert call("/health", method="GET").status_code == 200
    finally:
        server.stop()


def test_live_sglang_answers_with_the_status_codes_read_from_its_source(sglang, live_sglang, tiny_model_dir,
                                                                       tmp_path):
    """The live server's answers to the requests miles sends, on success and on failure, carry codes the
    reading of SGLang's source allows, so the built-in engine's codes above are SGLang's in practice
    too; and the stateful rule that reading cannot see (a broadcast bucket only inside a weight-update
    session) holds as the broadcast transport assumes."""
    url = live_sglang_server.relaunched(live_sglang, tiny_model_dir, TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def call(path: str, body: dict | None = None, method: str = "POST") -> httpx.Response:
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=300)
        codes = sglang.routes[path].status_codes or {200}
        assert r.status_code in codes, f"{path} answered {r.status_code}; SGLang's handler answers {codes}: {r.text}"
        return r

    try:
        ok = call("/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "3"})
        assert ok.status_code == 200 and ok.json()["success"] is True and isinstance(ok.json()["message"], str)
        assert call("/get_model_info", method="GET").json()["weight_version"] == "3"
        failed = call("/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
        assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["message"]
        # A bucket outside a weight-update session is refused, naming the session it needs.
        outside = call("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                            "shapes": [[64]], "group_name": "nobody"})
        assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"], outside.text
        assert call("/begin_weight_update", {}).status_code == 200
        assert call("/end_weight_update", {}).status_code == 200
        assert call("/update_weight_version", {"new_version": "v9"}).status_code == 200
        assert call("/get_model_info", method="GET").json()["weight_version"] == "v9"
        checksum = call("/weights_checker", {"action": "checksum"}).json()
        assert checksum["success"] is True, checksum
        assert call("/pause_generation", {"mode": "retract"}).status_code == 200
        assert call("/flush_cache").status_code == 200
        assert call("/continue_generation", {}).status_code == 200
        assert call("/health", method="GET").status_code == 200
    finally:
        httpx.post(url + "/continue_generation", json={}, headers=headers, timeout=60)


def test_lora_adapter_sync_and_lora_routes_follow_sglangs_protocol(sglang, base_model_dir, tmp_path):
    """What lora.sync = "adapter" sends (two pushes, through a recording proxy) departs from SGLang's
    protocol only by advertised extensions; a /generate naming the adapter (lora_path) is SGLang's
    request; SGLang-only engines answer the LoRA routes with SGLang's status codes."""
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.engine_api.extensions import EXTENSION_SURFACE
    from miles.sync.adapter import AdapterSync
    from miles.trainer.lora import LoraConfig, adapter_tensors, apply_lora
    from miles.models.loading import load_model

    model = apply_lora(load_model(base_model_dir), LoraConfig(rank=2, target_modules="q_proj,v_proj"))
    named = lambda: adapter_tensors(model.state_dict().items())  # noqa: E731
    headers = {"Authorization": f"Bearer {TOKEN}"}
    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=TOKEN))
    proxy = RecordingProxy(server.url)
    sync = AdapterSync(LoraConfig(rank=2, target_modules="q_proj,v_proj", sync="adapter",
                                  adapter_dir=str(tmp_path / "adapters")), TOKEN, base_model_dir)
    try:
        sync.connect([proxy.url])
        sync.push(named(), 1)
        sync.push(named(), 2)
        name = f"policy-v2-{sync.token}"
        r = httpx.post(proxy.url + "/generate", json={"input_ids": [5, 6, 7], "lora_path": name,
                                                      "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "2"
        advertised = set(httpx.get(server.url + "/get_server_info").json()["miles_extensions"])
        assert "lora_default" in advertised
        allowed_routes = {p for e in advertised for p, f in EXTENSION_SURFACE[e].items() if f is None}
        unexplained = [why for path, field, why in _violations(sglang, proxy.requests)
                       if not (field is None and path in allowed_routes)]
        assert not unexplained, "\n".join(unexplained)
        paths = [r.path for r in proxy.requests]
        assert paths.count("/load_lora_adapter") == 2 and paths.count("/unload_lora_adapter") == 1
    finally:
        sync.close()
        proxy.stop()
        server.stop()

    plain = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=TOKEN, sglang_only=True))
    try:
        def call(path: str, body: dict) -> httpx.Response:
            r = httpx.post(plain.url + path, json=body, headers=headers, timeout=60)
            codes = sglang.routes[path].status_codes
            assert r.status_code in codes, f"{path} answered {r.status_code}; SGLang's handler answers {codes}"
            return r

        good = str(tmp_path / "adapters" / "v2")
        ok = call("/load_lora_adapter", {"lora_name": "a", "lora_path": good, "pinned": False})
        assert ok.status_code == 200 and ok.json()["success"] is True and ok.json()["loaded_adapters"] == {"a": good}
        failed = call("/load_lora_adapter", {"lora_name": "a", "lora_path": good})
        assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["error_message"]
        assert call("/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path)}).status_code == 400
        assert call("/unload_lora_adapter", {"lora_name": "a"}).json()["loaded_adapters"] == {}
        assert call("/unload_lora_adapter", {"lora_name": "a"}).status_code == 400
    finally:
        plain.stop()


def test_vision_language_requests_follow_sglangs_protocol(sglang, tiny_vl_model_dir, tmp_path, ray_cluster,
                                                          monkeypatch):
    import base64
    import json

    import datasets

    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from tests.helpers.images import png

    colours = ["red", "blue", "green", "white"] * 3
    rows = [{"data_source": "colours", "reward_model": {"style": "rule", "ground_truth": c},
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
             "images": [{"bytes": png(c), "path": None}]} for c in colours]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    recorded, _, _ = _train_through_proxy(tiny_vl_model_dir, tmp_path, monkeypatch, sglang_only=True, **{
        "rollout.task.name": "dataset", "rollout.task.data.layout": "verl", "buffer.filter": "none",
        "rollout.task.data.path": str(tmp_path / "train.parquet"), "rollout.task.data.eval_fraction": "0.2"})
    violations = [why for _, _, why in _violations(sglang, recorded, sglang.names)]
    assert not violations, "\n".join(violations[:20])
    with open(f"{tiny_vl_model_dir}/config.json") as f:
        image_token = json.load(f)["image_token_id"]
    sent = [r.body for r in recorded if r.path == "/generate" and r.body.get("image_data")]
    assert sent
    for body in sent:
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        images = body["image_data"] if batched else [body["image_data"]]
        for ids, imgs in zip(prompts, images):
            # One placeholder per image (SGLang's build_input_ids expands each), images as base64 PNGs.
            assert ids.count(image_token) == len(imgs) == 1
            assert base64.b64decode(imgs[0])[:8] == b"\x89PNG\r\n\x1a\n"

    server = start_server_thread(EngineConfig(model_path=tiny_vl_model_dir, sglang_only=True))
    try:
        url = "data:image/png;base64," + base64.b64encode(png("red")).decode()
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "Colour?"}]}],
                "max_tokens": 4, "temperature": 0}
        declared = sglang.names["ChatCompletionRequest"]
        assert all(k in declared and matches(v, declared[k], sglang.names) for k, v in body.items())
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
