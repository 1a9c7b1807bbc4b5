"""LoRA end to end, disaggregated: only adapters train, the engines receive merged weights under
the base model's names after every step (checked on the engine's own tensors), and the exported
checkpoint is a plain HF model."""

import json

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_lora_run_syncs_merged_weights_to_the_engine(tiny_model_dir, tmp_path, ray_cluster):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.orchestration.driver import run_train

    cfg = load_config(RunConfig, None, {
        "model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "lora", "loop.num_steps": "2",
        "eval.every_steps": "0", "eval.num_prompts": "8", "eval.max_new_tokens": "4",
        "rollout.prompts_per_step": "4", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "4",
        "rollout.temperature": "1.5", "rollout.reward": "tests.e2e.test_resume:digit_fraction",
        "trainer.lr": "1e-2", "trainer.lora.rank": "4", "trainer.lora.sync": "merged"})
    summary = run_train(cfg)
    records = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert all("train/loss" in r for r in steps)
    assert [r["rollout/weight_version"] for r in steps] == [0, 1]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["final_checkpoint"])
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_lora_merged_sync_leaves_the_trainers_merged_weights_on_the_engine(tiny_model_dir, tmp_path, ray_cluster):
    import httpx
    import ray

    from miles.config.loader import build
    from miles.models.loading import load_model
    from miles.orchestration.actors import EngineShell, remote
    from miles.orchestration.trainer_group import TrainerGroup
    from miles.engine.config import EngineConfig
    from miles.sync.prepare import SyncConfig
    from miles.sync.verify import dtype_name, tensor_checksum, unique_tensors
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import TrainSequence

    def checksums(model_dir):
        return {n: [dtype_name(t), tensor_checksum(t)] for n, t in unique_tensors(load_model(model_dir)).items()}

    def engine_compare(url, expected):
        r = httpx.post(f"{url}/weights_checker", json={"action": "compare", "expected": expected},
                       headers={"Authorization": f"Bearer {token}"}, timeout=60)
        r.raise_for_status()
        return r.json()

    token = "s3cret"
    engine = remote(EngineShell).remote(EngineConfig(model_path=tiny_model_dir, admin_token=token))
    url = ray.get(engine.url.remote())
    cfg = build(TrainerConfig, {"lr": 1e-2, "lora": {"rank": 4, "sync": "merged"}})
    trainer = TrainerGroup(cfg, SyncConfig(bucket_size_mb=1), tiny_model_dir, seed=0, temperature=1.0,
                           admin_token=token)
    try:
        trainer.connect_engines([url])
        prompt = [19, 20, 15, 21, 31, 27]
        seqs = [TrainSequence(tokens=prompt + [5, 6, 0], prompt_len=len(prompt), loss_mask=[1, 1, 1],
                              old_logprobs=[])] * 4
        trainer.train_step(seqs, algorithm="sft")
        trainer.sync_weights(1)
        merged = checksums(trainer.save_hf(str(tmp_path / "merged")))
        assert not any("lora" in n for n in merged)
        # Every engine tensor is the trainer's merged weight, bit for bit, under the base model's names ...
        same = engine_compare(url, merged)
        assert same["success"] and same["checked"] == len(merged), same
        # ... and the adapters were folded in: the adapted layers moved away from the base weights.
        base = engine_compare(url, checksums(tiny_model_dir))
        assert base["mismatched"] and all("proj" in n for n in base["mismatched"]), base
    finally:
        trainer.close()
        ray.kill(engine)


def test_lora_adapter_sync_serves_the_adapter_version_the_trainer_pushed(tiny_model_dir, tmp_path, ray_cluster):
    """Two steps with lora.sync = "adapter": after each, every engine serves the pushed adapter (and only
    it) under the step's version, and its logprobs are those of the trainer's merged model."""
    import httpx
    import ray
    import torch

    from miles.config.loader import build
    from miles.models.loading import load_model
    from miles.orchestration.actors import EngineShell, remote
    from miles.orchestration.trainer_group import TrainerGroup
    from miles.engine.config import EngineConfig
    from miles.sync.prepare import SyncConfig
    from miles.trainer.config import TrainerConfig
    from miles.trainer.types import TrainSequence

    token = "s3cret"
    engine = remote(EngineShell).remote(EngineConfig(model_path=tiny_model_dir, admin_token=token))
    url = ray.get(engine.url.remote())
    cfg = build(TrainerConfig, {"lr": 5e-2, "lora": {"rank": 4, "sync": "adapter",
                                                     "adapter_dir": str(tmp_path / "adapters")}})
    trainer = TrainerGroup(cfg, SyncConfig(), tiny_model_dir, seed=0, temperature=1.0, admin_token=token)
    prompt = [19, 20, 15, 21, 31, 27]
    seqs = [TrainSequence(tokens=prompt + [5, 6, 0], prompt_len=len(prompt), loss_mask=[1, 1, 1], old_logprobs=[])] * 4
    try:
        trainer.connect_engines([url])
        for step in (1, 2):
            trainer.train_step(seqs, algorithm="sft")
            metrics = trainer.sync_weights(step)
            assert metrics["sync/lora_merged"] == 0.0 and metrics["sync/bytes"] > 0
            info = httpx.get(url + "/get_server_info", timeout=60).json()
            assert [n.rsplit("-", 1)[0] for n in info["loaded_lora_adapters"]] == [f"policy-v{step}"], info
            r = httpx.post(url + "/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
                "temperature": 1.0, "max_new_tokens": 6, "sampling_seed": step}}, timeout=60).json()
            assert r["meta_info"]["weight_version"] == str(step)
            out = r["output_ids"]
            merged = load_model(trainer.save_hf(str(tmp_path / f"merged-{step}"))).eval()
            with torch.no_grad():
                logits = merged(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None]).squeeze(1)
            served = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(served, expected, atol=1e-4, rtol=0)
        # The adapter moved the policy: the base model would not give these logprobs.
        base = load_model(tiny_model_dir).eval()
        with torch.no_grad():
            logits = base(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        base_lps = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None]).squeeze(1)
        assert not torch.allclose(base_lps, served, atol=1e-3)
    finally:
        trainer.close()
        ray.kill(engine)
