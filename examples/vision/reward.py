"""The example's reward (docs/rewards.md has the contract): 1.0 when the answer is the number of
dots, and `reward/number` (the answer is a number 1-4 at all) as an extra metric."""


def count_dots(sample):
    answer = sample.response.strip()
    return {"score": float(answer == sample.label), "number": float(answer in ("1", "2", "3", "4"))}
