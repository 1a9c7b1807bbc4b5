"""Eval metrics: the unbiased pass@k equals its closed form, avg@k and maj@k (ties included) on
hand-made cases, and the answer extractors."""

from math import comb

import pytest

from miles.eval.metrics import (accuracy, avg_at_k, boxed, get_answer_fn, is_correct, last_number, maj_at_k, majority,
                                pass_at_k, prompt_metrics, stripped)


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n,c,k", [(10, 3, 1), (10, 3, 5), (10, 3, 8), (4, 0, 2), (4, 4, 2), (5, 2, 5), (5, 0, 5),
                                   (5, 5, 5), (1, 1, 1), (1, 0, 1), (200, 7, 50), (16, 1, 16)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)


def test_pass_at_k_edge_cases():
    assert pass_at_k(6, 0, 3) == 0.0            # no correct sample: never passes
    assert pass_at_k(6, 6, 3) == 1.0            # every sample correct
    assert pass_at_k(6, 1, 6) == 1.0            # n = k: passes iff any is correct
    assert pass_at_k(6, 0, 6) == 0.0
    assert pass_at_k(6, 2, 1) == pytest.approx(2 / 6)  # pass@1 is the share correct
    # large n stays finite where the binomials would be astronomically large
    assert 0 < pass_at_k(5000, 3, 100) < 1
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_avg_at_k_is_the_mean_of_the_first_k_scores():
    assert avg_at_k([1.0, 0.0, 0.5, 1.0], 2) == 0.5
    assert avg_at_k([1.0, 0.0, 0.5, 1.0], 4) == 0.625
    with pytest.raises(ValueError):
        avg_at_k([1.0], 2)


def test_maj_at_k_votes_and_breaks_ties_by_the_answer_given_first():
    # "7" wins 2-1: correct
    assert maj_at_k(["7", "8", "7"], [True, False, True], 3) == 1.0
    # tie 1-1: the first-given answer ("8", wrong) wins
    assert majority(["8", "7"]) == 0
    assert maj_at_k(["8", "7"], [False, True], 2) == 0.0
    assert maj_at_k(["7", "8"], [True, False], 2) == 1.0
    # samples without an answer do not vote; none at all scores 0
    assert maj_at_k([None, None, "7"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [True, True], 2) == 0.0
    # only the first k samples vote
    assert maj_at_k(["8", "7", "7"], [False, True, True], 1) == 0.0


def test_prompt_metrics_average_over_prompts():
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    answers = [["5", "6", "6", "5"], ["1", "2", "3", "4"]]
    correct = [[s > 0 for s in row] for row in scores]
    out = prompt_metrics(scores, correct, answers, [1, 4], ["pass", "avg", "maj"])
    assert out["pass@1"] == pytest.approx((closed_form(4, 2, 1) + 0) / 2)
    assert out["pass@4"] == pytest.approx(0.5)
    assert out["avg@1"] == 0.5 and out["avg@4"] == 0.25
    assert out["maj@4"] == 0.5   # prompt 0: tie 5/6 -> "5" (first) is correct; prompt 1: wrong
    assert accuracy([True, False, True, False]) == 0.5


def test_a_sample_is_correct_as_the_threshold_else_the_reward_else_a_positive_score_says():
    # A shaped reward's wrong-but-well-formed answer (0.1): not correct once the reward says so.
    assert is_correct(0.1) and not is_correct(0.1, correct=False) and not is_correct(0.0)
    assert is_correct(0.0, correct=True)
    # An eval config's threshold decides, whatever the reward says.
    assert not is_correct(0.1, correct=True, threshold=1.0) and is_correct(1.0, correct=False, threshold=1.0)
    # pass@k and maj@k count the verdicts, avg@k the scores: shaped scores [1.0, 0.1] per prompt.
    scores = [[1.0, 0.1], [0.1, 0.1]]
    verdicts = [[True, False], [False, False]]
    out = prompt_metrics(scores, verdicts, [["7", "8"], ["1", "1"]], [1, 2], ["pass", "avg", "maj"])
    assert out["pass@2"] == 0.5 and out["maj@2"] == 0.5 and out["avg@2"] == pytest.approx(0.325)


def test_answer_extractors():
    assert stripped("  42 \n") == "42" and stripped("  ") is None
    assert boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert boxed("no box") is None and boxed(r"\boxed{open") is None
    assert last_number("a 3, then 1,024 and -7.5!") == "-7.5"
    assert last_number("none") is None
    assert get_answer_fn("boxed") is boxed
    with pytest.raises(ValueError, match="answer extractor"):
        get_answer_fn("nope")
