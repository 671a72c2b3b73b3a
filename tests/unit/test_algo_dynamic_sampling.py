"""keep_group and DynamicSampler: the filter, rounds, surplus, and exhaustion (raise / train)."""

import pytest

from dapo_megatron.algo import DynamicSampler, keep_group
from dapo_megatron.dataplane.sample import Sample


def _sample(acc):
    return Sample(prompt_ids=[1], response_ids=[2], group_index=0, acc=acc)


def test_keep_group():
    assert keep_group([1, 0, 0, 0])
    assert keep_group([True, False])
    assert not keep_group([1, 1, 1, 1])  # all correct: zero advantage
    assert not keep_group([0.0, 0.0, 0.0])  # all wrong
    assert not keep_group([1.0])  # a group of one is never informative
    assert not keep_group([])
    assert keep_group([_sample(1.0), _sample(0.0)])
    assert not keep_group([_sample(0.0), _sample(0.0)])


MIXED, ALL_RIGHT, ALL_WRONG = [1, 0], [1, 1], [0, 0]


def test_fills_over_rounds_and_drops_surplus():
    sampler = DynamicSampler(train_batch_size=3, max_num_gen_batches=5)
    assert sampler.add_round([MIXED, ALL_RIGHT, ALL_WRONG, ALL_RIGHT]) == 1
    assert not sampler.done
    assert sampler.add_round([ALL_WRONG, [0, 1], [1, 0, 0], [0, 0, 1]]) == 3  # 4 kept, one too many
    assert sampler.is_full and sampler.done
    groups = sampler.take()
    assert groups == [MIXED, [0, 1], [1, 0, 0]]
    assert sampler.stats() == dict(
        rounds=2,
        groups_seen=8,
        groups_kept=4,
        groups_filtered=4,
        groups_all_correct=2,  # the two ALL_RIGHT of round 1
        groups_all_wrong=2,  # ALL_WRONG in each round
        groups_surplus=1,
        groups_returned=3,
        exhausted=False,
    )
    with pytest.raises(ValueError, match="already"):
        sampler.add_round([MIXED])


def test_disabled_keeps_every_group():
    sampler = DynamicSampler(train_batch_size=2, enabled=False)
    sampler.add_round([ALL_RIGHT, ALL_WRONG, MIXED])
    assert sampler.take() == [ALL_RIGHT, ALL_WRONG]
    assert sampler.stats()["groups_filtered"] == 0 and sampler.stats()["groups_surplus"] == 1
    # what the filter would act on is counted with the filter off too (the tiny ladder compares rungs by it)
    assert (sampler.stats()["groups_all_correct"], sampler.stats()["groups_all_wrong"]) == (1, 1)


def test_exhaustion_raises_with_advice():
    sampler = DynamicSampler(train_batch_size=4, max_num_gen_batches=2, on_exhausted="raise")
    sampler.add_round([MIXED, ALL_RIGHT])
    with pytest.raises(ValueError) as err:
        sampler.add_round([ALL_WRONG, ALL_WRONG])
    text = str(err.value)
    for needle in (
        "1 of train_batch_size=4",
        "after 2 generation rounds",
        "max_num_gen_batches=2",
        "gen_batch_size",
        "difficulty",
        "on_gen_batches_exhausted=train",
    ):
        assert needle in text


def test_exhaustion_train_returns_what_was_kept():
    sampler = DynamicSampler(train_batch_size=4, max_num_gen_batches=2, on_exhausted="train")
    sampler.add_round([MIXED, ALL_RIGHT])
    sampler.add_round([[1, 0, 1], ALL_WRONG])
    assert sampler.exhausted and sampler.done and not sampler.is_full
    assert sampler.take() == [MIXED, [1, 0, 1]]
    assert sampler.stats()["rounds"] == 2 and sampler.stats()["exhausted"]


def test_unlimited_rounds():
    sampler = DynamicSampler(train_batch_size=1, max_num_gen_batches=0)
    for _ in range(50):
        sampler.add_round([ALL_WRONG])
    assert not sampler.done
    sampler.add_round([MIXED])
    assert sampler.take() == [MIXED] and sampler.stats()["rounds"] == 51


def test_take_before_done_and_bad_arguments():
    sampler = DynamicSampler(train_batch_size=2)
    with pytest.raises(ValueError, match="0 of 2"):
        sampler.take()
    with pytest.raises(ValueError, match="on_exhausted"):
        DynamicSampler(train_batch_size=2, on_exhausted="retry")
    with pytest.raises(ValueError, match="train_batch_size"):
        DynamicSampler(train_batch_size=0)
