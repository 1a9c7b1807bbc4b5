"""The Megatron backend trains the same step as FSDP on the same batch: per-token logprobs within
1e-5 of FSDP's and of transformers', and after one optimizer step (lr 1e-3) exported weights within
1e-4 of FSDP's, at tensor parallel 2 with and without sequence parallelism, at pipeline parallel 2
(1F1B, and interleaved over two virtual stages) and at context parallel 2; tiny-qwen3-moe at EP 2, TP 2 × EP 2 and TP 2 with expert TP 2; routing
replay (R3) in its routers as FSDP replays, also with each sequence split over CP 2; checkpoints that
resume bit for bit at their layout and at TP 1 from TP 2. One spawned world of two gloo ranks runs
the dense cases, another the MoE ones (megatron-core's import and the model loads are most of the
cost)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config.loader import ConfigError, build, load_config
from miles.net import free_port
from miles.run_config import RunConfig
from miles.trainer.config import TrainerConfig
from miles.trainer.forward import forward_logprobs
from tests.unit.trainer.dist_worker import make_batch

WORKER = Path(__file__).with_name("megatron_worker.py")
ALGO = {"name": "dr_grpo", "kl_coef": 0.0}
SEED, N = 3, 6


@pytest.mark.parametrize("keys, refusal", [
    ({"num_ranks": 3, "tensor_parallel_size": 2},
     r"trainer.num_ranks \(3\) must be a multiple of tensor × pipeline × context parallel size \(2 × 1 × 1 = 2\)"),
    ({"num_ranks": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "context_parallel_size": 2},
     r"trainer.num_ranks \(4\) must be a multiple of .* \(2 × 2 × 2 = 8\)"),
    ({"num_ranks": 2, "pipeline_parallel_size": 2, "expert_parallel_size": 2},
     r"trainer.num_ranks / pipeline_parallel_size \(1\) must be a multiple of .*\(2\)"),
    ({"num_ranks": 2, "sequence_parallel": True}, r"set trainer.tensor_parallel_size > 1"),
    ({"num_ranks": 2, "tensor_parallel_size": 2, "lora": {"rank": 4}},
     r"'megatron' does not support LoRA .*set trainer.lora.rank = 0, or trainer.backend = 'fsdp'"),
    ({"algorithm": {"name": "ppo"}}, r"'megatron' does not support a value model .*trainer.backend = 'fsdp'"),
    ({"quantization": "fp8"}, r"'megatron' does not support quantization-aware training"),
    ({"pack_sequences": True}, r"'megatron' does not support packed micro-batches"),
])
def test_a_megatron_layout_it_cannot_run_is_refused_at_config_load(keys, refusal):
    with pytest.raises(ConfigError, match=refusal):
        build(TrainerConfig, {"backend": "megatron", **keys}).validate()


def test_megatron_only_sizes_are_refused_on_fsdp():
    with pytest.raises(ConfigError, match=r"trainer.pipeline_parallel_size needs trainer.backend = 'megatron'"):
        build(TrainerConfig, {"num_ranks": 2, "pipeline_parallel_size": 2}).validate()


@pytest.mark.parametrize("keys, refusal", [
    ({"trainer.num_ranks": 8, "trainer.tensor_parallel_size": 8},
     r"the model's num_attention_heads \(4\) does not divide over trainer.tensor_parallel_size \(8\)"),
    ({"trainer.num_ranks": 3, "trainer.pipeline_parallel_size": 3},
     r"the model's num_hidden_layers \(4\) does not divide over trainer.pipeline_parallel_size"),
    ({"trainer.num_ranks": 2, "trainer.expert_parallel_size": 2}, r"needs a MoE model"),
])
def test_a_layout_that_does_not_divide_the_model_is_refused_naming_both_numbers(tiny_model_dir, keys, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config(RunConfig, None, {"model.path": tiny_model_dir, "trainer.backend": "megatron", **keys})


@pytest.mark.parametrize("keys, refusal", [
    ({}, r"MoE model with trainer.tensor_parallel_size = 2 .*set trainer.sequence_parallel = true"),
    ({"trainer.sequence_parallel": True},
     r"expert_parallel_size = 1 and expert_tensor_parallel_size = 1 .*set trainer.expert_parallel_size > 1"),
])
def test_a_moe_layout_megatron_core_does_not_train_correctly_is_refused(tiny_moe_model_dir, keys, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config(RunConfig, None, {"model.path": tiny_moe_model_dir, "trainer.backend": "megatron",
                                      "trainer.num_ranks": 2, "trainer.tensor_parallel_size": 2, **keys})


DENSE_LAYOUTS = ["tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2"]


def run_world(tmp_path, cases: list[dict], world: int = 2) -> dict:
    out = tmp_path / "out.pt"
    spec = {"world": world, "port": free_port(), "seed": SEED, "n": N, "out": str(out), "cases": cases}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "spec.json")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def dense(tiny_model_dir, tmp_path_factory) -> dict:
    # Padded rows on every contender (Megatron packs none), so fsdp computes the same arithmetic.
    case = lambda name, **kw: {"name": name, "model": tiny_model_dir,
                               "trainer": {"algorithm": ALGO, "pack_sequences": False, **kw}}
    return run_world(tmp_path_factory.mktemp("megatron-dense"), [
        case("fsdp"),
        case("tp2", backend="megatron", tensor_parallel_size=2),
        case("tp2_sp", backend="megatron", tensor_parallel_size=2, sequence_parallel=True),
        case("pp2", backend="megatron", pipeline_parallel_size=2),  # 1F1B over two stages
        # the interleaved schedule: two model chunks (virtual stages) per stage, one layer each
        case("pp2_vpp2", backend="megatron", pipeline_parallel_size=2, virtual_pipeline_parallel_size=2),
        case("cp2", backend="megatron", context_parallel_size=2),  # each sequence split over both ranks
    ])


def transformers_logprobs(model_dir: str) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for s in make_batch(SEED, N):
        ids = torch.tensor([s.tokens])
        logp, _ = forward_logprobs(model, ids, torch.ones_like(ids))
        out.append(logp[0, s.prompt_len - 1:].tolist())
    return out


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y))


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_a_checkpoint_goes_through_megatrons_layout_and_back_bit_exact(dense, tiny_model_dir, layout):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    got = dense[layout]["initial"]
    assert got.keys() == dense["fsdp"]["initial"].keys()
    assert all(torch.equal(got[name], hf[name]) for name in got)


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_megatron_logprobs_match_fsdp_and_transformers(dense, tiny_model_dir, layout):
    want = transformers_logprobs(tiny_model_dir)
    assert max_gap(dense["fsdp"]["logprobs"], want) < 1e-5
    assert max_gap(dense[layout]["logprobs"], want) < 1e-5
    assert max_gap(dense[layout]["logprobs"], dense["fsdp"]["logprobs"]) < 1e-5


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_one_megatron_step_exports_the_weights_fsdp_steps_to(dense, layout):
    got, want = dense[layout], dense["fsdp"]
    assert got["weights"].keys() == want["weights"].keys()  # HF names, tied embedding once
    for name, w in want["weights"].items():
        assert got["weights"][name].shape == w.shape, name
        assert (got["weights"][name] - w).abs().max() < 1e-4, name
        assert not torch.equal(w, got["initial"][name]), name  # the step moved every weight
    assert got["metrics"]["train/loss"] == pytest.approx(want["metrics"]["train/loss"], abs=1e-6)
    assert got["metrics"]["train/loss_tokens"] == want["metrics"]["train/loss_tokens"]
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=1e-5)


MOE_LAYOUTS = ["ep2", "tp2_ep2", "tp2_etp2"]


@pytest.fixture(scope="module")
def moe(tiny_moe_model_dir, tmp_path_factory) -> dict:
    """tiny-qwen3-moe on the same two ranks: experts split over both (EP 2), attention split over both with
    each rank holding half the experts whole (TP 2 × EP 2, expert TP 1), and every expert's MLP split
    over both (TP 2, expert TP 2). megatron-core trains MoE with TP only under sequence parallelism.
    TP 2 × EP 2 with expert TP 2 would need four ranks, too many gloo processes for a 2-core CI machine."""
    case = lambda name, **kw: {"name": name, "model": tiny_moe_model_dir,
                               "trainer": {"algorithm": ALGO, "pack_sequences": False, **kw}}
    return run_world(tmp_path_factory.mktemp("megatron-moe"), [
        case("fsdp"),
        case("ep2", backend="megatron", expert_parallel_size=2),
        case("tp2_ep2", backend="megatron", tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True),
        case("tp2_etp2", backend="megatron", tensor_parallel_size=2, expert_tensor_parallel_size=2,
             sequence_parallel=True),
        # R3: every token carries recorded experts (drawn at random, so replay changes the forward).
        {**case("fsdp_r3", routing_replay=True), "routes": True},
        {**case("ep2_r3", backend="megatron", expert_parallel_size=2, routing_replay=True), "routes": True},
        {**case("tp2_ep2_r3", backend="megatron", tensor_parallel_size=2, expert_parallel_size=2,
                sequence_parallel=True, routing_replay=True), "routes": True},
        {**case("cp2_ep2_r3", backend="megatron", context_parallel_size=2, expert_parallel_size=2,
                routing_replay=True), "routes": True},
        # Checkpoints: a step, a save, a step; a new trainer loads the save and takes the step again.
        {**case("resume", backend="megatron", tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True,
                lr_schedule="linear", lr_warmup_steps=1, lr_decay_steps=4), "resume": {}},
        {**case("tp2_to_tp1", backend="megatron", tensor_parallel_size=2, expert_parallel_size=2,
                sequence_parallel=True), "resume": {"tensor_parallel_size": 1, "sequence_parallel": False}},
    ])


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_a_moe_checkpoint_goes_through_megatrons_layout_and_back_bit_exact(moe, tiny_moe_model_dir, layout):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).state_dict()
    got = moe[layout]["initial"]
    assert got.keys() == moe["fsdp"]["initial"].keys()  # HF names, the tied embedding once
    assert all(torch.equal(got[name], hf[name]) for name in got)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_megatron_moe_logprobs_match_fsdp_and_transformers(moe, tiny_moe_model_dir, layout):
    want = transformers_logprobs(tiny_moe_model_dir)
    assert max_gap(moe["fsdp"]["logprobs"], want) < 1e-5
    assert max_gap(moe[layout]["logprobs"], want) < 1e-5
    assert max_gap(moe[layout]["logprobs"], moe["fsdp"]["logprobs"]) < 1e-5


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_one_megatron_moe_step_exports_the_weights_fsdp_steps_to(moe, layout):
    got, want = moe[layout], moe["fsdp"]
    assert got["weights"].keys() == want["weights"].keys()
    for name, w in want["weights"].items():
        assert (got["weights"][name] - w).abs().max() < 1e-4, name
    moved = [n for n, w in want["weights"].items() if not torch.equal(w, got["initial"][n])]
    assert len(moved) == len(want["weights"]), set(want["weights"]) - set(moved)
    assert got["metrics"]["train/loss"] == pytest.approx(want["metrics"]["train/loss"], abs=1e-6)
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("layout", ["ep2_r3", "tp2_ep2_r3", "cp2_ep2_r3"])
def test_megatron_routers_replay_the_recorded_experts_as_fsdp_does(moe, layout):
    """The recorded experts replace Megatron's top-k choice in every MoE layer, weighted as Qwen3-MoE's
    router weighs them: the same logprobs, mismatch rate and one-step weights as FSDP's replay."""
    got, want, free = moe[layout], moe["fsdp_r3"], moe["fsdp"]
    assert max_gap(want["logprobs"], free["logprobs"]) > 0.1  # the routes were not the model's own
    assert max_gap(got["logprobs"], want["logprobs"]) < 1e-5
    rate = got["metrics"]["train/r3_mismatch_rate"]
    assert rate == pytest.approx(want["metrics"]["train/r3_mismatch_rate"]) and rate > 0.5
    for name, w in want["weights"].items():
        # Adam's first step moves a weight by lr·g/(|g| + 1e-8): an expert weight whose gradient is at
        # that epsilon (a token or two routed to it) moves by up to lr/2 more or less when its gradient
        # differs in the 8th decimal. A handful of such weights (3 of 196,608 at TP 2 × EP 2) sit at 1e-4.
        gap = (got["weights"][name] - w).abs()
        assert gap.max() < 2.5e-4 and int((gap > 1e-4).sum()) <= 8, name
    assert got["metrics"]["train/loss"] == pytest.approx(want["metrics"]["train/loss"], abs=1e-6)



def test_a_resumed_megatron_run_takes_the_same_step_bit_for_bit(moe):
    """The same layout resumes from its own shards: the second step's weights, loss, gradient norm and
    learning rate (a linear schedule, mid-decay) are those of the run that never stopped."""
    run = moe["resume"]
    assert all(torch.equal(run["loaded"][n], w) for n, w in run["saved"].items())
    straight, resumed = run["straight"], run["resumed"]
    assert all(torch.equal(resumed["weights"][n], w) for n, w in straight["weights"].items())
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/loss_tokens"):
        assert resumed["metrics"][key] == straight["metrics"][key], key
    assert resumed["step"] == 2  # counted on from the checkpoint's step 1


def test_a_tp2_checkpoint_resumes_at_tp1(moe):
    """Written at TP 2 × EP 2, loaded at TP 1 × EP 2: the weights as saved, bit for bit, and the next step
    (Adam's moments re-sharded too) within the backends' parity of the run that stayed at TP 2."""
    run = moe["tp2_to_tp1"]
    assert all(torch.equal(run["loaded"][n], w) for n, w in run["saved"].items())
    straight, resumed = run["straight"], run["resumed"]
    for name, w in straight["weights"].items():
        assert (resumed["weights"][name] - w).abs().max() < 1e-4, name
    assert resumed["metrics"]["train/loss"] == pytest.approx(straight["metrics"]["train/loss"], abs=1e-6)
    assert resumed["metrics"]["train/grad_norm"] == pytest.approx(straight["metrics"]["train/grad_norm"], rel=1e-5)


@pytest.mark.cuda
def test_megatron_on_a_gpu_scores_and_steps_as_fsdp_does_there(tiny_model_dir, tmp_path):
    """One rank on the GPU (megatron-core's own CUDA paths, no CPU adapter; TransformerEngine if
    installed): the same logprobs as FSDP on the GPU within 1e-5 and one step's weights within 1e-4."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/gpu/bundle-megatron.sh)")
    case = lambda name, **kw: {"name": name, "model": tiny_model_dir,
                               "trainer": {"algorithm": ALGO, "device": "cuda", **kw}}
    got = run_world(tmp_path, [case("fsdp"), case("megatron", backend="megatron")], world=1)
    assert max_gap(got["megatron"]["logprobs"], got["fsdp"]["logprobs"]) < 1e-5
    for name, w in got["fsdp"]["weights"].items():
        assert (got["megatron"]["weights"][name] - w).abs().max() < 1e-4, name
    assert got["megatron"]["metrics"]["train/loss"] == pytest.approx(got["fsdp"]["metrics"]["train/loss"], abs=1e-6)
