"""The ledger: every prompt drawn from the source ends trained, retried or discarded with a reason.

Each drawn prompt index has exactly one current state. Terminal states are `trained` and
`discarded`; the others (`in_flight`, `buffered`, `retry_pending`) are pending work. The ledger
balances when drawn == trained + discarded + pending, which `check()` asserts after a run.
Event counters (how many times anything was retried, for which reason) are kept next to the states,
because one prompt may be retried several times before it ends, and so is the step that trained each
trained prompt: with it two runs (or a run and its resumed continuation) can be compared prompt by prompt.
"""

from __future__ import annotations

from collections import Counter

from miles.buffer.types import Reason

PENDING = ("in_flight", "buffered", "retry_pending")


class LedgerError(AssertionError):
    """The ledger does not balance: some prompt was lost or counted twice."""


class Ledger:
    def __init__(self):
        self.states: dict[int, str] = {}
        self.events: Counter[str] = Counter()
        self.trained_at: dict[int, int] = {}    # prompt index → the training step that used its group

    def _move(self, index: int, state: str, allowed_from: tuple[str | None, ...]) -> None:
        current = self.states.get(index)
        if current not in allowed_from:
            raise LedgerError(f"prompt {index} cannot go from {current!r} to {state!r}")
        self.states[index] = state

    def drawn(self, index: int) -> None:
        self._move(index, "in_flight", (None,))
        self.events["drawn"] += 1

    def readmitted(self, index: int) -> None:
        self._move(index, "in_flight", ("retry_pending",))

    def buffered(self, index: int) -> None:
        self._move(index, "buffered", ("in_flight",))

    def retried(self, index: int, reason: Reason) -> None:
        self._move(index, "retry_pending", ("in_flight", "buffered"))
        self.events[f"retried_{reason.value}"] += 1

    def discarded(self, index: int, reason: Reason) -> None:
        self._move(index, "discarded", ("in_flight", "buffered", "retry_pending"))
        self.events[f"discarded_{reason.value}"] += 1

    def trained(self, index: int, step: int) -> None:
        self._move(index, "trained", ("buffered",))
        self.events["trained"] += 1
        self.trained_at[index] = step

    def totals(self) -> dict[str, int]:
        by_state = Counter(self.states.values())
        out = {"drawn": len(self.states), "trained": by_state["trained"], "discarded": by_state["discarded"]}
        out.update({s: by_state[s] for s in PENDING})
        out["pending"] = sum(by_state[s] for s in PENDING)
        return out

    def check(self) -> dict[str, int]:
        """Assert that every drawn prompt is accounted for exactly once; returns the totals."""
        t = self.totals()
        if t["drawn"] != self.events["drawn"] or t["drawn"] != t["trained"] + t["discarded"] + t["pending"]:
            raise LedgerError(f"ledger does not balance: {t} with {self.events['drawn']} draws")
        discards = sum(v for k, v in self.events.items() if k.startswith("discarded_"))
        if discards != t["discarded"] or self.events["trained"] != t["trained"]:
            raise LedgerError(f"ledger events disagree with states: {dict(self.events)} vs {t}")
        return t

    def metrics(self) -> dict[str, float]:
        out = {f"buffer/{k}": float(v) for k, v in self.totals().items()}
        out.update({f"buffer/{k}": float(v) for k, v in self.events.items() if k != "drawn"})
        return out

    def state_dict(self) -> dict:
        return {"states": dict(self.states), "events": dict(self.events), "trained_at": dict(self.trained_at)}

    def load_state_dict(self, state: dict) -> None:
        self.states = {int(k): v for k, v in state["states"].items()}
        self.events = Counter(state["events"])
        self.trained_at = {int(k): v for k, v in state.get("trained_at", {}).items()}
