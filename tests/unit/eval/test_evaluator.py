"""The Evaluator behind RolloutManager.evaluate, on a real in-process engine with the tiny model:
eval/accuracy is greedy accuracy computed as before eval sets existed, each set's figures are
reproducible across evaluations, a plugged-in generate function scores with the set's reward, and a
shaped reward's partial credit is not counted as correct once the reward (or the config) says what is."""

import functools
import textwrap

import pytest

from miles.data.prompts import PromptSource, TaskConfig
from miles.eval.config import EvalConfig, EvalSetConfig
from miles.eval.evaluator import Evaluator
from miles.rollout.config import RolloutConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=tiny_model_dir))
    yield server
    server.stop()


def manager(tiny_model_dir, engine, eval_cfg, **rollout):
    from miles.rollout.manager import RolloutManager

    # As the driver does: the evaluator is chosen here and built on the manager's group generator.
    return RolloutManager(RolloutConfig(max_new_tokens=4, **rollout), tiny_model_dir, [engine.url], seed=3,
                          evaluator=functools.partial(Evaluator, eval_cfg))


def test_eval_accuracy_is_greedy_accuracy_as_before(tiny_model_dir, engine):
    import httpx

    from miles.models.loading import load_tokenizer
    from miles.rollout.reward import exact_match

    m = manager(tiny_model_dir, engine, EvalConfig(num_prompts=6, max_new_tokens=4))
    prefills = engine.engine.stats["prefill_forwards"]
    out = m.evaluate()
    # Every prompt in one POST (rollout.merge_requests), so the engine admits them in one prefill.
    assert m.groups.merger.posts == 1 and engine.engine.stats["prefill_forwards"] - prefills == 1
    # the pre-eval-sets computation: greedy /generate per prompt, exact_match > 0, over the prompts
    tok = load_tokenizer(tiny_model_dir)
    prompts = PromptSource(TaskConfig(), "eval", 3).take(6)
    correct = 0
    for p in prompts:
        body = {"input_ids": tok(p.text, add_special_tokens=False).input_ids,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}}
        text = httpx.post(engine.url + "/generate", json=body, timeout=60).json()["text"]
        correct += exact_match(text, p.label) > 0
    assert out["eval/accuracy"] == correct / 6 and out["eval/num_prompts"] == 6
    assert not any(k.count("/") > 1 for k in out)  # no sets, no set metrics


def test_eval_sets_are_reported_and_reproducible(tiny_model_dir, engine):
    sets = [EvalSetConfig(name="s", num_prompts=3, n=3, k=[1, 3], max_new_tokens=4, reward="text_parity"),
            EvalSetConfig(name="d3", num_prompts=2, n=0, task=TaskConfig(digits=3))]
    m = manager(tiny_model_dir, engine, EvalConfig(num_prompts=2, max_new_tokens=4, sets=sets))
    first, second = m.evaluate(), m.evaluate()
    keys = {f"eval/s/{m}@{k}" for m in ("pass", "avg", "maj") for k in (1, 3)}
    assert keys <= set(first) and "eval/s/accuracy" in first and "eval/d3/accuracy" in first
    assert {k: first[k] for k in keys} == {k: second[k] for k in keys}  # seeded samples
    assert first["eval/s/pass@1"] <= first["eval/s/pass@3"]
    # text_parity scores odd-length responses: sampled responses of an untrained model have both
    assert 0 <= first["eval/s/avg@3"] <= 1


def test_a_plugged_in_generate_function_scores_with_the_sets_reward(tiny_model_dir, engine, tmp_path, monkeypatch):
    (tmp_path / "eval_user_gen.py").write_text(textwrap.dedent("""
        from miles.rollout.generate import generate

        async def gen(ctx, prompt, params, rid):
            s = await generate(ctx.client, ctx.url, ctx.encode(prompt.text), params, label=prompt.label)
            s.reward = ctx.reward_fn(s.response_text, s.label)
            return s

        def one(response, label):
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = [EvalSetConfig(name="one", num_prompts=2, n=2, max_new_tokens=4, reward="eval_user_gen:one")]
    m = manager(tiny_model_dir, engine, EvalConfig(num_prompts=2, max_new_tokens=4, sets=sets),
                generate_fn="eval_user_gen:gen")
    out = m.evaluate()
    assert out["eval/one/accuracy"] == 1.0 and out["eval/one/pass@2"] == 1.0 and out["eval/one/avg@2"] == 1.0


SHAPED = """
def shaped(response, label):
    # Every answer earns 0.1 for its form; the verdict follows the label alone, so the test can count
    # the right ones without knowing what the untrained model says.
    right = int(label) % 2 == 0
    return {"score": 1.0 if right else 0.1, "correct": right}

def shaped_float(response, label):
    return 1.0 if int(label) % 2 == 0 else 0.1
"""


def test_a_shaped_reward_that_says_correct_gets_accuracy_as_the_share_of_correct(tiny_model_dir, engine, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "eval_shaped.py").write_text(SHAPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = dict(num_prompts=6, n=2, k=[2], metrics=["pass"], max_new_tokens=4)
    sets = [EvalSetConfig(name="said", reward="eval_shaped:shaped", **common),
            EvalSetConfig(name="threshold", reward="eval_shaped:shaped_float", correct_threshold=1.0, **common),
            EvalSetConfig(name="plain", reward="eval_shaped:shaped_float", **common)]
    m = manager(tiny_model_dir, engine, EvalConfig(num_prompts=6, max_new_tokens=4, sets=sets),
                reward="eval_shaped:shaped")
    out = m.evaluate()
    labels = [p.label for p in PromptSource(TaskConfig(), "eval", 3).take(6)]
    share = sum(int(label) % 2 == 0 for label in labels) / 6
    assert 0 < share < 1  # the two rules give different figures here
    # rollout.reward returns `correct`: eval/accuracy is the share of right answers, not of score > 0
    assert out["eval/accuracy"] == share
    for name in ("said", "threshold"):
        assert out[f"eval/{name}/accuracy"] == share and out[f"eval/{name}/pass@2"] == share
    # without either, the rule stays score > 0, which counts every 0.1 as correct
    assert out["eval/plain/accuracy"] == 1.0 and out["eval/plain/pass@2"] == 1.0


def test_eval_prompts_made_of_messages_go_through_the_chat_template(tiny_model_dir):
    from types import SimpleNamespace

    from miles.data.chat import encode_prompt
    from miles.models.loading import load_tokenizer
    from miles.data.prompts import Prompt, TaskConfig

    tok = load_tokenizer(tiny_model_dir)
    task = TaskConfig(name="dataset", system_prompt="Answer briefly.")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    evaluator = Evaluator.__new__(Evaluator)  # only the encoding is under test
    evaluator.groups = SimpleNamespace(tokenizer=tok, vision=None)  # a text model
    ids = evaluator._encode(Prompt(index=0, text="What is 2+3?", label="5", messages=messages), task)
    rendered = tok.apply_chat_template([{"role": "system", "content": "Answer briefly."}, *messages],
                                       add_generation_prompt=True, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False).input_ids == encode_prompt(tok, task, "", messages)
    assert ids != tok("What is 2+3?", add_special_tokens=False).input_ids
