"""The answer extractor example of docs/eval.md loads by module:function, as a run config names it."""

from tests.helpers.docs_examples import importable_examples


def test_user_answer_extractor_loads_from_a_run_config(tmp_path):
    from miles.config import load_config
    from miles.run_config import RunConfig
    from miles.eval.metrics import get_answer_fn

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    with importable_examples("eval.md", tmp_path) as files:
        assert set(files) == {"my_answers.py"}
        cfg = tmp_path / "run.toml"
        cfg.write_text(f'[model]\npath = "{model}"\n[[eval.sets]]\nname = "w"\nanswer = "my_answers:first_word"\n')
        assert load_config(RunConfig, cfg).eval.sets[0].answer == "my_answers:first_word"
        fn = get_answer_fn("my_answers:first_word")
        assert fn(" 42 is it") == "42" and fn("  ") is None
