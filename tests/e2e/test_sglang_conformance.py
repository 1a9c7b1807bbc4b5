"""miles speaks SGLang's protocol as SGLang's own source defines it (sglang==0.5.23, read with `ast`
by tests/helpers/sglang_protocol.py; nothing of SGLang is imported).

1. A real `miles train` run against built-in engines in SGLang-only mode (no miles extension
   offered), through a recording proxy: every request miles sends goes to a route SGLang has, by a
   method SGLang serves, with only fields SGLang declares, each of the JSON type SGLang declares.
   The run covers generation, evaluation, the broadcast weight sync with pause/continue around
   it, and SGLang's verification flow (weights_checker snapshot, reset_tensors, compare, checksum).
2. The built-in engine answers SGLang's request shapes with the status codes SGLang's handlers use,
   on success and on a failed update.
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.runs import small_config
from tests.helpers.sglang_protocol import fetch_wheel, matches, read_protocol

pytestmark = pytest.mark.e2e

TOKEN = "conformance-token"


@pytest.fixture(scope="module")
def sglang():
    return read_protocol(fetch_wheel())


def _violations(proto, recorded) -> list[str]:
    bad = []
    for r in recorded:
        where = f"{r.method} {r.path}"
        route = proto.routes.get(r.path)
        if route is None:
            bad.append(f"{where}: SGLang has no such route")
            continue
        if r.method not in route.methods:
            bad.append(f"{where}: SGLang serves it by {sorted(route.methods)}")
        if r.body is None:
            continue
        if route.body_type is None:
            bad.append(f"{where}: SGLang's handler takes no JSON body, got {r.body!r}")
            continue
        declared = proto.fields(r.path)
        for key, value in r.body.items():
            if key not in declared:
                bad.append(f"{where}: field {key!r} is not declared by {route.body_type}")
            elif not matches(value, declared[key]):
                bad.append(f"{where}: field {key!r} = {value!r} is not of SGLang's type")
        if r.path == "/generate":
            params = r.body.get("sampling_params") or {}
            for p in params if isinstance(params, list) else [params]:
                for key, value in p.items():
                    if key not in proto.sampling:
                        bad.append(f"{where}: sampling_params.{key} is not declared by SGLang's SamplingParams")
                    elif not matches(value, proto.sampling[key]):
                        bad.append(f"{where}: sampling_params.{key} = {value!r} is not of SGLang's type")
    return bad


def test_a_train_run_on_sglang_only_engines_sends_only_sglang_requests(sglang, tiny_model_dir, tmp_path,
                                                                       ray_cluster, monkeypatch):
    from miles.orchestration.driver import run_train
    from miles.rollout.engine.process import EngineProcess

    with EngineProcess(tiny_model_dir, admin_token=TOKEN, extra_args=["--sglang-only", "true"]) as engine:
        proxy = RecordingProxy(engine.url)
        try:
            monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", TOKEN)
            summary = run_train(small_config(tiny_model_dir, tmp_path, **{
                "loop.num_steps": "2", "eval.every_steps": "2", "rollout.engine_urls": proxy.url,
                "sync.transport": "broadcast", "sync.verify_first_update": "true", "sync.verify_checksums": "true"}))
        finally:
            proxy.stop()
        assert summary["steps"] == 2
        assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] == "2"
    recorded = proxy.requests
    violations = _violations(sglang, recorded)
    assert not violations, "\n".join(violations[:20])
    # The run exercised what it claims: generation, the broadcast sync paused around, SGLang's checker.
    paths = {r.path for r in recorded}
    assert {"/health", "/get_server_info", "/generate", "/init_weights_update_group", "/update_weights_from_distributed",
            "/update_weight_version", "/flush_cache", "/pause_generation", "/continue_generation",
            "/weights_checker"} <= paths, paths
    actions = {r.body["action"] for r in recorded if r.path == "/weights_checker"}
    assert actions == {"snapshot", "reset_tensors", "compare", "checksum"}
    versions = [r.body["new_version"] for r in recorded if r.path == "/update_weight_version"]
    assert versions == ["0", "1", "2"]  # the start check's push of the starting weights, then each step


def test_the_built_in_engine_answers_sglang_requests_with_sglang_status_codes(sglang, base_model_dir, tmp_path):
    from miles.rollout.engine.config import EngineConfig
    from miles.rollout.engine.server import start_server_thread

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
        failed = call("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                           "shapes": [[64]], "group_name": "nobody"})
        assert failed.status_code == 400 and failed.json()["success"] is False and "nobody" in failed.json()["message"]
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
