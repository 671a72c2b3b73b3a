"""An endless, resumable stream of prompts: epoch-wise shuffles from (seed, epoch), a cursor.

    stream = PromptStream(records, seed=42, shuffle=True)
    batch = stream.take(512)
    state = stream.state_dict()          # {"epoch": e, "cursor": c}: saved with each checkpoint
    PromptStream(records, seed=42, shuffle=True).load_state_dict(state)   # continues exactly there

The order of epoch e is a permutation drawn from a generator seeded with (seed, e), so it does not
depend on how many prompts were drawn before: a resumed run sees the same prompts in the same order
as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class PromptStream(Generic[T]):
    def __init__(self, records: Sequence[T], *, seed: int, shuffle: bool = True) -> None:
        if not records:
            raise ValueError("PromptStream: the prompt set is empty (check data.train_path / data.synthetic)")
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=gen).tolist()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        record = self.records[self._order[self.cursor]]
        self.cursor += 1
        return record

    def take(self, num: int) -> list[T]:
        return [next(self) for _ in range(num)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> PromptStream[T]:
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if not 0 <= cursor <= len(self.records):
            raise ValueError(
                f"PromptStream state cursor={cursor} is outside 0..{len(self.records)} "
                "(was the checkpoint made with another prompt set?)"
            )
        self.epoch, self.cursor, self._order = epoch, cursor, self._order_of(epoch)
        return self
