"""Dynamic sampling (docs/algorithm.md section 2.2): keep only groups whose accuracy is strictly between 0 and 1.

A group whose G responses are all correct (or all wrong) has identical rewards up to overlong shaping,
hence ~zero advantages and no gradient. The sampler over-generates, drops those groups and repeats
until `train_batch_size` informative groups are kept, for at most `max_num_gen_batches` rounds:

    sampler = DynamicSampler(train_batch_size=512, max_num_gen_batches=10, on_exhausted="raise")
    while not sampler.done:
        sampler.add_round(score(generate(next_prompts(gen_batch_size))))   # list of groups
    groups = sampler.take()          # exactly 512 groups (fewer only with on_exhausted="train")
    log(sampler.stats())             # rounds, groups seen / kept / filtered / surplus
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Generic, SupportsFloat, TypeVar, cast

__all__ = ["keep_group", "DynamicSampler", "SamplerStats", "group_accuracies"]


# one group of G scored responses: Sample records (anything with a float `.acc`) or numbers / bools
GroupT = TypeVar("GroupT", bound=Sequence[object])


def group_accuracies(group: Sequence[object]) -> list[float]:
    """The accuracies of one group: a list of Sample (their `.acc`) or of numbers / bools."""
    return [float(cast(SupportsFloat, getattr(item, "acc", item))) for item in group]


def keep_group(acc: Sequence[object]) -> bool:
    """True when the group is informative: 0 < number correct < G (its accuracies are not all equal).

    `acc` is the group's accuracies (1.0 correct / 0.0 wrong, or bools) or its Sample records. A group
    of one is never informative (G = 1 cannot hold both a correct and a wrong response)."""
    values = group_accuracies(acc)
    return len(values) >= 2 and min(values) != max(values)


@dataclass
class SamplerStats:
    rounds: int = 0  # generation rounds consumed
    groups_seen: int = 0
    groups_kept: int = 0  # informative groups kept (may exceed train_batch_size)
    groups_filtered: int = 0  # all-correct / all-wrong groups dropped by the filter
    # every all-correct / all-wrong group generated, filtered or (dynamic sampling off) trained on: what
    # the filter acts on, logged in every run so that runs with and without it compare (the tiny ladder)
    groups_all_correct: int = 0
    groups_all_wrong: int = 0
    groups_surplus: int = 0  # kept groups beyond train_batch_size, dropped by take()
    groups_returned: int = 0
    exhausted: bool = False  # stopped by max_num_gen_batches before the batch was full


class DynamicSampler(Generic[GroupT]):
    """Accumulates scored groups over generation rounds until `train_batch_size` groups are kept.

    enabled=False (no dynamic sampling) keeps every group. max_num_gen_batches=0 means unlimited.
    Past max_num_gen_batches rounds without a full batch, on_exhausted="raise" raises ValueError (from
    the round that used up the budget) and on_exhausted="train" ends sampling: take() returns the groups
    kept so far.
    """

    def __init__(
        self,
        *,
        train_batch_size: int,
        enabled: bool = True,
        max_num_gen_batches: int = 0,
        on_exhausted: str = "raise",
    ) -> None:
        if train_batch_size < 1:
            raise ValueError(f"DynamicSampler: train_batch_size={train_batch_size} must be >= 1")
        if max_num_gen_batches < 0:
            raise ValueError(f"DynamicSampler: max_num_gen_batches={max_num_gen_batches} must be >= 0 (0 = unlimited)")
        if on_exhausted not in ("raise", "train"):
            raise ValueError(f"DynamicSampler: on_exhausted={on_exhausted!r} is not allowed; choose 'raise' or 'train'")
        self.train_batch_size = train_batch_size
        self.enabled = enabled
        self.max_num_gen_batches = max_num_gen_batches
        self.on_exhausted = on_exhausted
        self._kept: list[GroupT] = []
        self._stats = SamplerStats()
        self._taken = False

    @property
    def is_full(self) -> bool:
        return len(self._kept) >= self.train_batch_size

    @property
    def exhausted(self) -> bool:
        return self._stats.exhausted

    @property
    def done(self) -> bool:
        """No more rounds are needed: the batch is full, or the round budget is spent (on_exhausted="train")."""
        return self.is_full or self.exhausted

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def add_round(self, groups: Sequence[GroupT]) -> int:
        """Add one generation round's scored groups; returns how many of them were kept."""
        if self._taken:
            raise ValueError(
                "DynamicSampler.add_round: this sampler's batch was already taken; make a new one per step"
            )
        if self.done:
            raise ValueError(
                f"DynamicSampler.add_round: sampling is done ({len(self._kept)} groups kept, "
                f"{self._stats.rounds} rounds); call take()"
            )
        st = self._stats
        st.rounds += 1
        kept_now = 0
        for group in groups:
            st.groups_seen += 1
            values = group_accuracies(group)
            if len(values) >= 2 and min(values) == max(values):
                st.groups_all_correct += int(bool(values[0]))
                st.groups_all_wrong += int(not values[0])
            if not self.enabled or keep_group(group):
                self._kept.append(group)
                kept_now += 1
            else:
                st.groups_filtered += 1
        st.groups_kept = len(self._kept)
        limit = self.max_num_gen_batches
        if not self.is_full and limit > 0 and st.rounds >= limit:
            st.exhausted = True
            if self.on_exhausted == "raise":
                raise ValueError(self._exhausted_message())
        return kept_now

    def take(self) -> list[GroupT]:
        """The training groups, in arrival order: exactly train_batch_size of them, or with
        on_exhausted="train" after exhaustion all that were kept. Surplus kept groups are dropped
        and counted in stats().groups_surplus."""
        if not self.done:
            raise ValueError(
                f"DynamicSampler.take: only {len(self._kept)} of {self.train_batch_size} groups kept so far; "
                "add rounds until .done"
            )
        if self._taken:
            raise ValueError("DynamicSampler.take: already taken")
        self._taken = True
        batch = self._kept[: self.train_batch_size]
        self._stats.groups_surplus = len(self._kept) - len(batch)
        self._stats.groups_returned = len(batch)
        self._kept = []
        return batch

    def stats(self) -> dict[str, int]:  # counts and the exhausted flag (a bool)
        return asdict(self._stats)

    def _exhausted_message(self) -> str:
        st = self._stats
        return (
            f"dynamic sampling kept only {st.groups_kept} of train_batch_size={self.train_batch_size} informative "
            f"groups after {st.rounds} generation rounds (algorithm.max_num_gen_batches={self.max_num_gen_batches}): "
            f"{st.groups_filtered} of {st.groups_seen} groups were all-correct or all-wrong. Raise "
            f"algorithm.max_num_gen_batches (0 = unlimited), raise rollout.gen_batch_size, use a task whose "
            f"difficulty suits the model (accuracy near 0 or 1 leaves few informative groups), or set "
            f"algorithm.on_gen_batches_exhausted=train to train on the groups kept."
        )
