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


@pytest.mark.slow
def test_run_on_engines_started_outside_the_run(tiny_model_dir, tmp_path, ray_cluster, monkeypatch):
    """rollout.engine_urls: generate with and push weights to an engine the run did not start (as
    with SGLang servers), authenticated by the token from the environment; the engine outlives the run."""
    import httpx

    from miles.orchestration.driver import run_train
    from miles.engine.process import EngineProcess

    with EngineProcess(tiny_model_dir, admin_token="outside-token") as engine:
        monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", "outside-token")
        summary = run_train(small_config(tiny_model_dir, tmp_path, **{
            "loop.num_steps": "2", "eval.every_steps": "0", "rollout.engine_urls": engine.url}))
        assert summary["steps"] == 2
        # The engine serves the trainer's last push and is still up.
        assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] == "2"
        assert httpx.get(engine.url + "/health").status_code == 200


@pytest.mark.slow
def test_a_run_routes_around_a_killed_external_engine_and_readmits_it_after_its_restart(
        tiny_model_dir, tmp_path, ray_cluster, monkeypatch):
    """Two engines the run did not start; one is SIGKILLed mid-run and started again on its port by
    hand, as an operator would. The run goes on with the other, brings the restarted engine to the
    fleet's weights, lets the router give it traffic again, and ends with both at the last version
    and every prompt accounted for."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from miles.orchestration import sync_loop
    from miles.orchestration.driver import run_train
    from miles.engine.process import EngineProcess

    def engine(port: int = 0) -> EngineProcess:
        return EngineProcess(tiny_model_dir, port=port, admin_token="outside-token",
                             extra_args=["--num-threads", "1"])

    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(lambda port: engine(port), [0, 0]))
    run_dir, num_steps = tmp_path / "e2e", 3
    operator_log: list[str] = []

    def operator():
        # Mid-run: once step 1 is on record, kill one engine outright, then start it again on its port.
        while not any(json.loads(line)["step"] == 1 for line in _lines(run_dir / "metrics.jsonl")):
            time.sleep(0.1)
        engines[1].proc.kill()
        engines[1].proc.wait()
        operator_log.append("killed")
        engines[1] = engine(int(engines[1].url.rsplit(":", 1)[1]))
        operator_log.append("restarted")

    # The last step starts only once the restarted engine is back, however long its start-up took on
    # a loaded machine, so the run's end can show it serving.
    def paced_end_step(ctx, step, metrics, timer):
        deadline = time.monotonic() + 180
        while step == num_steps - 1 and not ctx.fleet.report()["readmissions"] and time.monotonic() < deadline:
            time.sleep(0.1)
        return end_step(ctx, step, metrics, timer)

    end_step = sync_loop.end_step
    monkeypatch.setattr(sync_loop, "end_step", paced_end_step)
    monkeypatch.setenv("MILES_ENGINE_ADMIN_TOKEN", "outside-token")
    killer = threading.Thread(target=operator, daemon=True)
    killer.start()
    try:
        summary = run_train(small_config(tiny_model_dir, tmp_path, **{
            "loop.num_steps": str(num_steps), "eval.every_steps": "0", "eval.num_prompts": "4",
            "rollout.engine_urls": ",".join(e.url for e in engines),
            "health.interval_s": "0.3", "health.timeout_s": "3", "health.failure_threshold": "2"}))
        killer.join(timeout=60)
        assert operator_log == ["killed", "restarted"]
        assert summary["steps"] == num_steps

        # The fleet routed around the dead engine and re-admitted it at the same address after its restart.
        fleet = summary["fleet"]
        assert fleet["readmissions"] == 1, fleet
        (event,) = fleet["events"]
        assert event["kind"] == "readmitted" and event["old_url"] == event["new_url"] == engines[1].url
        assert event["first_miss"] <= event["detected_at"] <= event["started_at"] <= event["pushed_at"] \
            <= event["admitted_at"]
        records = [json.loads(line) for line in _lines(run_dir / "metrics.jsonl")]
        last = records[-1]
        assert last["fleet/readmissions"] == 1 and last["fleet/serving_engines"] == 2, last
        assert last["fleet/engines_declared_dead"] == 1

        # Both engines serve the fleet's last version, the restarted one included, and neither was stopped.
        for e in engines:
            assert httpx.get(e.url + "/get_model_info").json()["weight_version"] == str(num_steps)
        assert all(e.proc.poll() is None for e in engines)

        # No prompt was lost: every one drawn was trained, discarded with a reason, or is still pending,
        # and none was dropped for the dead engine (the router retried its requests on the other).
        ledger = summary["ledger"]
        assert ledger["drawn"] >= 4 * (num_steps - 1) and ledger["pending"] == ledger["retry_pending"]
        assert ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"]
        assert ledger["events"].get("discarded_engine_failure", 0) == 0, ledger
    finally:
        killer.join(timeout=60)
        for e in engines:
            e.stop()


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []
