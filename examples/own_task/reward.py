"""The example's reward, written as a user writes one (docs/rewards.md has the contract).

`digit_sum` receives the sample and returns a dict: `score` (1.0 for the exact answer) and two extra
metrics that miles logs as `reward/numeric` (the response is a whole number) and `reward/off_by`
(how far a numeric answer is from the label; 0 when it is not numeric).
"""


def digit_sum(sample):
    answer = sample.response.strip()
    numeric = answer.isdigit()
    off_by = abs(int(answer) - int(sample.label)) if numeric else 0
    return {"score": float(numeric and off_by == 0), "numeric": float(numeric), "off_by": float(off_by)}
