"""The broadcast transport's backend (sync.backend: auto, gloo, nccl; miles/sync/transports/broadcast_group.py).

On CPU (CI): auto picks gloo, and every way nccl cannot run is refused with the reason and the
setting that works, at config load, at connect, or by the engine. Where torch sees one GPU (`cuda`,
scripts/gpu-check.sh): buckets go from a buffer on the trainer's GPU into buffers on the engine's
(gloo carries them, as NCCL cannot join two ranks on one GPU), verified by the GPU checksum (sum64),
and nccl towards an engine on the trainer's own GPU is refused naming the colocated transport. With
two GPUs: a real NCCL push from this process's GPU into an engine process on the other GPU.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from miles.config import ConfigError
from miles.config.loader import load_config
from miles.run_config import RunConfig
from miles.sync.transports import TransportError
from miles.sync.transports.broadcast import BroadcastConfig, BroadcastTransport
from miles.sync.transports.broadcast_group import Member, choose, engine_member, engine_ranks

GPU0, GPU1 = "GPU-0000", "GPU-1111"
TRAINER = Member("the trainer", "cuda", GPU0)


@pytest.fixture(scope="module")
def cpu_engine(base_model_dir, admin_token):
    """An engine that computes on the CPU whatever the machine has."""
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=base_model_dir, admin_token=admin_token, device="cpu"))
    yield server
    server.stop()


def _state(model_dir: str, seed: int, device: str) -> dict[str, torch.Tensor]:
    from miles.models.loading import load_model

    model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # named_parameters: a tied LM head once, under the embedding's name
        return {n: (t + torch.randn(t.shape, generator=g) * 0.05).to(device) for n, t in model.named_parameters()}


# ---- the choice and its refusals (no GPU needed) ----------------------------------------------------


def test_auto_runs_on_nccl_only_when_the_trainer_and_every_engine_have_a_gpu_of_their_own():
    own = [Member("http://e1", "cuda", GPU1), Member("http://e2", "cuda", "GPU-2222")]
    assert choose("auto", TRAINER, own) == "nccl"
    assert choose("nccl", TRAINER, own) == "nccl"
    assert choose("gloo", TRAINER, own) == "gloo"  # asked for: never second-guessed
    assert choose("auto", Member("the trainer", "cpu"), own) == "gloo"
    assert choose("auto", TRAINER, [own[0], Member("http://e3", "cpu")]) == "gloo"
    assert choose("auto", TRAINER, [Member("http://e1", "cuda", GPU0)]) == "gloo"  # the trainer's own GPU
    # An SGLang server says it is on cuda but not which GPU: NCCL itself checks at the first broadcast.
    assert choose("auto", TRAINER, [engine_member("http://sglang", {"device": "cuda"})]) == "nccl"


@pytest.mark.parametrize("source, engines, says", [
    (Member("the trainer", "cpu"), [Member("http://e1", "cuda", GPU1)],
     "the trainer's source rank computes on cpu, and NCCL moves GPU memory only; set trainer.device = 'cuda', or "
     "sync.backend = 'gloo'"),
    (TRAINER, [Member("http://e1", "cpu")],
     "engine(s) ['http://e1'] are not on a GPU by their /get_server_info `device`"),
    (TRAINER, [Member("http://e1", "cuda", GPU1), Member("http://e2", "cpu")],  # mixed devices
     "engine(s) ['http://e2'] are not on a GPU"),
    (TRAINER, [Member("http://e1", "cuda", GPU0)],
     "the trainer and http://e1 compute on the same GPU (GPU-0000), and NCCL refuses two ranks of one group on "
     "one GPU; engines that share the trainer's GPU take weights over CUDA IPC with sync.transport = 'colocated'"),
    (TRAINER, [Member("http://e1", "cuda", GPU1), Member("http://e2", "cuda", GPU1)],
     "http://e1 and http://e2 compute on the same GPU"),
], ids=["trainer-on-cpu", "engine-on-cpu", "mixed-devices", "trainer-gpu-shared", "engine-gpu-shared"])
def test_nccl_that_cannot_run_is_refused_with_the_reason_and_the_fix(source, engines, says):
    with pytest.raises(TransportError) as err:
        choose("nccl", source, engines)
    assert str(err.value).startswith("sync.backend = 'nccl' cannot run: ")
    assert says in str(err.value)


def test_an_engines_server_info_says_where_it_computes():
    assert engine_member("u", {"device": "cuda:1", "gpu_uuid": GPU1}) == Member("u", "cuda", GPU1)
    assert engine_member("u", {"device": "cpu"}) == Member("u", "cpu", None)
    assert engine_member("u", {}) == Member("u", None, None)  # says nothing: not counted as a GPU
    with pytest.raises(TransportError, match="choose auto"):
        choose("mpi", TRAINER, [])


def test_an_sglang_server_with_tensor_parallelism_holds_one_rank_per_tp_rank():
    # rank 0 is the trainer; SGLang joins as rank_offset + tp_rank, the built-in engine says no tp_size.
    assert engine_ranks([{"tp_size": 2}, {}, {"tp_size": 4}]) == ([1, 3, 4], 8)
    assert engine_ranks([{}, {}]) == ([1, 2], 3)


def test_nccl_groups_are_built_to_fail_a_late_push_rather_than_end_the_process(monkeypatch):
    from miles.sync.transports import broadcast_group

    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's own choice stands
    with broadcast_group._env(broadcast_group.NCCL_ON_TIMEOUT):
        assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ  # only while the group is built


def test_nccls_own_duplicate_gpu_error_is_explained_with_the_transport_to_use():
    from miles.sync.transports.broadcast_group import explained

    with pytest.raises(RuntimeError, match="Duplicate GPU detected.*sync.transport = 'colocated'"):
        with explained("nccl"):
            raise RuntimeError("NCCL error: invalid usage, NCCL version 2.27: Duplicate GPU detected : rank 1 and "
                               "rank 0 both on CUDA device 1a000")
    with pytest.raises(ValueError, match="^other$"), explained("nccl"):
        raise ValueError("other")


def test_the_config_refuses_nccl_beside_a_cpu_trainer_or_engine_and_an_unknown_backend(tiny_model_dir):
    def load(**overrides):
        return load_config(RunConfig, None, {"model.path": tiny_model_dir, **overrides})

    assert isinstance(load().sync, BroadcastConfig) and load().sync.backend == "auto"
    with pytest.raises(ConfigError, match="sync.backend = 'nccl' moves GPU memory only, but trainer.device = 'cpu'"):
        load(**{"sync.backend": "nccl", "trainer.device": "cpu"})
    with pytest.raises(ConfigError, match="but rollout.engine.device = 'cpu': set them to 'cuda'"):
        load(**{"sync.backend": "nccl", "rollout.engine.device": "cpu"})
    with pytest.raises(ConfigError, match="sync.backend = 'carrier'"):
        load(**{"sync.backend": "carrier"})
    # Devices left to auto: the connect decides, once it knows where everything runs.
    assert load(**{"sync.backend": "nccl"}).sync.backend == "nccl"


# ---- against real engines ------------------------------------------------------------------------


def _push_verified(transport, urls: list[str], state: dict, admin_token: str, base_model_dir: str) -> dict:
    """Two versions through the updater (noise fill + per-tensor check, then bucket checksums)."""
    from miles.sync.updater import WeightUpdater

    updater = WeightUpdater(BroadcastConfig(bucket_size_mb=1, retries=0), admin_token, base_model_dir)
    updater.transport = transport
    updater.connect(urls)
    try:
        first = updater.push(iter(state.items()), version=1)
        second = updater.push(iter({n: t * 0.5 for n, t in state.items()}.items()), version=2)
    finally:
        updater.close()
    return {"first": first, "second": second, "device_tensors": updater.takes_device_tensors}


def test_on_cpu_auto_runs_on_gloo_from_host_memory_verified(cpu_engine, base_model_dir, admin_token):
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60, backend="auto", device="cpu")
    state = _state(base_model_dir, seed=1, device="cpu")
    out = _push_verified(transport, [cpu_engine.url], state, admin_token, base_model_dir)
    assert transport.group_backend == "gloo" and not out["device_tensors"]
    assert out["first"]["sync/verified_tensors"] == len(state)
    assert out["second"]["sync/verified_buckets"] == out["second"]["sync/buckets"] >= 2
    held = cpu_engine.engine.model.state_dict()
    assert all(torch.equal(held[n], t * 0.5) for n, t in state.items())


def test_the_senders_group_is_keyed_as_sglangs_so_a_member_built_by_sglangs_helper_receives():
    """The other half of the key layout (the built-in engine receiving from a trainer that builds its
    group with the same helper) is tests/unit/engine/test_weight_receiver.py's RawTrainer."""
    import datetime
    import threading

    import torch.distributed as dist

    from miles.sync.transports import broadcast_group
    from tests.helpers.sglang_group import join_as_sglang

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
    got = {}

    def sglang_engine():
        pg = join_as_sglang("127.0.0.1", store.port, 1, 2, "sglang_keyed_group")
        got["t"] = torch.zeros(6)
        dist.broadcast(got["t"], src=0, group=pg)

    engine = threading.Thread(target=sglang_engine, daemon=True)
    engine.start()
    pg = broadcast_group.build(store, "sglang_keyed_group", 0, 2, "gloo", timeout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([torch.arange(6.0)], opts).wait()
    engine.join(60)
    assert torch.equal(got["t"], torch.arange(6.0))


def test_a_cpu_trainer_asking_for_nccl_is_refused_before_any_engine_joins(cpu_engine, admin_token):
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60, backend="nccl", device="cpu")
    with pytest.raises(TransportError, match="the trainer's source rank computes on cpu.*set trainer.device = 'cuda'"):
        transport.connect([cpu_engine.url])
    with pytest.raises(TransportError, match="not connected"):
        transport.send_bucket([("model.norm.weight", torch.ones(4))])
    transport.close()


