"""After a training step and a weight push, the engine generates exactly what the trainer's new
weights produce: same greedy tokens, same logprobs."""

import httpx
import pytest
import torch

pytestmark = pytest.mark.e2e


def test_engine_matches_trainer_after_update(tiny_model_dir, tmp_path, ray_cluster):
    import ray

    from miles.orchestration.actors import EngineShell, remote
    from miles.orchestration.trainer_group import TrainerGroup
    from miles.engine.config import EngineConfig
    from miles.sync.prepare import SyncConfig
    from miles.trainer.config import TrainerConfig
    from miles.trainer.forward import token_logprobs
    from miles.trainer.types import TrainSequence

    token = "s3cret"
    engine = remote(EngineShell).remote(EngineConfig(model_path=tiny_model_dir, admin_token=token))
    url = ray.get(engine.url.remote())
    trainer = TrainerGroup(TrainerConfig(lr=5e-3), SyncConfig(bucket_size_mb=1), tiny_model_dir, seed=0,
                           temperature=1.0, admin_token=token)
    try:
        trainer.connect_engines([url])
        prompt = [19, 20, 15, 21, 31, 27]
        before = httpx.post(f"{url}/generate", json={"input_ids": prompt, "return_logprob": True,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
        seqs = [TrainSequence(tokens=prompt + [5, 6, 0], prompt_len=len(prompt), loss_mask=[1, 1, 1],
                              old_logprobs=[])] * 4
        trainer.train_step(seqs, algorithm="sft")
        stats = trainer.sync_weights(7)
        assert stats["sync/buckets"] >= 2
        after = httpx.post(f"{url}/generate", json={"input_ids": prompt, "return_logprob": True,
                                                     "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
        assert after["meta_info"]["weight_version"] in (7, "7")
        assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] in (7, "7")

        export = trainer.save_hf(str(tmp_path / "export"))
        from miles.models.loading import load_model

        model = load_model(export).eval()
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=0)
        ref_ids = ref[0, len(prompt):].tolist()
        got_ids = after["output_ids"]
        assert got_ids == ref_ids[: len(got_ids)]
        full = torch.tensor([prompt + got_ids])
        with torch.no_grad():
            ref_lp = token_logprobs(model, full, torch.ones_like(full), temperature=0)[0, len(prompt) - 1:]
        got_lp = torch.tensor([lp for lp, *_ in after["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got_lp, ref_lp, atol=1e-5), (got_lp, ref_lp)
        # The update changed the policy: the same request is answered differently than before.
        assert before["meta_info"]["output_token_logprobs"] != after["meta_info"]["output_token_logprobs"]
    finally:
        trainer.close()
        ray.kill(engine)
