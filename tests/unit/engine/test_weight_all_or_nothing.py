"""Every weight operation is all or nothing: a refused update leaves nothing staged for a later commit,
the version moves only with a commit of staged weights and only forward, and the weights checker's
noise fill is allowed only inside a verification session, during which the engine serves nothing."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from miles.sync import shm
from miles.sync.transports.delta_format import load_base
from miles.sync.verify import dtype_name, tensor_checksum, unique_tensors

NORM = "model.norm.weight"


@pytest.fixture
def post(engine_thread, admin_token):
    def _post(path: str, body: dict):
        return httpx.post(f"{engine_thread.url}{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {admin_token}"})
    return _post


@pytest.fixture(scope="module")
def other_checkpoint(base_model_dir, tmp_path_factory) -> str:
    """The base checkpoint with every tensor changed: applying it by mistake is visible everywhere."""
    d = tmp_path_factory.mktemp("other")
    save_file({n: (t + 1.0).contiguous() for n, t in load_base(base_model_dir).items()},
              str(d / "model.safetensors"))
    return str(d)


def _norm(engine_thread) -> torch.Tensor:
    return engine_thread.engine.model.state_dict()[NORM].clone()


def _at_version(post, engine_thread, base_model_dir, version: str) -> None:
    if engine_thread.engine.weight_version != version:
        post("/update_weight_version", {"new_version": version, "abort_all_requests": False})
    r = post("/update_weights_from_disk", {"model_path": base_model_dir})  # the base weights, label kept
    assert r.status_code == 200, r.text


def _staged(engine_thread) -> int:
    return len(engine_thread.engine.receiver._staging)


@pytest.mark.parametrize("refusal", ["backwards", "commit-not-bool", "unknown-field", "number"])
def test_a_refused_update_leaves_nothing_a_later_empty_commit_could_apply(
        refusal, post, engine_thread, base_model_dir, other_checkpoint):
    _at_version(post, engine_thread, base_model_dir, "100")
    before = _norm(engine_thread)
    body = {"model_path": other_checkpoint, "weight_version": {
        "backwards": "5", "number": 200}.get(refusal, "200")}
    if refusal == "commit-not-bool":
        body["commit"] = "x"
    if refusal == "unknown-field":
        body["comit"] = True
    r = post("/update_weights_from_disk", body)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert _staged(engine_thread) == 0
    # A later commit with nothing staged is refused and changes nothing, whatever version it names.
    for version in ("101", "99"):
        empty = post("/update_weights_from_disk", {"load_format": "miles_delta", "commit": True,
                                                    "weight_version": version})
        assert empty.status_code == 400 and "nothing is staged" in empty.json()["error"], empty.text
    assert engine_thread.engine.weight_version == "100"
    assert torch.equal(_norm(engine_thread), before)


@contextlib.contextmanager
def _norm_bucket(values: torch.Tensor):
    """A shared-memory bucket holding `values` as the final norm's weight: the /update_weights_from_tensor
    fields that describe it."""
    path, buf = shm.create(values.numel() * 4)
    try:
        buf.copy_(values.reshape(-1).view(torch.uint8))
        yield {"load_format": "shm", "shm_path": path, "names": [NORM], "dtypes": ["float32"],
               "shapes": [list(values.shape)], "offsets": [0]}
    finally:
        shm.unlink(path)


def test_a_refused_bucket_poisons_its_version_and_a_late_commit_changes_nothing(post, engine_thread, base_model_dir):
    _at_version(post, engine_thread, base_model_dir, "300")
    before = _norm(engine_thread)
    with _norm_bucket(before + 5) as bucket:
        ok = post("/update_weights_from_tensor", {**bucket, "commit": False, "reset_staging": True})
        assert ok.status_code == 200 and _staged(engine_thread) == 1, ok.text
        # The next bucket of the version is refused (a field it does not know): the version is dead.
        bad = post("/update_weights_from_tensor", {**bucket, "commit": False, "bogus": 1})
        assert bad.status_code == 400 and "bogus" in bad.json()["error"], bad.text
        late = post("/update_weights_from_tensor", {"load_format": "shm", "commit": True, "weight_version": "301"})
        assert late.status_code == 400 and "earlier bucket" in late.json()["error"], late.text
        # A bucket whose commit flag is garbage stages nothing either.
        garbage = post("/update_weights_from_tensor", {**bucket, "commit": "x", "reset_staging": True})
        assert garbage.status_code == 400 and _staged(engine_thread) == 0, garbage.text
    assert engine_thread.engine.weight_version == "300"
    assert torch.equal(_norm(engine_thread), before)


def test_a_bucket_after_a_refused_one_is_refused_naming_reset_staging_until_a_version_starts_again(
        post, engine_thread, base_model_dir):
    """Never a 200 ("staged") for a bucket of a version whose commit can no longer succeed: the engine cannot
    tell a new version's first bucket from the dead one's next, so it refuses until reset_staging says so."""
    _at_version(post, engine_thread, base_model_dir, "350")
    before = _norm(engine_thread)
    with _norm_bucket(before + 5) as bucket:
        assert post("/update_weights_from_tensor", {**bucket, "commit": False, "reset_staging": True}).status_code == 200
        bad = post("/update_weights_from_tensor", {**bucket, "commit": False, "bogus": 1})
        assert bad.status_code == 400, bad.text
        for _ in range(2):  # and again: the refusal names the first reason, not itself
            nxt = post("/update_weights_from_tensor", {**bucket, "commit": False})
            err = nxt.json()["error"]
            assert nxt.status_code == 400 and "reset_staging" in err and "bogus" in err, nxt.text
            assert _staged(engine_thread) == 0
        # A new version's first bucket that says so is staged and commits.
        first = post("/update_weights_from_tensor", {**bucket, "commit": False, "reset_staging": True})
        assert first.status_code == 200 and _staged(engine_thread) == 1, first.text
        done = post("/update_weights_from_tensor", {"load_format": "shm", "commit": True, "weight_version": "351"})
        assert done.status_code == 200 and done.json()["weight_version"] == "351", done.text
        assert torch.equal(_norm(engine_thread), before + 5)
        # A whole version in one request (SGLang's form: it commits what it carries) after a refused bucket
        # is refused too, and like a refused commit it clears the dead version: the next one goes through.
        assert post("/update_weights_from_tensor", {**bucket, "commit": False, "bogus": 1}).status_code == 400
        whole = {**bucket, "commit": True, "weight_version": "352"}
        r = post("/update_weights_from_tensor", whole)
        assert r.status_code == 400 and "reset_staging" in r.json()["error"], r.text
        assert engine_thread.engine.weight_version == "351"
        r = post("/update_weights_from_tensor", whole)
        assert r.status_code == 200 and r.json()["weight_version"] == "352", r.text


def test_versions_never_move_backwards_and_only_with_a_commit(post, engine_thread, base_model_dir):
    _at_version(post, engine_thread, base_model_dir, "400")
    r = post("/update_weights_from_disk", {"model_path": base_model_dir, "weight_version": "401"})
    assert r.status_code == 200 and r.json()["weight_version"] == "401", r.text
    for label in ("400", "9", "default", "v9"):  # backwards, or away from the numbering
        r = post("/update_weights_from_disk", {"model_path": base_model_dir, "weight_version": label})
        assert r.status_code == 400 and "older than the version in force" in r.json()["error"], r.text
    assert engine_thread.engine.weight_version == "401"
    # The same version again is a retried push (after a failed verification), not a step back.
    r = post("/update_weights_from_disk", {"model_path": base_model_dir, "weight_version": "401"})
    assert r.status_code == 200 and engine_thread.engine.weight_version == "401", r.text


def test_reset_tensors_only_inside_a_session_and_the_engine_serves_nothing_until_it_ends(
        post, engine_thread, base_model_dir):
    _at_version(post, engine_thread, base_model_dir, "500")
    before = _norm(engine_thread)
    r = post("/weights_checker", {"action": "reset_tensors"})
    assert r.status_code == 400 and "verification session" in r.json()["error"], r.text
    assert torch.equal(_norm(engine_thread), before) and engine_thread.engine.unservable is None

    assert post("/weights_checker", {"action": "snapshot"}).status_code == 200
    assert post("/weights_checker", {"action": "reset_tensors", "seed": 7}).status_code == 200
    # A request arriving now is held, not answered from noise; /health_generate says why.
    result = {}

    def generate():
        result["r"] = httpx.post(f"{engine_thread.url}/generate", timeout=60, json={
            "input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 2}})

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and "r" not in result  # held while the weights are noise
    assert httpx.get(f"{engine_thread.url}/health_generate", timeout=10).status_code == 503
    # The session ends with the compare after the weights are pushed back: generation resumes.
    assert post("/update_weights_from_disk", {"model_path": base_model_dir}).status_code == 200
    assert post("/weights_checker", {"action": "compare"}).json()["success"]
    t.join(30)
    assert result["r"].status_code == 200 and result["r"].json()["meta_info"]["weight_version"] == "500"
    # Outside a session again: the next noise fill is refused.
    assert post("/weights_checker", {"action": "reset_tensors"}).status_code == 400


def test_a_snapshot_of_noise_cannot_vouch_for_the_weights(post, engine_thread, base_model_dir):
    _at_version(post, engine_thread, base_model_dir, "600")
    assert post("/weights_checker", {"action": "begin_session"}).status_code == 200
    assert post("/weights_checker", {"action": "reset_tensors", "seed": 1}).status_code == 200
    assert post("/weights_checker", {"action": "snapshot"}).status_code == 200  # taken of the noise
    assert post("/weights_checker", {"action": "compare"}).json()["success"]
    assert engine_thread.engine.unservable is not None  # still noise: still held
    # A session whose compare finds the pushed weights right ends the hold.
    assert post("/weights_checker", {"action": "snapshot"}).status_code == 200
    _at_version(post, engine_thread, base_model_dir, "600")
    assert post("/weights_checker", {"action": "compare"}).status_code == 400  # differs from the noise
    base = load_base(base_model_dir)
    expected = {n: [dtype_name(base[n]), tensor_checksum(base[n])]
                for n in unique_tensors(engine_thread.engine.model)}
    assert post("/weights_checker", {"action": "begin_session"}).status_code == 200
    assert post("/weights_checker", {"action": "compare", "expected": expected}).json()["success"]
    assert engine_thread.engine.unservable is None
