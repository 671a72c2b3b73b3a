"""PromptStream: epochs are permutations, and a restored stream continues exactly where it was."""

import pytest

from dapo_megatron.data.stream import PromptStream


def test_each_epoch_is_a_permutation_and_epochs_differ():
    stream = PromptStream(list(range(10)), seed=3)
    first, second = stream.take(10), stream.take(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # a new shuffle per epoch (10! orders: equal by chance ~3e-7)
    assert stream.state_dict() == {"epoch": 1, "cursor": 10}


def test_restored_stream_continues_identically():
    whole = PromptStream(list("abcdefg"), seed=11)
    expected = whole.take(20)
    part = PromptStream(list("abcdefg"), seed=11)
    head = part.take(9)  # into the second epoch
    resumed = PromptStream(list("abcdefg"), seed=11).load_state_dict(part.state_dict())
    assert head + resumed.take(11) == expected


def test_no_shuffle_keeps_file_order_and_bad_state_is_refused():
    stream = PromptStream([5, 6, 7], seed=0, shuffle=False)
    assert stream.take(5) == [5, 6, 7, 5, 6]
    with pytest.raises(ValueError, match="cursor=9"):
        stream.load_state_dict({"epoch": 0, "cursor": 9})
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], seed=0)
