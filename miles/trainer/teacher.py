"""The distillation teacher's compatibility with the policy: its tokenizer must be the policy's.

The teacher itself is a frozen model the trainer runs next to the policy (the frozen-model wrapper of
trainer/reference.py, loaded once from the teacher's checkpoint and never refreshed, so it never
receives weight updates). Token ids are compared, not text: the teacher scores the student's exact
token ids, so both must mean the same thing by every id. Runs at config time (no torch).
The same check guards teachers served by engines (rollout/teacher.py).
"""

from __future__ import annotations

from miles.models.loading import load_tokenizer


def tokenizer_mismatch(student_path: str, teacher_path: str) -> str | None:
    """Why the two checkpoints' tokenizers differ (None if they match id for id)."""
    s, t = load_tokenizer(student_path), load_tokenizer(teacher_path)
    sv, tv = s.get_vocab(), t.get_vocab()
    if len(sv) != len(tv):
        return f"the student's vocabulary has {len(sv)} tokens, the teacher's {len(tv)}"
    differ = sorted(tok for tok in sv if tv.get(tok) != sv[tok])
    if differ:
        first = differ[0]
        return f"{len(differ)} tokens have other ids in the teacher (e.g. {first!r}: {sv[first]} vs {tv.get(first)})"
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(s, name) != getattr(t, name):
            return f"{name} is {getattr(s, name)} for the student and {getattr(t, name)} for the teacher"
    return None

