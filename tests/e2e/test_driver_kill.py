"""The driver itself SIGKILLed mid-run (with its process group), then `miles train --resume RUN_DIR` in a
new process: the router (a process of its own session) keeps answering /health meanwhile and is
adopted by the resumed driver, which stops it at the end; the run completes, and every prompt is
trained or discarded exactly once (fully_async; real processes for the driver, Ray, the router, the
engine and the trainer)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles.orchestration.router_supervisor import RECORD, RouterRecord

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS = 5, 4


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Ray's GCS, raylet and workers under a driver that started Ray)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command name may hold spaces; the parent pid is the 2nd field after its ')'.
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def trained_at(run_dir: Path, step: int) -> dict[int, int]:
    state = json.loads((run_dir / "checkpoints" / f"state_{step}" / "rollout.json").read_text())
    return {int(k): v for k, v in state["ledger"]["trained_at"].items()}


def train_args(tiny_model_dir, tmp_path, **more) -> list[str]:
    overrides = {"model.path": tiny_model_dir, "run.output_dir": str(tmp_path), "run.name": "killed",
                 "loop.schedule": "fully_async", "loop.num_steps": STEPS, "loop.save_every": 1,
                 "eval.every_steps": 0, "eval.num_prompts": 8, "eval.max_new_tokens": 4,
                 "rollout.prompts_per_step": PROMPTS, "rollout.n_samples_per_prompt": 4,
                 "rollout.max_new_tokens": 4, "rollout.temperature": 1.5, "buffer.filter": "none",
                 "buffer.max_inflight_groups": 4, "buffer.capacity": 4, "ray.num_cpus": 2,
                 "rollout.reward": "tests.e2e.test_resume:digit_fraction", "metrics.progress": "off", **more}
    args = [sys.executable, "-m", "miles.cli", "train"]
    for key, value in overrides.items():
        if value is not None:  # None drops a default
            args += [f"--{key}", str(value)]
    return args


def wait_for_checkpoint(run_dir: Path, step: int, driver: subprocess.Popen, log: Path) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and int(latest.read_text().strip().split("_")[1]) >= step):
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step-{step} checkpoint within 10 minutes"
        time.sleep(0.2)


def kill_at_checkpoint(args: list[str], env: dict, run_dir: Path, log: Path, step: int = 2):
    """Run `miles train` (args) in a session of its own and SIGKILL its whole process group once the
    step-`step` checkpoint is written: the router's record and the step of the checkpoint left behind."""
    with log.open("w") as out:
        driver = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            wait_for_checkpoint(run_dir, step, driver, log)
            router = RouterRecord.load(run_dir / RECORD)
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
    return router, int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])


