"""Train–inference consistency. Samples come from a real engine over HTTP and go through the
trainer's own micro-batching and forward (one real gloo rank):
- a bf16 engine routes some tokens of the tiny MoE to other experts than the fp32 trainer would;
  with routing replay (R3) the experts the trainer uses are the engine's for every token, in padded,
  packed and token-budget micro-batches, and the rollout-vs-train logprob gap shrinks;
- a dense fp32 engine and the fp32 trainer agree on every token's logprob within 1e-5.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.net import free_port


def rollout(model_dir: str, dtype: str, n: int = 12, routed: bool = False) -> list:
    """Samples from an engine of `dtype` via the rollout's generate function."""
    import httpx

    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.generate import SamplingParams, generate

    server = start_server_thread(EngineConfig(model_path=model_dir, dtype=dtype))

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(
                generate(c, server.url, [3 + i, 40 + 2 * i, 7, 11 + i, 9], SamplingParams(max_new_tokens=16, seed=i),
                         return_routed_experts=routed) for i in range(n)))
    try:
        return asyncio.run(run())
    finally:
        server.stop()


def sequences(samples) -> list:
    from miles.trainer.types import TrainSequence

    return [TrainSequence(tokens=s.prompt_ids + s.response_ids, prompt_len=len(s.prompt_ids), loss_mask=s.loss_mask,
                          old_logprobs=s.rollout_logprobs, advantage=1.0 if i % 2 else -1.0,
                          routed_experts=s.routed_experts) for i, s in enumerate(samples)]


def trainer_for(model_dir: str, **kw):
    from miles.config.loader import build
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig

    return Trainer(build(TrainerConfig, kw), model_dir, 0, 1, "127.0.0.1", free_port())


@pytest.fixture(scope="module")
def moe_bf16_samples(tiny_moe_model_dir):
    return rollout(tiny_moe_model_dir, "bfloat16", routed=True)


def experts_seen(trainer) -> list:
    """Records the expert ids each MoE block's experts receive: what the forward really used."""
    seen = []
    for layer, router in enumerate(r.module for r in trainer.routers):
        experts = next(m for name, m in trainer.backend.model.named_modules()
                       if name.endswith("mlp.experts") and name.replace("experts", "gate") in
                       {n for n, r in trainer.backend.model.named_modules() if r is router})
        experts.register_forward_pre_hook(lambda _m, args, layer=layer: seen.append((layer, args[1].clone())))
    return seen


@pytest.mark.parametrize("layout", [{}, {"pack_sequences": True, "max_tokens_per_micro_batch": 64},
                                    {"micro_batch_size": 5}])
def test_replayed_routing_is_the_engines_for_every_token(gloo, tiny_moe_model_dir, moe_bf16_samples, layout):
    from miles.models.moe import decode_routed_experts
    from miles.trainer.batching import build_micro_batch, plan_micro_batches

    trainer = trainer_for(tiny_moe_model_dir, routing_replay=True, **layout)
    seqs = sequences(moe_bf16_samples)
    seen = experts_seen(trainer)
    metrics = trainer.compute_gradients(seqs, sum(s.num_loss_tokens for s in seqs))
    assert metrics["train/r3_mismatch_rate"] > 0  # the trainer alone would have routed some tokens elsewhere
    # Rebuild the micro-batches the trainer ran, and expect each block's experts to have received the
    # engine's ids at every recorded position (the last token of each sequence was never fed to the engine).
    cfg = trainer.cfg
    plan = plan_micro_batches([len(s.tokens) for s in seqs], cfg.max_tokens_per_micro_batch, cfg.micro_batch_size,
                              cfg.pack_sequences)
    assert len(seen) == 4 * len(plan)
    checked = 0
    for m, members in enumerate(plan):
        mb = build_micro_batch([seqs[i] for i in members], [1.0] * len(members), cfg.pack_sequences, 0, (4, 2))
        for layer, used in seen[4 * m:4 * m + 4]:
            want = mb.routed[:, :, layer].reshape(-1, 2)
            known = want[:, 0] >= 0
            assert torch.equal(used[known].sort(-1).values, want[known].sort(-1).values)
            checked += int(known.sum())
    assert checked == 4 * sum(len(decode_routed_experts(s.routed_experts, 4, 2)) for s in seqs)
    assert checked == 4 * sum(len(s.tokens) - 1 for s in seqs)


def test_replay_lowers_the_rollout_logprob_gap(gloo, tiny_moe_model_dir, moe_bf16_samples):
    trainer = trainer_for(tiny_moe_model_dir)
    seqs = sequences(moe_bf16_samples)
    free = trainer.compute_gradients(seqs, sum(s.num_loss_tokens for s in seqs))
    trainer.cfg.routing_replay = True
    replayed = trainer.compute_gradients(seqs, sum(s.num_loss_tokens for s in seqs))
    assert free["train/r3_mismatch_rate"] > 0
    assert replayed["train/rollout_logprob_abs_diff"] < free["train/rollout_logprob_abs_diff"]
    # The router still learns under replay: its weights get a gradient through the recomputed gates.
    assert all(r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0 for r in trainer.routers)


