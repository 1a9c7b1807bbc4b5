"""DataCursor: where a dataset source is in its rows, as state a checkpoint carries.

The order of epoch e is a permutation of the rows fixed by (seed, e), so (epoch, position) is the
whole shuffle state: a restored cursor draws exactly what the saved one would have drawn next.
Non-goal: which rows exist (source.py).
"""

from __future__ import annotations

import random


class DataExhausted(RuntimeError):
    """Every epoch the config allows has been drawn."""


class DataCursor:
    def __init__(self, num_rows: int, seed: int, shuffle: bool, num_epochs: int = 0):
        self.num_rows, self.seed, self.shuffle, self.num_epochs = num_rows, seed, shuffle, num_epochs
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> int:
        """The row index drawn next; moves to the next epoch (reshuffled) at the end of one."""
        if self.position >= self.num_rows:
            if self.num_epochs and self.epoch + 1 >= self.num_epochs:
                raise DataExhausted(f"the dataset's {self.num_epochs} epoch(s) of {self.num_rows} rows are "
                                    "used up; raise rollout.task.data.num_epochs (0 = unlimited) or train fewer steps")
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        row = self._order[self.position]
        self.position += 1
        return row

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(f"the checkpoint's data cursor is for {state['num_rows']} rows (seed {state['seed']}, "
                             f"shuffle {state['shuffle']}), this run's dataset has {self.num_rows} (seed "
                             f"{self.seed}, shuffle {self.shuffle}): resume with the run's own data and seed")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._order_of(self.epoch)
