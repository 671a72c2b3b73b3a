"""avg@k and the unbiased pass@k estimator against hand-computed values and a brute-force count."""

import itertools
import math
import random

import pytest
import torch

from dapo_megatron.trainer.evaluation.sampling import avg_at_k, pass_at_k, summarize


def test_avg_at_k_hand_computed():
    # per-problem accuracy 2/4, 4/4, 0/4, 1/4 -> mean (0.5 + 1 + 0 + 0.25) / 4 = 0.4375
    correct = [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]]
    assert avg_at_k(correct) == pytest.approx(0.4375, abs=1e-12)
    assert avg_at_k(torch.tensor(correct, dtype=torch.bool)) == pytest.approx(0.4375, abs=1e-12)


def test_pass_at_k_hand_computed():
    # n = 4 samples per problem; pass@k = 1 - C(n - c, k) / C(n, k)
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    # k = 2: c=1 -> 1 - 3/6 = 0.5; c=2 -> 1 - 1/6 = 5/6; c=0 -> 0; c=4 -> 1; c=3 -> 1 (n - c = 1 < k)
    assert pass_at_k(correct, k=2).tolist() == pytest.approx([0.5, 5 / 6, 0.0, 1.0, 1.0], abs=1e-12)
    # k = 1 is the per-problem accuracy c / n
    assert pass_at_k(correct, k=1).tolist() == pytest.approx([0.25, 0.5, 0.0, 1.0, 0.75], abs=1e-12)
    # k = n: 1 if any sample is correct
    assert pass_at_k(correct, k=4).tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0, 1.0], abs=1e-12)


def test_pass_at_k_equals_subset_enumeration():
    """pass@k is the fraction of the C(n, k) size-k subsets of the samples that hold a correct one."""
    rng = random.Random(0)
    for n, k in [(5, 2), (6, 3), (7, 1), (8, 5)]:
        row = [rng.random() < 0.3 for _ in range(n)]
        hits = sum(any(row[i] for i in subset) for subset in itertools.combinations(range(n), k))
        expected = hits / math.comb(n, k)
        assert float(pass_at_k([row], k=k)[0]) == pytest.approx(expected, abs=1e-12)


def test_summarize_names_and_values():
    correct = [[1, 0, 0, 0], [1, 1, 0, 0]]
    out = summarize(correct, ks=(1, 2))
    assert set(out) == {"avg@4", "pass@1", "pass@2", "pass@4"}
    assert out["avg@4"] == pytest.approx(0.375)
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert out["pass@4"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad, match", [([[0.5, 1.0]], "only 0/1"), ([], "non-empty"), ([1, 0], "table")])
def test_bad_tables_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        avg_at_k(bad)


def test_k_larger_than_samples_raises():
    with pytest.raises(ValueError, match="k=5 must be in"):
        pass_at_k([[1, 0, 1]], k=5)
