"""The example in docs/data.md runs as written: the script writes the verl parquet file, the run
config loads, its rows pass the pre-start check and become chat prompts with labels and metadata."""

import re
import runpy
from pathlib import Path

from tests.helpers.docs_examples import example_files

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_data_page_example_loads_into_prompts(tmp_path, monkeypatch, tiny_model_dir):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.data.preflight import check_dataset
    from miles.models.loading import load_tokenizer
    from miles.data.prompts import PromptSource

    monkeypatch.chdir(tmp_path)
    (tmp_path / "make_data.py").write_text(example_files("data.md")["make_data.py"])
    runpy.run_path("make_data.py")
    toml = re.search(r"<!-- file: data_run.toml -->\n```toml\n(.*?)```", (DOCS / "data.md").read_text(), re.S)
    (tmp_path / "data_run.toml").write_text(toml.group(1))
    cfg = load_config(RunConfig, "data_run.toml", {"model.path": tiny_model_dir, "loop.num_steps": "2"})
    assert check_dataset(cfg.rollout.task, load_tokenizer(tiny_model_dir), tiny_model_dir, None) == {"train": 36, "eval": 4}
    prompts = PromptSource(cfg.rollout.task, "train", cfg.run.seed).take(40)  # past one epoch
    p = prompts[0]
    assert p.messages[0]["role"] == "user" and p.label == str(int(p.text.split()[2]) * 2 + 1)
    assert set(p.metadata) == {"data_source", "ability", "extra_info"}
    assert len({q.text for q in prompts[:36]}) == 36
