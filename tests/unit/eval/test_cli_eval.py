"""`miles eval CONFIG --model.path DIR` on the tiny model (the example config of docs/eval.md): a real
engine in a child `python -m miles.cli eval`, eval/accuracy and an eval set sampled n > 1 times,
written to --out and to metrics.jsonl."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]



def doc_config() -> str:
    """The runnable example of docs/eval.md, run as the page shows it."""
    text = (ROOT / "docs" / "eval.md").read_text()
    return re.search(r"<!-- file: eval.toml -->\n```toml\n(.*?)```", text, flags=re.S).group(1)


def test_miles_eval_writes_every_sets_metrics(tmp_path, tiny_model_dir):
    cfg = tmp_path / "eval.toml"
    cfg.write_text(doc_config())
    out = tmp_path / "out" / "metrics.json"
    cmd = [sys.executable, "-m", "miles.cli", "eval", str(cfg), "--model.path", tiny_model_dir, "--out", str(out),
           "--metrics-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    written = json.loads(out.read_text())
    assert printed == written and written["model"] == tiny_model_dir
    assert written["eval/num_prompts"] == 4 and 0 <= written["eval/accuracy"] <= 1
    for k in (1, 2, 4):
        for m in ("pass", "avg", "maj"):
            assert 0 <= written[f"eval/sampled/{m}@{k}"] <= 1
    # pass@k never falls as k grows
    assert written["eval/sampled/pass@1"] <= written["eval/sampled/pass@2"] <= written["eval/sampled/pass@4"]
    assert written["eval/sampled/num_prompts"] == 3 and 0 <= written["eval/sampled/accuracy"] <= 1
    assert "eval/three_digit/accuracy" in written and not any(k.startswith("eval/three_digit/pass@") for k in written)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and record["eval/sampled/pass@4"] == written["eval/sampled/pass@4"]


def test_miles_eval_refuses_a_bad_set_before_starting(tmp_path, tiny_model_dir):
    cfg = tmp_path / "eval.toml"
    cfg.write_text('[[eval.sets]]\nname = "x"\nn = 2\nk = [3]\n')
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "eval", str(cfg), "--model.path", tiny_model_dir],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "eval.sets[0] (x).k: 3 is outside 1..n" in proc.stderr


def test_miles_eval_without_a_config_file_takes_overrides_only(tmp_path, tiny_model_dir):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "eval", "--model.path", tiny_model_dir,
                           "--eval.num_prompts", "2", "--eval.max_new_tokens", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads(out.read_text())
    assert written["eval/num_prompts"] == 2 and not any(k.count("/") > 1 for k in written)
