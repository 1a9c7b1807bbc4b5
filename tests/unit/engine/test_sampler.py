"""Sampler truncation and the pre-truncation logprob convention, on hand-made logits; the one
SamplingParams on the wire (client to_json -> engine parse)."""

from __future__ import annotations

import torch

from miles.engine_api.parsing import parse_sampling_params
from miles.engine_api.sampling import SamplingParams
from miles.engine.sampler import DRAW_BLOCK, SeededDraws, sample
from miles.rollout.generate import SamplingParams as ClientSamplingParams

LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])  # (1, V)


def _draw(params: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(sample(LOGITS, [params], [None], g)[0]) for _ in range(n)]


def test_greedy_takes_argmax_with_untempered_logprob():
    tok, lp = sample(LOGITS, [SamplingParams(temperature=0.0)], [None], torch.Generator())
    assert tok.tolist() == [0]
    assert torch.allclose(lp, torch.log_softmax(LOGITS, -1)[:, 0])


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(_draw(SamplingParams(top_k=2))) == {0, 1}
    # Probabilities ~ [.47, .29, .17, .06, .02, .003]: top_p 0.7 keeps the first two.
    assert set(_draw(SamplingParams(top_p=0.7))) == {0, 1}
    # min_p 0.3 keeps tokens with p >= 0.3 * 0.47.
    assert set(_draw(SamplingParams(min_p=0.3))) == {0, 1, 2}
    assert len(set(_draw(SamplingParams()))) >= 5


def test_logprob_ignores_truncation_but_follows_temperature():
    params = SamplingParams(temperature=0.5, top_k=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tok, lp = sample(LOGITS, [params], [None], g)
        assert torch.allclose(lp, torch.log_softmax(LOGITS / 0.5, -1)[0, tok])


def test_seeded_rows_do_not_depend_on_their_batch():
    p = SamplingParams(temperature=1.0)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    alone = [int(sample(LOGITS, [p], [g1], torch.Generator())[0][0]) for _ in range(30)]
    batch = LOGITS.repeat(3, 1)
    crowded = [int(sample(batch, [p, p, p], [None, g2, None], torch.Generator())[0][1]) for _ in range(30)]
    assert alone == crowded


def test_seeded_draws_are_the_generators_single_draws_in_order():
    g = torch.Generator().manual_seed(7)
    singles = [torch.rand(1, generator=g).item() for _ in range(3 * DRAW_BLOCK + 5)]
    draws = SeededDraws(7)
    assert [draws.next() for _ in singles] == singles


def test_a_batch_without_greedy_rows_draws_as_one_with_them():
    p, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    sampled = sample(logits[:3], [p] * 3, [SeededDraws(i) for i in range(3)], torch.Generator())
    mixed = sample(logits, [p] * 3 + [greedy], [SeededDraws(i) for i in range(3)] + [None], torch.Generator())
    assert torch.equal(sampled[0], mixed[0][:3]) and torch.equal(sampled[1], mixed[1][:3])


def test_clients_send_the_same_sampling_params_body_as_before():
    # Positional order temperature, top_p, top_k, max_new_tokens, as rollout code builds them.
    p = ClientSamplingParams(0.7, 0.9, 5, 32, seed=3, ignore_eos=True)
    assert p.to_json() == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 32,
                           "sampling_seed": 3, "ignore_eos": True}
    assert list(p.to_json()) == ["temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed", "ignore_eos"]
    assert ClientSamplingParams(max_new_tokens=8).to_json() == {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                                "max_new_tokens": 8}


def test_what_a_client_sends_is_what_the_engine_samples_with():
    every = SamplingParams(temperature=0.5, top_p=0.8, top_k=7, max_new_tokens=12, seed=9, ignore_eos=True,
                           min_p=0.1, stop=("\n\n", "END"), stop_token_ids=(4, 2), skip_special_tokens=False,
                           no_stop_trim=True)
    assert parse_sampling_params(every.to_json(), default_max_new_tokens=128) == every
    assert parse_sampling_params(SamplingParams(max_new_tokens=5).to_json(), 128) == SamplingParams(max_new_tokens=5)


def test_seeded_rows_draw_from_the_softmax_at_the_temperature():
    """Many rows, each seeded as the rollout seeds its samples (one seed per prompt and sample), one draw
    each: the tokens' frequencies are the softmax's probabilities (Pearson's chi-square over the tokens
    and a bin of the rare ones, far below the 0.1 % critical value), at two temperatures."""
    vocab, rows = 320, 6000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2.5
    for temperature in (1.0, 0.7):
        p = SamplingParams(temperature=temperature)
        seeds = [hash((0, i // 8, i % 8)) & 0x7FFFFFFF for i in range(rows)]
        tokens, _ = sample(logits.repeat(rows, 1), [p] * rows, [SeededDraws(s) for s in seeds], torch.Generator())
        counts = torch.bincount(tokens, minlength=vocab).double()
        probs = torch.softmax(logits[0].double() / temperature, dim=-1)
        expected = probs * rows
        big = expected >= 5  # a cell of the test: a token expected at least 5 times; the rest pooled
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        cells = torch.cat([expected[big], expected[~big].sum()[None]])
        chi2 = float(((observed - cells) ** 2 / cells).sum())
        dof = int(big.sum())  # cells - 1
        # The 0.1 % critical value of chi-square with k degrees of freedom is below k + 3.1 sqrt(2k) + 10.
        assert dof > 20, dof
        assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 10, (temperature, chi2, dof)
