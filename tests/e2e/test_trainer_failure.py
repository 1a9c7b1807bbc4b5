"""A trainer rank that stops answering ends the step within trainer.collective_timeout_s, with a
message that says what happened and how to continue (two real FSDP2 ranks on gloo in Ray)."""

import os
import signal
import time

import pytest

pytestmark = pytest.mark.e2e


def test_a_hung_collective_fails_within_its_timeout_with_a_clear_message(tiny_model_dir, ray_cluster):
    from miles.config.loader import build
    from miles.orchestration.trainer_group import TrainerFailure, TrainerGroup
    from miles.sync.prepare import SyncConfig
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import TrainSequence

    timeout_s = 4.0
    cfg = build(TrainerConfig, {"num_ranks": 2, "collective_timeout_s": timeout_s, "lr": 1e-3})
    group = TrainerGroup(cfg, SyncConfig(), tiny_model_dir, seed=0, temperature=1.0)
    try:
        seqs = [TrainSequence(tokens=[5, 6, 7, 8, 9], prompt_len=3, loss_mask=[1, 1], old_logprobs=[-5.0, -5.0],
                              advantage=a) for a in (1.0, -1.0, 0.5, -0.5)]
        group.train_step(seqs)  # both ranks healthy: a normal step
        os.kill(group.pids()[1], signal.SIGSTOP)  # rank 1 alive but silent, like a hung host
        t0 = time.monotonic()
        with pytest.raises(TrainerFailure) as info:
            group.train_step(seqs)
        elapsed = time.monotonic() - t0
    finally:
        group.close()
    message = str(info.value)
    assert "trainer rank 0" in message and "collective_timeout_s = 4s" in message, message
    assert "miles train --resume" in message
    assert timeout_s <= elapsed < timeout_s + 30, elapsed
