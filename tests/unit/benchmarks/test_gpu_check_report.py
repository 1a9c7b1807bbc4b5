"""scripts/gpu-check.sh's one JSON line says where the main job got to, even when its part was cut
short: the warm start's steps and held-out accuracy along the way, and the RL phase's steps and the
median seconds of a step and its parts (`scripts/gpu/check.py report`)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _report(root: Path) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "scripts/gpu/check.py"), "report", str(root)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-800:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_main_job_cut_short_in_rl_reports_its_warm_start_and_its_rl_steps(tmp_path):
    log = [f"[sft] {n}/1500 nll=0.9 accuracy={a} | 1s elapsed" for n, a in
           [(5, 0.01), (100, 0.03), (105, 0.04), (200, 0.2), (205, 0.51)]]
    summary = {"out": "x", "steps": 205, "final_nll": 0.4, "wall_time_s": 30.04, "held_out_accuracy": 0.51,
               "reached_target": True}
    (tmp_path / "arithmetic.log").write_text("\n".join(log + [json.dumps(summary), "[train] 2/300 ..."]) + "\n")
    run = tmp_path / "arithmetic" / "grpo"
    run.mkdir(parents=True)
    recs = [{"step": 0, "eval/accuracy": 0.5}] + [
        {"step": s, "perf/step_s": t, "perf/rollout_s": t / 2, "perf/train_s": t / 4, "perf/sync_s": 0.1}
        for s, t in [(1, 2.0), (2, 0.4), (3, 0.6)]] + [{"step": 3, "eval/accuracy": 0.625}]
    # The part's time limit killed the run while it wrote its next line.
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "perf/st')
    (tmp_path / "arithmetic-time.json").write_text('{"wall_s": 180}')

    arith = _report(tmp_path)["arithmetic"]
    assert arith["wall_s"] == 180 and arith["before"] == 0.5 and arith["after"] == 0.625 and arith["gain_points"] == 12.5
    assert arith["sft"] == {"steps": 205, "held_out_accuracy": 0.51, "reached_target": True, "s": 30.0,
                            "accuracy_by_step": [[100, 0.03], [200, 0.2], [205, 0.51]]}
    assert arith["grpo"] == {"steps_done": 3, "median_s": {"step_s": 0.6, "rollout_s": 0.3, "train_s": 0.15,
                                                           "sync_s": 0.1}}


def test_a_main_job_cut_short_in_sft_reports_the_accuracy_it_had_reached(tmp_path):
    (tmp_path / "arithmetic.log").write_text("[sft] 100/1500 nll=1.1 accuracy=0.0312 | 9s\n"
                                             "[sft] 105/1500 nll=1.1 accuracy=0.0391 | 9s\n")
    arith = _report(tmp_path)["arithmetic"]
    assert arith["sft"] == {"accuracy_by_step": [[100, 0.0312], [105, 0.0391]]} and arith["grpo"] == {}
