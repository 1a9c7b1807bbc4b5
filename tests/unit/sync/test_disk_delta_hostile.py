"""Disk deltas a hostile or broken writer could leave: each is refused with HTTP 400 naming the problem,
nothing is read outside the version directory or from anything but a regular file, the engine keeps its
weights and version, and the next correct delta still applies (no wedged local copy)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from miles.sync.prepare import buckets
from miles.sync.transports.delta_format import load_base
from miles.sync.transports.disk_delta import DiskDeltaTransport

Q, K = "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"


@pytest.fixture
def delta(engine_thread, base_model_dir, admin_token, tmp_path):
    httpx.post(f"{engine_thread.url}/update_weight_version", json={"new_version": "default"}, timeout=60,
               headers={"Authorization": f"Bearer {admin_token}"}).raise_for_status()
    t = DiskDeltaTransport(delta_dir=str(tmp_path / "deltas"), base_path=base_model_dir, admin_token=admin_token,
                           local_dir=str(tmp_path / "local"))
    t.connect([engine_thread.url])
    yield t
    t.close()


@pytest.fixture
def post(engine_thread, admin_token):
    def _post(path: str, body: dict):
        return httpx.post(f"{engine_thread.url}{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {admin_token}"})
    return _post


def _written(delta, base_model_dir, version: int, seed: int) -> str:
    """Write (not apply) a delta changing every tensor; returns its version directory."""
    g = torch.Generator().manual_seed(seed)
    state = {n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in load_base(base_model_dir).items()}
    for b in buckets(iter(state.items()), 128 * 1024):
        delta.send_bucket(b)
    return delta.write(version)


def _edit_index(vdir: str, edit) -> None:
    path = os.path.join(vdir, "index.json")
    index = json.load(open(path))
    edit(index)
    json.dump(index, open(path, "w"))


def _stage(post, vdir):
    return post("/update_weights_from_disk", {"load_format": "miles_delta", "model_path": vdir, "commit": False})


def _unchanged_then_a_good_delta_applies(post, engine_thread, delta, base_model_dir, before):
    assert engine_thread.engine.weight_version == "default"
    assert torch.equal(engine_thread.engine.model.state_dict()[Q], before)
    assert len(engine_thread.engine.receiver._staging) == 0
    post("/update_weights_from_disk", {"reset_staging": True})
    delta._begin()
    vdir = _written(delta, base_model_dir, 5, seed=11)
    assert _stage(post, vdir).status_code == 200
    r = post("/update_weights_from_disk", {"load_format": "miles_delta", "commit": True, "weight_version": "5"})
    assert r.status_code == 200 and engine_thread.engine.weight_version == "5", r.text


def test_swapped_entries_of_equal_base_tensors_fail_the_bound_checksum(delta, post, engine_thread, base_model_dir):
    base = load_base(base_model_dir)
    assert torch.equal(base[Q], base[K])  # equal starting bytes: the XOR frames alone cannot tell them apart
    before = engine_thread.engine.model.state_dict()[Q].clone()
    vdir = _written(delta, base_model_dir, 1, seed=3)

    def swap(index):
        t = index["tensors"]
        t[Q], t[K] = t[K], t[Q]

    _edit_index(vdir, swap)
    r = _stage(post, vdir)
    assert r.status_code == 400 and "checksum mismatch" in r.json()["error"] and "_norm.weight" in r.json()["error"], r.text
    _unchanged_then_a_good_delta_applies(post, engine_thread, delta, base_model_dir, before)


def _set(field, value):
    return lambda index: index.__setitem__(field, value)


def _entry(field, value):
    def edit(index):
        index["tensors"][Q][field] = value
    return edit


def _drop(field):
    def edit(index):
        del index["tensors"][Q][field]
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_set("version", "abc"), "version must be a non-negative integer"),
    (_set("version", 1.5), "version must be a non-negative integer"),
    (_set("version", 0), "not newer"),
    (_set("base_version", None), "base_version must be"),
    (_set("tensors", []), "tensors must be a non-empty object"),
    (_set("tensors", {}), "tensors must be a non-empty object"),
    (_entry("offset", "0"), "field 'offset'"),
    (_entry("shape", ["4"]), "shape must be a list of non-negative integers"),
    (_entry("nbytes", 1 << 40), "nbytes"),
    (_entry("dtype", "no_such_dtype"), "unknown dtype"),
    (_drop("xxh3_128"), "exactly the fields"),
    (lambda index: index["tensors"].__setitem__(Q, "x"), "exactly the fields"),
], ids=["version-str", "version-float", "version-old", "base-null", "tensors-list", "tensors-empty",
        "offset-str", "shape-str", "nbytes-huge", "dtype", "entry-missing", "entry-str"])
def test_malformed_index_is_a_400_and_does_not_wedge_the_local_copy(edit, needle, delta, post, engine_thread,
                                                                    base_model_dir):
    before = engine_thread.engine.model.state_dict()[Q].clone()
    vdir = _written(delta, base_model_dir, 1, seed=4)
    _edit_index(vdir, edit)
    r = _stage(post, vdir)
    assert r.status_code == 400 and needle in r.json()["error"], r.text
    _unchanged_then_a_good_delta_applies(post, engine_thread, delta, base_model_dir, before)


def _absolute(vdir, shard):
    return "/etc/hostname"


def _climb(vdir, shard):
    os.makedirs(os.path.join(vdir, "sub"))
    return "../" + os.path.basename(vdir) + "/" + shard


def _symlink(vdir, shard):
    os.symlink(os.path.join(vdir, shard), os.path.join(vdir, "link.zst"))
    return "link.zst"


def _fifo(vdir, shard):
    os.mkfifo(os.path.join(vdir, "pipe.zst"))
    return "pipe.zst"


def _device(vdir, shard):
    os.symlink("/dev/zero", os.path.join(vdir, "zero.zst"))
    return "zero.zst"


def _directory(vdir, shard):
    os.makedirs(os.path.join(vdir, "dir.zst"))
    return "dir.zst"


@pytest.mark.parametrize("plant, needle", [
    (_absolute, "not a path"), (_climb, "not a path"), (_symlink, "symlink"), (_fifo, "not a regular file"),
    (_device, "symlink"), (_directory, "not a regular file")], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_shard_paths_stay_inside_the_version_directory_and_are_regular_files(plant, needle, delta, post,
                                                                              engine_thread, base_model_dir):
    before = engine_thread.engine.model.state_dict()[Q].clone()
    vdir = _written(delta, base_model_dir, 1, seed=5)
    shard = json.load(open(os.path.join(vdir, "index.json")))["tensors"][Q]["shard"]
    name = plant(vdir, shard)
    _edit_index(vdir, _entry("shard", name))
    r = _stage(post, vdir)  # returns at once: a FIFO is never opened for a blocking read
    assert r.status_code == 400 and needle in r.json()["error"] and "q_norm" in r.json()["error"], r.text
    _unchanged_then_a_good_delta_applies(post, engine_thread, delta, base_model_dir, before)


def test_init_delta_base_validates_before_it_copies_anything(post, tmp_path, base_model_dir, tiny_moe_model_dir):
    not_a_checkpoint = tmp_path / "src"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "secret.safetensors").write_text("not tensors")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    for src, needle in ((str(not_a_checkpoint), "not a safetensors checkpoint"), ("/etc/hostname", "safetensors"),
                        (str(fifo), "not a regular file"), (tiny_moe_model_dir, "does not fit the served model"),
                        ("/nonexistent", "neither")):
        local = tmp_path / f"local-{abs(hash(src))}"
        r = post("/init_delta_base", {"base_path": src, "local_dir": str(local)})
        assert r.status_code == 400 and needle in r.json()["error"], (src, r.text)
        assert not local.exists(), src  # nothing copied, not even the directory made
    r = post("/init_delta_base", {"base_path": base_model_dir, "local_dir": str(tmp_path / "ok")})
    assert r.status_code == 200 and os.listdir(tmp_path / "ok"), r.text
