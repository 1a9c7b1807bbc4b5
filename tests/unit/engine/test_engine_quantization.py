"""An engine serving quantized weights returns the logprobs of the trainer's quantization-aware forward in
the same format: the same numerics on both sides, before and after a weight update."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import httpx
import pytest
import torch

from miles.config.loader import ConfigError
from miles.net import free_port
from miles.engine.config import EngineConfig
from miles.engine.server import parse_args, start_server_thread
from miles.trainer.config import TrainerConfig
from miles.trainer.forward import forward_logprobs
from miles.trainer.trainer import Trainer
from miles.trainer.types import BatchTotals, TrainSequence

TOKEN = "quantization-test-token"
PROMPTS = [[5, 17, 33, 8], [40, 2, 9, 111, 64, 12]]


@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sampled(client: httpx.Client, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    r = client.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 11, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def trainer_logprobs(trainer, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp, _ = forward_logprobs(trainer.backend.model, ids, torch.ones_like(ids), temperature=1.0)  # (1, T-1)
    return logp[0, len(prompt) - 1:]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_engine_logprobs_equal_the_trainers_qat_forward(tiny_model_dir, gloo, tmp_path, fmt):
    trainer = Trainer(TrainerConfig(quantization=fmt, lr=1e-2), tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    plain = Trainer(TrainerConfig(), tiny_model_dir, 0, 1, "127.0.0.1", free_port())
    server = start_server_thread(EngineConfig(model_path=tiny_model_dir, dtype="float32", quantization=fmt,
                                              admin_token=TOKEN))
    try:
        with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            for prompt in PROMPTS:
                out, lps = sampled(c, prompt)
                torch.testing.assert_close(lps, trainer_logprobs(trainer, prompt, out), atol=1e-5, rtol=0)
                # ... and not those of the unquantized policy: both sides really run the format.
                assert (lps - trainer_logprobs(plain, prompt, out)).abs().max() > 1e-4

            # One training step, the new float32 weights loaded by the engine: it serves them quantized again.
            seqs = [TrainSequence(tokens=p + [7, 9, 21], prompt_len=len(p), loss_mask=[1, 1, 1],
                                  old_logprobs=[-3.0] * 3, advantage=a) for p, a in zip(PROMPTS, (1.0, -1.0))]
            before = SimpleNamespace(backend=SimpleNamespace(model=copy.deepcopy(trainer.backend.model)))
            trainer.train_step(seqs, BatchTotals.of(seqs))
            trainer.save_hf(str(tmp_path / "step1"))
            r = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "step1")})
            assert r.status_code == 200 and r.json()["success"], r.text
            for prompt in PROMPTS:
                out, lps = sampled(c, prompt)
                torch.testing.assert_close(lps, trainer_logprobs(trainer, prompt, out), atol=1e-5, rtol=0)
                assert (lps - trainer_logprobs(before, prompt, out)).abs().max() > 1e-4  # the update was served

            # Released weights take their quantized copies with them; resumed ones serve the same numerics.
            assert c.post("/release_memory_occupation", json={}).status_code == 200
            assert c.post("/resume_memory_occupation", json={}).status_code == 200
            out, lps = sampled(c, PROMPTS[0])
            torch.testing.assert_close(lps, trainer_logprobs(trainer, PROMPTS[0], out), atol=1e-5, rtol=0)
    finally:
        server.stop()


def test_an_unknown_engine_format_is_refused_with_the_choices(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"engine quantization = 'fp6' is not a format; choose none or one of fp8"):
        EngineConfig(model_path=tiny_model_dir, quantization="fp6").validate()


def test_miles_serve_takes_the_format_as_a_flag(tiny_model_dir):
    assert parse_args(["--model", tiny_model_dir, "--quantization", "nvfp4"])[0].quantization == "nvfp4"


def test_rollout_only_quantization_shows_as_mismatch_and_qat_removes_it(tiny_model_dir, gloo):
    """The metrics a run reports per step: an nvfp4 engine against a float32 trainer disagrees on the
    sampled tokens; against a trainer training in nvfp4 it does not."""
    server = start_server_thread(EngineConfig(model_path=tiny_model_dir, dtype="float32", quantization="nvfp4"))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            rollouts = [(p, *sampled(c, p)) for p in PROMPTS]
    finally:
        server.stop()
    seqs = [TrainSequence(tokens=p + out, prompt_len=len(p), loss_mask=[1] * len(out), old_logprobs=lps.tolist(),
                          advantage=a) for (p, out, lps), a in zip(rollouts, (1.0, -1.0))]
    metrics = {}
    for name, quantization in (("rollout_only", "none"), ("qat", "nvfp4")):
        trainer = Trainer(TrainerConfig(quantization=quantization), tiny_model_dir, 0, 1, "127.0.0.1",
                              free_port())
        metrics[name] = trainer.compute_gradients(seqs, BatchTotals.of(seqs))
    assert metrics["rollout_only"]["train/rollout_mismatch_kl"] > 1e-4
    assert metrics["rollout_only"]["train/rollout_mismatch_frac"] > 0
    assert metrics["qat"]["train/rollout_mismatch_kl"] < 1e-8
    assert metrics["qat"]["train/rollout_mismatch_frac"] == 0.0
    assert metrics["qat"]["train/rollout_logprob_abs_diff"] < 1e-5


def test_an_moe_engine_serves_its_experts_in_the_format_the_trainer_trains_them_in(tiny_moe_model_dir, gloo):
    trainer = Trainer(TrainerConfig(quantization="nvfp4"), tiny_moe_model_dir, 0, 1, "127.0.0.1", free_port())
    plain = Trainer(TrainerConfig(), tiny_moe_model_dir, 0, 1, "127.0.0.1", free_port())
    server = start_server_thread(EngineConfig(model_path=tiny_moe_model_dir, dtype="float32", quantization="nvfp4"))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for prompt in PROMPTS:
                out, lps = sampled(c, prompt)
                torch.testing.assert_close(lps, trainer_logprobs(trainer, prompt, out), atol=1e-5, rtol=0)
                assert (lps - trainer_logprobs(plain, prompt, out)).abs().max() > 1e-4
    finally:
        server.stop()
