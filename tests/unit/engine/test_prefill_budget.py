"""max_prefill_tokens spreads a burst of prompts over several prefills, with the running rows decoding
between them, and changes no output."""

from __future__ import annotations

from miles.engine_api.sampling import SamplingParams
from miles.engine.config import EngineConfig
from miles.engine.engine import Engine

PROMPTS = [list(range(10 * i + 3, 10 * i + 18)) for i in range(4)]  # 4 distinct prompts of 15 tokens


def _burst(model_dir, budget: int, prompts=PROMPTS):
    engine = Engine(EngineConfig(model_path=model_dir, max_prefill_tokens=budget, prefix_cache=False))
    try:
        engine.pause("in_place")  # the whole burst waits, then arrives in one admission
        futs = [engine.submit(engine.make_request(p, SamplingParams(temperature=0, max_new_tokens=6))) for p in prompts]
        engine.continue_generation()
        return [f.result(60).output_ids for f in futs], engine.stats["prefill_forwards"]
    finally:
        engine.stop()


def test_a_burst_beyond_the_budget_is_prefilled_over_several_steps(model_dir):
    together, one = _burst(model_dir, 0)
    spread, four = _burst(model_dir, 20)
    assert (one, four) == (1, 4)
    assert spread == together


def test_copies_of_a_prompt_count_once_against_the_budget(model_dir):
    """A GRPO group's samples share their prompt, which the prefill computes once: 4 groups of 3 copies
    of a 15-token prompt, within a 20-token budget, take 4 prefills (one per group), not 12."""
    groups = [p for p in PROMPTS for _ in range(3)]
    together, one = _burst(model_dir, 0, groups)
    spread, four = _burst(model_dir, 20, groups)
    assert (one, four) == (1, 4)
    assert spread == together
