"""BroadcastTransport pushes a trainer's weights into running engines over a stand-alone gloo group.

The test process plays the trainer: it holds its own default process group (as FSDP would), perturbs
a copy of the model, and pushes it in small buckets; afterwards the engines must generate exactly as
the perturbed model does.
"""

from __future__ import annotations


import httpx
import pytest
import torch
import torch.distributed as dist

from miles.net import free_port
from miles.sync.transports import TRANSPORTS, TransportError, get_transport
from miles.sync.transports.broadcast import BroadcastTransport
from miles.versions import from_wire

PROMPTS = ["47+38=", "The trainer computes", "999+1="]
N_NEW = 16


@pytest.fixture(scope="module")
def default_group():
    """The 'trainer' owns a default group; the transport must neither need nor disturb it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer(base_model_dir):
    from miles.models.loading import load_tokenizer

    return load_tokenizer(base_model_dir)


def _perturbed_model(model_dir: str, seed: int):
    from miles.models.loading import load_model

    model = load_model(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        # Norm weights travel as bfloat16 below; make them exactly representable so the reference
        # model and the upcast engine copy agree bit for bit.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p.to(torch.bfloat16).float())
    return model


def _buckets(model, max_bytes: int = 256 * 1024) -> list[list[tuple[str, torch.Tensor]]]:
    """Small fixed-size buckets of (HF name, tensor), with norms in bf16 to mix dtypes in one buffer."""
    buckets, cur, size = [], [], 0
    for name, t in model.state_dict().items():
        t = t.to(torch.bfloat16) if "norm" in name else t
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    return buckets + [cur]


def _generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": ids, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}})
    assert r.status_code == 200, r.text
    return r.json()


def _reference(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N_NEW)[0, len(ids):].tolist()
        eos = model.config.eos_token_id
        out = out[: out.index(eos) + 1] if eos in out else out
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1: -1].float()
    return out, torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None]).squeeze(1)


def _version(url: str) -> int:
    """The engine's weight version: a string on the wire (SGLang's type), read back as the step."""
    v = httpx.get(f"{url}/get_model_info").json()["weight_version"]
    assert isinstance(v, str), v
    return from_wire(v)


def test_registry_names_the_choices():
    assert TRANSPORTS.get("broadcast") is BroadcastTransport
    assert isinstance(get_transport("broadcast"), BroadcastTransport)
    with pytest.raises(ValueError, match="broadcast"):
        get_transport("carrier-pigeon")


def test_push_in_buckets_then_commit_switches_every_engine(default_group, engine_proc, engine_thread,
                                                            base_model_dir, tokenizer, admin_token):
    urls = [engine_proc.url, engine_thread.url]
    model = _perturbed_model(base_model_dir, seed=0)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [_reference(model, ids) for ids in prompts]
    before = [_generate(urls[0], ids)["output_ids"] for ids in prompts]
    assert before != [out for out, _ in expected], "the perturbation must change greedy outputs"

    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60)
    transport.connect(urls)
    try:
        buckets = _buckets(model)
        assert len(buckets) >= 4
        for bucket in buckets:
            transport.send_bucket(bucket)
        # Everything is staged, nothing applied: engines still serve the old weights.
        assert [_generate(urls[0], ids)["output_ids"] for ids in prompts] == before
        transport.commit(7)
    finally:
        transport.close()

    for url in urls:
        assert _version(url) == 7
        for ids, (out_ids, lps) in zip(prompts, expected):
            got = _generate(url, ids)
            assert got["output_ids"] == out_ids
            torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]),
                                       lps, atol=1e-5, rtol=0)
            assert got["meta_info"]["weight_version"] == "7"
    # The trainer's own default group was neither used nor disturbed.
    x = torch.ones(2)
    dist.all_reduce(x)
    assert dist.get_world_size() == 1 and x.tolist() == [1.0, 1.0]


def test_wrong_shape_is_refused_and_old_weights_stay(default_group, engine_proc, base_model_dir, tokenizer,
                                                     admin_token):
    url = engine_proc.url
    ids = tokenizer.encode(PROMPTS[0])
    version, before = _version(url), _generate(url, ids)
    model = _perturbed_model(base_model_dir, seed=1)
    sd = model.state_dict()
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60)
    transport.connect([url])
    try:
        transport.send_bucket([("model.norm.weight", sd["model.norm.weight"])])  # a good bucket first
        with pytest.raises(TransportError) as err:
            transport.send_bucket([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 5)),
                                   ("model.layers.0.mlp.down_proj.weight", sd["model.layers.0.mlp.down_proj.weight"])])
        assert url in str(err.value) and "model.layers.0.mlp.up_proj.weight" in str(err.value)
        assert "[3, 5]" in str(err.value)
        with pytest.raises(TransportError, match="not committing"):
            transport.commit(version + 1)
        after = _generate(url, ids)
        assert _version(url) == version
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

        # The collective stayed in step: the next version goes through on the same connection.
        for bucket in _buckets(model):
            transport.send_bucket(bucket)
        transport.commit(version + 2)
    finally:
        transport.close()
    assert _version(url) == version + 2
    out, _ = _reference(model, ids)
    assert _generate(url, ids)["output_ids"] == out


def test_unknown_tensor_name_is_refused(default_group, engine_proc, admin_token):
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60)
    transport.connect([engine_proc.url])
    try:
        with pytest.raises(TransportError, match="model.layers.99.mlp.up_proj.weight"):
            transport.send_bucket([("model.layers.99.mlp.up_proj.weight", torch.zeros(4))])
    finally:
        transport.close()


def test_wrong_admin_token_fails_fast_naming_the_engine(engine_proc):
    transport = BroadcastTransport(admin_token="wrong", timeout_s=20)
    with pytest.raises(TransportError, match="401") as err:
        transport.connect([engine_proc.url])
    assert engine_proc.url in str(err.value)
    with pytest.raises(TransportError, match="connect"):
        transport.send_bucket([("model.norm.weight", torch.ones(128))])
    transport.close()


@pytest.mark.parametrize("screens", ["sender", "engine"])
@pytest.mark.parametrize("where", ["small", "large"])
def test_non_finite_tensor_is_refused_by_name_in_either_message_kind(default_group, engine_thread, base_model_dir,
                                                                     admin_token, monkeypatch, where, screens):
    """Tensors are screened for NaN/Inf in the flat messages of small tensors and in the messages of
    large ones (the engine runs in this process, so a smaller split makes the tiny model's matrices
    'large'): by miles' sender as it sends them, or, for a sender that does not say `screened`, by
    the engine as they arrive."""
    import miles.sync.transports.broadcast_wire as bc
    from miles.sync import screen

    monkeypatch.setattr(bc, "SPLIT_BYTES", 4096)
    if screens == "engine":  # a sender that neither screens nor vouches
        def copy_unscreened(bufs, bucket, offsets, threads=1):
            for (_, t), o in zip(bucket, offsets):
                bufs[0][o:o + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
            return []

        monkeypatch.setattr(screen, "nonfinite", lambda bucket: [])
        monkeypatch.setattr(screen, "copy_screened", copy_unscreened)
        post = BroadcastTransport._post
        monkeypatch.setattr(BroadcastTransport, "_post", lambda self, url, path, body: post(
            self, url, path, {k: v for k, v in (body or {}).items() if k != "screened"}))
    url = engine_thread.url
    sd = _perturbed_model(base_model_dir, seed=2).state_dict()
    name = "model.norm.weight" if where == "small" else "model.layers.1.mlp.up_proj.weight"
    bad = sd[name].clone()
    bad.view(-1)[7] = float("inf")
    bucket = [(n, bad if n == name else sd[n]) for n in
              ("model.layers.0.mlp.up_proj.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight",
               "model.layers.1.input_layernorm.weight")]
    version = _version(url)
    before = engine_thread.engine.model.state_dict()[name].clone()
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60)
    transport.connect([url])
    try:
        with pytest.raises(TransportError, match="NaN or Inf") as err:
            transport.send_bucket(bucket)
        assert name in str(err.value)
        with pytest.raises(TransportError, match="not committing"):
            transport.commit(version + 1)
        assert _version(url) == version
        assert torch.equal(engine_thread.engine.model.state_dict()[name], before)
        # Still in step: the same bucket without the Inf goes through.
        transport.send_bucket([(n, sd[n]) for n, _ in bucket])
        transport.commit(version + 1)
    finally:
        transport.close()
    assert _version(url) == version + 1
    assert torch.equal(engine_thread.engine.model.state_dict()[name], sd[name])


def test_message_plan_flattens_small_tensors_into_aligned_groups_and_sends_large_ones_alone(monkeypatch):
    import miles.sync.transports.broadcast_wire as bc

    monkeypatch.setattr(bc, "SPLIT_BYTES", 100)
    sizes = [30, 6, 250, 40, 30, 0, 100, 2]
    messages, offsets, flat_bytes = bc.message_plan(sizes)
    # 30+6+40+30 reaches 100 after the fourth small tensor; 250 and 100 go alone, in bucket order.
    assert messages == [[2], [0, 1, 3, 4], [6], [5, 7]]
    assert offsets[2] == offsets[6] == -1
    flattened = [i for i, o in enumerate(offsets) if o >= 0]
    assert all(offsets[i] % 64 == 0 for i in flattened)
    ends = sorted((offsets[i], offsets[i] + sizes[i]) for i in flattened)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlap
    assert flat_bytes == max(e for _, e in ends)


def test_flattened_tensors_are_staged_as_views_and_the_next_version_reuses_their_buffer(
        default_group, engine_thread, base_model_dir, admin_token, monkeypatch):
    """No receive copies a flattened tensor out of its message, and in steady state a version is
    received into the memory the version before the last one left (no fresh pages per update)."""
    import miles.sync.transports.broadcast_wire as bc

    monkeypatch.setattr(bc, "SPLIT_BYTES", 1 << 16)
    name = "model.norm.weight"  # small: flattened
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60)
    transport.connect([engine_thread.url])
    storages = []
    try:
        for version in (1, 2, 3, 4):
            sd = _perturbed_model(base_model_dir, seed=version).state_dict()
            transport.send_bucket([(n, t) for n, t in sd.items() if n != "lm_head.weight"])
            transport.commit(version)
            held = engine_thread.engine.model.state_dict()
            assert torch.equal(held[name], sd[name])
            storages.append(held[name].untyped_storage())
    finally:
        transport.close()
    # Every flattened tensor of a version lives in one buffer, bigger than any one of them ...
    assert storages[0].nbytes() > 8 * held[name].numel() * held[name].element_size()
    # ... and two buffers alternate: version 3 arrived where version 1 lived, version 4 where 2 did.
    ptrs = [s.data_ptr() for s in storages]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]
