"""The engine's weight endpoints: SGLang's full reload from disk, the weights checker, and refusals
that name the fix and leave the served weights alone."""

from __future__ import annotations

import httpx
import pytest
import torch


@pytest.fixture
def post(engine_thread, admin_token):
    def _post(path: str, body: dict, token: str | None = admin_token):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(f"{engine_thread.url}{path}", json=body, headers=headers, timeout=60)
    return _post


def test_reload_from_disk_and_checker_snapshot_compare(post, engine_thread, base_model_dir):
    from miles.models.loading import load_model

    # SGLang's verification flow: snapshot (opens the session), noise, reload, compare.
    assert post("/weights_checker", {"action": "snapshot"}).json()["success"]
    assert post("/weights_checker", {"action": "reset_tensors", "seed": 3}).json()["success"]
    assert engine_thread.engine.unservable is not None  # noise is never served
    noisy = post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"]
    r = post("/update_weights_from_disk", {"model_path": base_model_dir, "weight_version": "50"})
    assert r.status_code == 200 and r.json()["weight_version"] == "50", r.text
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 0  # SGLang's reply
    base = load_model(base_model_dir).state_dict()
    engine = engine_thread.engine.model.state_dict()
    assert all(torch.equal(engine[n], t) for n, t in base.items())
    assert post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"] != noisy
    same = post("/weights_checker", {"action": "compare"})  # every tensor is back to the snapshot
    assert same.status_code == 200 and same.json()["success"], same.text
    assert engine_thread.engine.unservable is None  # the compare vouched for the weights
    again = post("/weights_checker", {"action": "compare"})  # the snapshot is used up, as in SGLang
    assert again.status_code == 400 and "no snapshot" in again.json()["message"]


def test_weight_version_is_a_string_relabelled_by_update_weight_version(post, engine_thread):
    r = post("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3})
    assert r.status_code == 400 and "weight_version" in r.json()["error"], r.text
    r = post("/update_weight_version", {"new_version": "v7", "abort_all_requests": False})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Weight version updated to v7",
                                                 "new_version": "v7"}
    assert httpx.get(engine_thread.url + "/get_model_info").json()["weight_version"] == "v7"


def test_checker_checksum_in_sglang_form(post, base_model_dir):
    r = post("/weights_checker", {"action": "checksum"})
    body = r.json()
    assert r.status_code == 200 and body["success"] and isinstance(body["per_engine_checksum"], str)
    sums = body["ranks"][0]["checksums"]
    assert "model.norm.weight" in sums and all(isinstance(v, str) for v in sums.values())
    post("/weights_checker", {"action": "snapshot"})
    post("/weights_checker", {"action": "reset_tensors", "seed": 1})
    assert post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"] != body["per_engine_checksum"]
    post("/update_weights_from_disk", {"model_path": base_model_dir})
    assert post("/weights_checker", {"action": "compare"}).json()["success"]
    assert post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"] == body["per_engine_checksum"]


@pytest.mark.parametrize("path, body, needle", [
    ("/weights_checker", {"action": "shuffle"}, "snapshot, begin_session, reset_tensors, compare or checksum"),
    ("/update_weights_from_tensor", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                     "offsets": [0], "shm_path": "/etc/passwd"}, "/dev/shm"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "load_format 'shm'"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "safetensors"),
    ("/update_weights_from_disk", {"load_format": "miles_delta", "model_path": "/tmp/none"}, "/init_delta_base"),
    ("/p2p_open_buffer", {"nbytes": -1}, "positive integer"),
], ids=["action", "shm-path", "pickles", "no-checkpoint", "no-base", "nbytes"])
def test_bad_requests_are_refused_and_weights_stay(post, engine_thread, path, body, needle):
    before = engine_thread.engine.weight_version
    norm = engine_thread.engine.model.state_dict()["model.norm.weight"].clone()
    r = post(path, body)
    assert r.status_code == 400 and needle in r.json()["error"], r.text
    assert engine_thread.engine.weight_version == before
    assert torch.equal(engine_thread.engine.model.state_dict()["model.norm.weight"], norm)


def test_weight_endpoints_need_the_admin_token(post):
    r = post("/weights_checker", {"action": "reset_tensors"}, token="wrong")
    assert r.status_code == 401 and "Authorization" in r.text


def test_bucket_checksums_in_the_device_digest_equal_the_trainers(post, base_model_dir):
    """The device_digest extension: the engine answers sum64 bucket digests over its own tensors, equal to
    what a trainer computes over the same weights (computed where the tensors are, on a GPU or here)."""
    from miles.models.loading import load_model
    from miles.sync import verify

    state = load_model(base_model_dir).state_dict()
    buckets = [[["model.norm.weight", "float32"], ["model.embed_tokens.weight", "float32"]],
               [["model.layers.0.mlp.down_proj.weight", "bfloat16"]]]
    r = post("/weights_checker", {"action": "checksum", "buckets": buckets, "digest": "sum64"})
    assert r.status_code == 200, r.text
    want = [verify.bucket_checksum((state[n].to(getattr(torch, dt)) for n, dt in b), "sum64") for b in buckets]
    assert r.json()["checksums"] == want
    xxh3 = post("/weights_checker", {"action": "checksum", "buckets": buckets}).json()["checksums"]
    assert xxh3 != want and all(len(d) == 32 for d in want + xxh3)
    bad = post("/weights_checker", {"action": "checksum", "buckets": buckets, "digest": "md5"})
    assert bad.status_code == 400 and "digest" in bad.text
