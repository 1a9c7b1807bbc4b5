"""TITO across turns: the trained sequence is exactly the engine's ids plus the observation ids."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from miles.buffer.types import SampleStatus
from miles.rollout.agent.episode import run_episode
from miles.rollout.config import AgentConfig
from miles.data.chat import ChatFormat
from miles.data.prompts import Prompt
from miles.rollout.environments.contract import StepResult
from miles.rollout.generate import SamplingParams
from tests.helpers.episodes import play_recorded

# Observations chosen to merge with neighbouring text when re-tokenized ("lo"+"w", digits, spaces).
OBSERVATIONS = ["low  ok", "er 12 34 ", "the output"]


class ScriptedEnv:
    """Three turns whatever the model says; records what it was shown."""

    def __init__(self, turns: int = 3, step_delay_s: float = 0.0):
        self.turns, self.delay, self.actions, self.closed = turns, step_delay_s, [], False

    def reset(self, task) -> str:
        return task.text

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay)
        self.actions.append(action)
        n = len(self.actions)
        return StepResult(observation=OBSERVATIONS[(n - 1) % 3], reward=0.5 * (n == self.turns), done=n >= self.turns)

    def close(self) -> None:
        self.closed = True


def scripted_env():
    return ScriptedEnv()


def _play(url, tokenizer, env, cfg, seed=11, max_new_tokens=12):
    return play_recorded(lambda client: run_episode(
        client, url, tokenizer, env, Prompt(index=4, text="hello there", label="x"),
        SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed), cfg, rid="tito"), timeout=60)


def test_trajectory_is_engine_output_plus_observation_tokens(agent_engine_url, agent_tokenizer):
    tok = agent_tokenizer
    env = ScriptedEnv()
    sample, exchanges = _play(agent_engine_url, tok, env, AgentConfig(max_turns=5, max_response_tokens=400))
    fmt = ChatFormat(tok)
    assert len(exchanges) == 3 and env.closed
    expected, mask, logprobs = [], [], []
    for turn, (request, reply) in enumerate(exchanges):
        # Each turn's input is the prompt plus everything so far, as ids: nothing was re-tokenized.
        assert request["input_ids"] == sample.prompt_ids + expected
        out = reply["output_ids"]
        expected += out
        mask += [1] * len(out)
        logprobs += [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        if turn < 2:
            obs = fmt.observation_ids(OBSERVATIONS[turn], closed=out[-1] == fmt.end_id)
            expected += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
    assert sample.response_ids == expected
    assert sample.loss_mask == mask and sample.rollout_logprobs == pytest.approx(logprobs)
    assert sample.prompt_ids == tok(tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                            add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False).input_ids
    assert len(sample.weight_versions) == 3 and sample.reward == 0.5 and sample.status == SampleStatus.COMPLETED
    # The model's turns are what the environment saw, decoded without special tokens.
    assert env.actions[0] == tok.decode([t for t in exchanges[0][1]["output_ids"] if t != fmt.end_id],
                                        skip_special_tokens=True)
    # This tokenizer is not decode→encode stable on this trajectory, so re-tokenizing would have changed it.
    full = sample.prompt_ids + sample.response_ids
    assert tok(tok.decode(full), add_special_tokens=False).input_ids != full


def test_decode_encode_is_not_the_identity_for_this_tokenizer(agent_tokenizer):
    tok = agent_tokenizer
    merged = next(t for t in tok.get_vocab() if len(t) >= 3 and t.isalpha() and t.isascii())  # e.g. "ist"
    ids = [tok.convert_tokens_to_ids(c) for c in merged]  # a valid but non-canonical split of it
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids(merged)] != ids


def test_turn_budget_truncates_and_is_reported(agent_engine_url, agent_tokenizer):
    sample, exchanges = _play(agent_engine_url, agent_tokenizer, ScriptedEnv(turns=10),
                              AgentConfig(max_turns=2, max_response_tokens=400))
    assert sample.status == SampleStatus.TRUNCATED and len(exchanges) == 2 and sample.reward == 0.0
    sample, _ = _play(agent_engine_url, agent_tokenizer, ScriptedEnv(turns=10),
                      AgentConfig(max_turns=10, max_response_tokens=30))
    assert sample.status == SampleStatus.TRUNCATED and len(sample.response_ids) <= 30


def test_episode_timeout_aborts_and_closes_the_environment(agent_engine_url, agent_tokenizer):
    env = ScriptedEnv(turns=10, step_delay_s=0.4)
    t0 = time.monotonic()
    sample, _ = _play(agent_engine_url, agent_tokenizer, env, AgentConfig(max_turns=10, episode_timeout_s=1.0))
    assert sample.status == SampleStatus.ABORTED and env.closed
    assert time.monotonic() - t0 < 5
    # What was generated before the timeout is kept consistent, never half a turn.
    assert len(sample.response_ids) == len(sample.loss_mask) == len(sample.rollout_logprobs)


def test_episode_keeps_the_routed_experts_of_its_whole_history(tiny_moe_model_dir):
    """MoE + routing replay: the last turn's request held the whole history, so its routed experts
    cover every token of the episode the engine was fed."""
    from miles.models.loading import load_tokenizer
    from miles.models.moe import decode_routed_experts
    from miles.engine.config import EngineConfig
    from miles.engine.server import start_server_thread

    server = start_server_thread(EngineConfig(model_path=tiny_moe_model_dir))
    tok = load_tokenizer(tiny_moe_model_dir)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                return await run_episode(client, server.url, tok, ScriptedEnv(), Prompt(index=1, text="hi", label="x"),
                                         SamplingParams(temperature=1.0, max_new_tokens=8, seed=3),
                                         AgentConfig(max_turns=5, max_response_tokens=400), rid="moe",
                                         return_routed_experts=True)
        sample = asyncio.run(main())
    finally:
        server.stop()
    assert sample.status == SampleStatus.COMPLETED and 0 in sample.loss_mask  # observations in between
    routed = decode_routed_experts(sample.routed_experts, 4, 2)
    assert routed.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1, 4, 2)
