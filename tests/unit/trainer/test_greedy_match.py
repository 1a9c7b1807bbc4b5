"""The SFT stopping rule's measure: the trainer's teacher-forced argmax agrees with what a real
engine decodes greedily, so "greedy accuracy on held-out demonstrations" needs no generation."""

from __future__ import annotations

import asyncio

from miles.net import free_port


def greedy_samples(model_dir: str, n: int = 6) -> list:
    import httpx

    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread
    from miles.rollout.generate import SamplingParams, generate

    server = start_server_thread(EngineConfig(model_path=model_dir, dtype="float32"))

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(
                generate(c, server.url, [3 + i, 40 + 2 * i, 7, 11 + i], SamplingParams(temperature=0.0, max_new_tokens=8))
                for i in range(n)))
    try:
        return asyncio.run(run())
    finally:
        server.stop()


def test_teacher_forced_argmax_reproduces_the_engines_greedy_decode(tiny_model_dir, gloo):
    from miles.config.loader import build
    from miles.trainer.trainer import Trainer
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import TrainSequence

    samples = greedy_samples(tiny_model_dir)
    trainer = Trainer(build(TrainerConfig, {"micro_batch_size": 4}), tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    seqs = [TrainSequence(tokens=s.prompt_ids + s.response_ids, prompt_len=len(s.prompt_ids),
                          loss_mask=[1] * len(s.response_ids), old_logprobs=[]) for s in samples]
    assert trainer.greedy_matches(seqs) == [True] * len(seqs)
    # Any other answer token is one greedy decoding would not produce.
    last = seqs[2].tokens[-1]
    seqs[2] = TrainSequence(tokens=seqs[2].tokens[:-1] + [last + 1], prompt_len=seqs[2].prompt_len,
                            loss_mask=seqs[2].loss_mask, old_logprobs=[])
    assert trainer.greedy_matches(seqs) == [True, True, False] + [True] * (len(seqs) - 3)
    assert trainer.backend.model.training  # measuring leaves the model ready to train
