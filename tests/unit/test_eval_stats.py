"""algo/eval_stats.py against hand-computed values: unbiased pass@j (small n, and n = 32 against exact
fractions), the maj@k tie rule, the bootstrap interval on a fixed seed, and the paired comparison."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from dapo_megatron.algo.eval_stats import (
    bootstrap_mean_ci,
    bootstrap_means,
    majority_correct,
    paired_bootstrap_diff,
    pass_at_k,
    pass_ks,
)


def test_pass_at_j_small_n_by_hand():
    # n = 5 samples, c = 2 correct: pass@j = 1 - C(3, j) / C(5, j)
    row = [[1, 0, 1, 0, 0]]
    assert float(pass_at_k(row, k=1)[0]) == pytest.approx(2 / 5, abs=1e-15)  # 1 - 3/5
    assert float(pass_at_k(row, k=2)[0]) == pytest.approx(1 - 3 / 10, abs=1e-15)  # C(3,2)=3, C(5,2)=10
    assert float(pass_at_k(row, k=3)[0]) == pytest.approx(1 - 1 / 10, abs=1e-15)  # C(3,3)=1, C(5,3)=10
    assert float(pass_at_k(row, k=4)[0]) == 1.0  # n - c = 3 < 4
    # n = 3, c = 0 and c = 3: never / always
    assert pass_at_k([[0, 0, 0], [1, 1, 1]], k=2).tolist() == [0.0, 1.0]


def test_pass_at_j_n32_equals_exact_binomials():
    """The product form at n = 32 against exact rational 1 - C(n-c, j)/C(n, j), every c and j reported;
    by hand: c = 1, j = 16 -> 1 - 16/32 = 0.5; c = 2, j = 16 -> 1 - (16 * 15) / (32 * 31) = 1 - 240/992."""
    n = 32
    table = torch.tensor([[1.0] * c + [0.0] * (n - c) for c in range(n + 1)], dtype=torch.float64)
    for j in pass_ks(n):
        got = pass_at_k(table, k=j).tolist()
        for c in range(n + 1):
            exact = 1 - Fraction(math.comb(n - c, j), math.comb(n, j))
            assert got[c] == pytest.approx(float(exact), abs=1e-14), (c, j)
    assert float(pass_at_k(table[1:2], k=16)[0]) == pytest.approx(0.5, abs=1e-15)
    assert float(pass_at_k(table[2:3], k=16)[0]) == pytest.approx(1 - 240 / 992, abs=1e-15)


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32]


def test_majority_vote_and_its_tie_rule():
    # a clear majority: the most frequent answer decides
    assert majority_correct(["7", "9", "9"], [1, 0, 0]) == 0.0
    assert majority_correct(["7", "7", "9"], [1, 1, 0]) == 1.0
    # tie 2-2 between "7" (right) and "9" (wrong); the 3 responses without an answer do not vote -> 1/2
    answers = ["7", "9", "[INVALID]", "7", "[INVALID]", "9", "[INVALID]"]
    correct = [1, 0, 0, 1, 0, 0, 0]
    assert majority_correct(answers, correct, abstain="[INVALID]") == 0.5
    assert majority_correct(list(reversed(answers)), list(reversed(correct)), abstain="[INVALID]") == 0.5  # order-free
    # counted as an answer, "[INVALID]" (3 votes) would win and score 0
    assert majority_correct(answers, correct) == 0.0
    # a three-way tie with one right answer -> 1/3; nothing to vote on -> 0
    assert majority_correct(["1", "2", "3"], [0, 1, 0]) == pytest.approx(1 / 3)
    assert majority_correct(["[INVALID]"] * 2, [0, 0], abstain="[INVALID]") == 0.0
    with pytest.raises(ValueError, match="2 answers but 1"):
        majority_correct(["1", "2"], [1])


def test_bootstrap_interval_by_hand():
    # two problems scored 0 and 1: a resample's mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% points of 2000 resamples are 0 and 1
    assert bootstrap_mean_ci([0.0, 1.0]) == (0.0, 1.0)
    # every problem alike: no spread
    assert bootstrap_mean_ci([0.375] * 30) == (0.375, 0.375)


def test_bootstrap_interval_on_a_fixed_seed():
    """The documented rule, redone here by hand: idx = randint(0, P, (B, P)) from manual_seed(seed),
    the B means sorted, [sorted[floor(0.025 B)], sorted[ceil(0.975 B) - 1]] = [sorted[50], sorted[1949]]."""
    values = [0.0, 0.25, 0.5, 1.0]
    idx = torch.randint(0, 4, (2000, 4), generator=torch.Generator().manual_seed(0)).tolist()
    means = sorted(sum(values[i] for i in row) / 4 for row in idx)
    assert bootstrap_mean_ci(values, resamples=2000, seed=0) == (means[50], means[1949])
    # the numbers on seed 0 (means of four values from {0, 1/4, 1/2, 1} are multiples of 1/16)
    assert bootstrap_mean_ci(values, resamples=2000, seed=0) == (0.125, 0.8125)
    assert bootstrap_means(values, resamples=3, seed=0).tolist() == pytest.approx(
        [sum(values[i] for i in row) / 4 for row in idx[:3]]
    )
    assert bootstrap_means(values, seed=1).tolist() != bootstrap_means(values, seed=0).tolist()  # the seed is used


def test_paired_comparison():
    # the same shift on every problem: B is better on every resample, although the unpaired intervals overlap
    a, b = [0.25, 0.5, 0.0, 0.75], [0.5, 0.75, 0.25, 1.0]
    lo_a, hi_a = bootstrap_mean_ci(a)
    lo_b, hi_b = bootstrap_mean_ci(b)
    assert lo_b < hi_a  # unpaired: the two intervals overlap
    assert paired_bootstrap_diff(a, b) == {"diff": 0.25, "low": 0.25, "high": 0.25, "verdict": "B better"}
    assert paired_bootstrap_diff(b, a)["verdict"] == "B worse"
    # per-problem differences 1 and 0: a resample's mean difference is 0, 1/2 or 1 -> [0, 1], no verdict
    assert paired_bootstrap_diff([0.0, 1.0], [1.0, 1.0]) == {
        "diff": 0.5,
        "low": 0.0,
        "high": 1.0,
        "verdict": "no clear difference",
    }
    with pytest.raises(ValueError, match="3 problems in A but 2 in B"):
        paired_bootstrap_diff([0, 0, 0], [1, 1])