def resume(run_dir: Path, env: dict) -> subprocess.CompletedProcess:
    resumed = subprocess.run([sys.executable, "-m", "miles.cli", "train", "--resume", str(run_dir)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


def stopped_by_the_run(router) -> bool:
    """Whether the run ended its router (one still alive is killed, so no test leaves it running)."""
    if alive(router.pid):
        os.kill(router.pid, signal.SIGKILL)
        return False
    return True


def check_nothing_lost_or_trained_twice(run_dir: Path, killed_at: int) -> dict:
    """The resumed run's records and ledger: each step once, every trained sample at the fleet's
    version, what the checkpoint had trained not trained again, every drawn prompt accounted for."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(STEPS + 1))  # the steps redone after the checkpoint are recorded once
    assert [r["rollout/off_fleet_samples"] for r in recs[1:]] == [0.0] * STEPS
    before, after = trained_at(run_dir, killed_at), trained_at(run_dir, STEPS)
    assert {i: after[i] for i in before} == before  # what the checkpoint had trained is not trained again
    assert sorted(after.values()) == sorted(s for s in range(1, STEPS + 1) for _ in range(PROMPTS))
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert ledger["trained"] == STEPS * PROMPTS
    assert ledger["drawn"] == ledger["trained"] + ledger["discarded"] + ledger["pending"]
    state = json.loads((run_dir / "checkpoints" / f"state_{STEPS}" / "rollout.json").read_text())
    assert sorted(map(int, state["ledger"]["states"])) == list(range(ledger["drawn"]))  # nothing skipped
    return summary


def test_a_killed_driver_is_resumed_by_miles_train_resume_with_nothing_lost(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "killed"
    args = train_args(tiny_model_dir, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)  # its own Ray cluster, which must go down with it
    log = (tmp_path / "first.log").open("w")
    driver = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started: list[int] = []
    router = None
    try:
        wait_for_checkpoint(run_dir, 2, driver, tmp_path / "first.log")
        latest = run_dir / "checkpoints" / "latest"
        started = descendants(driver.pid)
        # The run's own processes: the engine, trainer ranks and rollout manager (Ray actors) and the
        # Ray node under them. Ray's per-node agents are left out: they notice a dead node only late.
        run_procs = [p for p in started if any(name in command(p) for name in (
            "ray::EngineShell", "ray::TrainerShell", "ray::RolloutManager", "raylet", "gcs_server"))]
        assert len([p for p in run_procs if "ray::" in command(p)]) >= 3
        router = RouterRecord.load(run_dir / RECORD)
        assert router is not None and alive(router.pid) and router.pid not in run_procs
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and everything in its process group
        driver.wait()
        killed_at = int(latest.read_text().strip().split("_")[1])
        assert killed_at < STEPS and not (run_dir / "summary.json").exists()  # it died mid-run
        # They share the driver's fate (Ray kills what a dead driver owned), so the resumed run starts
        # with no engine or trainer of the dead one still holding cores.
        deadline = time.monotonic() + 60
        while any(alive(p) for p in run_procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [command(p) for p in run_procs if alive(p)], "processes of the killed run outlived it"
        # The router did not: it answers /health with no engine left behind it (503), and still lists
        # the dead driver's engines.
        assert alive(router.pid), "the router died with the driver"
        assert httpx.get(router.url + "/health", timeout=10).status_code in (200, 503)
        assert httpx.get(router.url + "/list_workers", timeout=10).json()["urls"]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        for p in started:
            if alive(p) and (router is None or p != router.pid):
                os.kill(p, signal.SIGKILL)
        log.close()

    try:
        resumed = subprocess.run([sys.executable, "-m", "miles.cli", "train", "--resume", str(run_dir)], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        ended = router is None or not alive(router.pid)
        if not ended:
            os.kill(router.pid, signal.SIGKILL)  # never a stray router, whatever failed
    assert f"resumed from {run_dir / 'checkpoints' / f'state_{killed_at}'}" in resumed.stderr
    # The resumed driver adopted the router (same URL, same process), gave it the new engines, and
    # stopped it at the end of the run.
    assert f"router at {router.url} (adopted: pid {router.pid}" in resumed.stderr, resumed.stderr[-3000:]
    assert ended and not (run_dir / RECORD).exists(), "the run's end left its router running"

    summary = check_nothing_lost_or_trained_twice(run_dir, killed_at)
    assert summary["router"]["adopted"] and summary["cluster"]["router"] == router.url


@pytest.mark.slow  # a variant of the run above (about 45 s more)
def test_engines_started_outside_the_run_keep_their_router_through_a_killed_driver_and_are_adopted(
        tiny_model_dir, tmp_path):
    """rollout.engine_urls: the engines and the router outlive the driver's process group, so the
    router keeps serving them (/health 200, both active); `--resume` adopts both, continues the engines
    the dead driver may have left paused, pushes them the checkpoint's weights, and the run completes."""
    from miles.engine.process import EngineProcess

    token = "outside-token"
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(EngineProcess(tiny_model_dir, admin_token=token,
                                                     extra_args=["--num-threads", "1"])) for _ in range(2)]
        urls = [e.url for e in engines]
        run_dir = tmp_path / "killed"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MILES_ENGINE_ADMIN_TOKEN": token}
        env.pop("RAY_ADDRESS", None)
        args = train_args(tiny_model_dir, tmp_path, **{"rollout.engine_urls": ",".join(urls)})
        router, killed_at = kill_at_checkpoint(args, env, run_dir, tmp_path / "first.log")
        try:
            # The engines' front door stays open: the router answers /health with both engines serving.
            time.sleep(1.0)
            health = httpx.get(router.url + "/health", timeout=10)
            assert health.status_code == 200 and health.json()["active_workers"] == 2, health.text
            resumed = resume(run_dir, env)
        finally:
            ended = stopped_by_the_run(router)
        assert f"router at {router.url} (adopted: pid {router.pid}" in resumed.stderr, resumed.stderr[-3000:]
        assert ended and not (run_dir / RECORD).exists()
        summary = check_nothing_lost_or_trained_twice(run_dir, killed_at)
        assert summary["router"]["adopted"]
        # The same engine processes, never restarted, at the resumed run's last version.
        assert all(e.proc.poll() is None for e in engines)
        assert [httpx.get(u + "/get_model_info").json()["weight_version"] for u in urls] == [str(STEPS)] * 2