@pytest.mark.parametrize("backend, says", [
    ("nccl", "backend: 'nccl' moves GPU memory only, and this engine computes on cpu; send backend 'gloo'"),
    ("mpi", "backend: 'mpi' is not served; use 'gloo' (any device) or 'nccl' (GPUs)"),
])
def test_a_cpu_engine_refuses_a_group_it_cannot_join_naming_the_backend_that_works(cpu_engine, admin_token,
                                                                                   backend, says):
    r = httpx.post(f"{cpu_engine.url}/init_weights_update_group", timeout=30,
                   headers={"Authorization": f"Bearer {admin_token}"},
                   json={"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                         "group_name": "weight_update_group", "backend": backend})
    assert r.status_code == 400 and says in r.json()["message"], r.text


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_one_gpu_buckets_go_from_a_device_buffer_into_the_engines_device_verified_on_the_gpu(
        engine_thread, base_model_dir, admin_token):
    engine = engine_thread.engine
    assert engine.runner.device.type == "cuda", "engine_thread computes on the GPU where torch sees one"
    # NCCL cannot join two ranks on this one GPU: refused, naming what to use.
    nccl = BroadcastTransport(admin_token=admin_token, timeout_s=60, backend="nccl")
    with pytest.raises(TransportError, match="compute on the same GPU.*sync.transport = 'colocated'"):
        nccl.connect([engine_thread.url])
    nccl.close()
    auto = BroadcastTransport(admin_token=admin_token, timeout_s=60, backend="auto")
    auto.connect([engine_thread.url])
    assert auto.group_backend == "gloo" and not auto.takes_device_tensors  # host memory, as on CPU
    auto.close()

    # gloo carrying GPU tensors: the sender's device buffer path and the engine's device receive.
    state = _state(base_model_dir, seed=5, device="cuda")
    transport = BroadcastTransport(admin_token=admin_token, timeout_s=60, backend="gloo", device="cuda")
    out = _push_verified(transport, [engine_thread.url], state, admin_token, base_model_dir)
    assert out["device_tensors"] and transport.device.type == "cuda"
    assert out["first"]["sync/verified_tensors"] == len(state)
    assert out["second"]["sync/verified_buckets"] == out["second"]["sync/buckets"] >= 2
    held = engine.model.state_dict()
    for n, t in state.items():
        assert held[n].device.type == "cuda" and torch.equal(held[n], t * 0.5), n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_two_gpus_a_real_nccl_push_from_the_trainers_gpu_into_an_engine_on_another(base_model_dir, admin_token):
    from miles.engine.process import EngineProcess

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}  # the engine's own GPU; this process sends from GPU 0
    torch.cuda.set_device(0)
    with EngineProcess(base_model_dir, admin_token=admin_token, env=env) as proc:
        transport = BroadcastTransport(admin_token=admin_token, timeout_s=120, backend="auto")
        state = _state(base_model_dir, seed=6, device="cuda:0")
        out = _push_verified(transport, [proc.url], state, admin_token, base_model_dir)
        assert transport.group_backend == "nccl" and out["device_tensors"]
        assert out["first"]["sync/verified_tensors"] == len(state)
        assert out["second"]["sync/verified_buckets"] == out["second"]["sync/buckets"] >= 2
        info = httpx.get(f"{proc.url}/get_model_info", timeout=30).json()
        assert info["weight_version"] == "2"
