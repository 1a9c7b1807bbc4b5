"""A short RL run end to end over a real local Ray cluster: engine process, FSDP2 trainer on gloo,
broadcast weight sync, run directory on disk."""

import json

import pytest

from tests.helpers.runs import small_config

pytestmark = pytest.mark.e2e


def test_short_grpo_run_writes_run_dir_and_updates_engines(tiny_model_dir, tmp_path, ray_cluster):
    from miles.orchestration.driver import run_train

    summary = run_train(small_config(tiny_model_dir, tmp_path))
    run_dir = tmp_path / "e2e"
    assert summary["run_dir"] == str(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["rollout"]["n_samples_per_prompt"] == 4

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2] and "eval/accuracy" in records[3]
    for r in records[1:]:
        for key in ("rollout/reward_mean", "perf/step_s", "sync/bytes", "sync/buckets"):
            assert key in r, key
        assert r["sync/buckets"] >= 2  # 1 MiB buckets split the ~3 MiB model
    # Every sample of step k was generated under weight version k-1: the push after each step landed.
    assert [r["rollout/weight_version"] for r in records[1:]] == [0, 1, 2]
    assert summary["eval_accuracy_before"] == records[0]["eval/accuracy"]
    assert summary["eval_accuracy_after"] == records[3]["eval/accuracy"]

    from transformers import AutoModelForCausalLM

    ckpt = run_dir / "checkpoints" / "step_3"
    assert summary["final_checkpoint"] == str(ckpt)
    AutoModelForCausalLM.from_pretrained(ckpt)  # loadable
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_run_on_engines_started_outside_the_run(tiny_model_dir, tmp_path, ray_cluster, monkeypatch):
    """rollout.engine_urls: generate with and push weights to an engine the run did not start (as
    with SGLang servers), authenticated by the token from the environment; the engine outlives the run."""
    import httpx

    from miles.orchestration.driver import run_train
    from miles.rollout.engine.process import EngineProcess

    with EngineProcess(tiny_model_dir, admin_token="outside-token") as engine:
        monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", "outside-token")
        summary = run_train(small_config(tiny_model_dir, tmp_path, **{
            "loop.num_steps": "2", "eval.every_steps": "0", "rollout.engine_urls": engine.url}))
        assert summary["steps"] == 2
        # The engine serves the trainer's last push and is still up.
        assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] == "2"
        assert httpx.get(engine.url + "/health").status_code == 200