def test_the_reference_model_routes_freely_under_replay(gloo, tiny_moe_model_dir, moe_bf16_samples):
    from miles.models.moe import routers

    trainer = trainer_for(tiny_moe_model_dir, routing_replay=True, algorithm={"kl_coef": 0.01})
    seqs = sequences(moe_bf16_samples)
    free = []

    def own_choice(_module, _args, out):  # registered last: sees the output after any other hook
        logits, _, ids = out
        free.append(torch.equal(ids, torch.softmax(logits.float(), -1).topk(ids.shape[-1]).indices))
    for router in routers(trainer.reference.model):
        router.register_forward_hook(own_choice)
    metrics = trainer.compute_gradients(seqs, sum(s.num_loss_tokens for s in seqs))
    assert metrics["train/r3_mismatch_rate"] > 0 and "train/kl" in metrics
    assert len(free) == 4 and all(free)


@pytest.fixture(scope="module")
def varied_dense_model_dir(tmp_path_factory) -> str:
    # Varied weights: near-uniform logits (the default init) would make any two forwards agree.
    from miles.models.presets import build_tiny_model

    return str(build_tiny_model("tiny-qwen3", tmp_path_factory.mktemp("dense-varied"), init_std=0.1))


@pytest.mark.parametrize("pack", [False, True])
def test_dense_fp32_engine_and_fp32_trainer_agree_per_token(gloo, varied_dense_model_dir, pack):
    """True on-policy by construction: every token's |Δlogprob| <= 1e-5 (measured: ~3e-6)."""
    from miles.trainer.batching import build_micro_batch
    from miles.trainer.forward import forward_logprobs

    trainer = trainer_for(varied_dense_model_dir, pack_sequences=pack)
    seqs = sequences(rollout(varied_dense_model_dir, "float32", n=6))
    mb = build_micro_batch(seqs, [1.0] * len(seqs), pack, trainer.pad_id)
    with torch.no_grad():
        logp, _ = forward_logprobs(trainer.backend.model, mb.input_ids, mb.attention_mask, mb.position_ids, trainer.temperature)
    m = mb.mask.bool()
    assert int(m.sum()) == sum(len(s.loss_mask) for s in seqs) > 0
    assert (logp[m] - mb.old_logprobs[m]).abs().max() <= 1e-5


def test_config_load_refuses_what_cannot_replay(tiny_model_dir, tiny_moe_model_dir):
    from miles.config import ConfigError, load_config
    from miles.run_config import RunConfig
    from miles.rollout.router import RouterConfig

    def load(model, **kw):
        return load_config(RunConfig, None, {"model.path": model, **kw})

    on = {"rollout.return_routed_experts": "true", "trainer.routing_replay": "true"}
    cfg = load(tiny_moe_model_dir, **on)
    assert cfg.trainer.routing_replay and cfg.rollout.return_routed_experts
    with pytest.raises(ConfigError, match="set rollout.return_routed_experts = true"):
        load(tiny_moe_model_dir, **{"trainer.routing_replay": "true"})
    with pytest.raises(ConfigError, match="dense 'qwen3' model: set both to false.*tiny-qwen3-moe"):
        load(tiny_model_dir, **on)
    cfg.router = RouterConfig(kind="sglang")  # a run that puts the Rust sglang-router in front
    with pytest.raises(ConfigError, match="drops routed experts.*set router.kind = 'miles'"):
        cfg.validate()


def test_a_reply_without_the_asked_for_routed_experts_fails_the_sample():
    from miles.rollout.generate import GenerationError, routed_experts_of

    assert routed_experts_of({"routed_experts": "AAAA"}, "http://e", True) == "AAAA"
    assert routed_experts_of({}, "http://e", False) is None
    with pytest.raises(GenerationError, match="router.kind = 'miles'"):
        routed_experts_of({"weight_version": 3}, "http://e", True)


def test_rollout_manager_keeps_routed_experts_through_the_buffer_to_train_sequences(tiny_moe_model_dir):
    from miles.buffer.data_buffer import BufferConfig
    from miles.models.moe import decode_routed_experts
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.config import RolloutConfig
    from miles.rollout.manager import RolloutManager
    from miles.trainer.algorithms import AlgorithmConfig, get_algorithm
    from miles.trainer.batching import sequences_from_groups

    server = start_server_thread(EngineConfig(model_path=tiny_moe_model_dir, dtype="bfloat16"))
    try:
        m = RolloutManager(RolloutConfig(prompts_per_step=2, n_samples_per_prompt=3, max_new_tokens=8,
                                         return_routed_experts=True),
                           tiny_moe_model_dir, [server.url],
                           buffer_cfg=BufferConfig(filter="none"))
        m.generate_batch()
        groups, _ = m.collect()
    finally:
        server.stop()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6
    for s in samples:
        assert decode_routed_experts(s.routed_experts, 4, 2).shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
    for g in groups:  # give every group a learning signal
        for i, s in enumerate(g.samples):
            s.reward = float(i)
    seqs = sequences_from_groups(groups, get_algorithm(AlgorithmConfig()))
    assert len(seqs) == 6 and [q.routed_experts for q in seqs] == [s.routed_experts for s in samples]


def test_replay_refuses_sequences_without_routed_experts(gloo, tiny_moe_model_dir, moe_bf16_samples):
    import dataclasses

    trainer = trainer_for(tiny_moe_model_dir, routing_replay=True)
    seqs = sequences(moe_bf16_samples)
    seqs[3] = dataclasses.replace(seqs[3], routed_experts=None)
    with pytest.raises(ValueError, match="1 of 12 sequences carry no routed experts"):
        trainer.compute_gradients(seqs, sum(s.num_loss_tokens for s in seqs))
