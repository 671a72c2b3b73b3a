"""Chain sums (data/chain_task.py, synthetic level 6), the tiny ablation ladder's task: the worked and
direct responses, their lengths under the tiny tokenizer, the share of problems the 20-token budget
truncates, and the split and warm-start targets.

    pytest tests/unit/test_chain_task.py
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from dapo_megatron.data.chain_task import (
    CHAIN_LEVEL,
    direct_response,
    parse_terms,
    response_tokens,
    warm_start_responses,
    worked_response,
)
from dapo_megatron.data.synthetic import make_synthetic_task, synthetic_train_eval

BUDGET = 20  # configs/runs/tiny_chain.yaml: rollout.max_response_length


def test_worked_and_direct_responses_by_hand():
    assert worked_response("3+8+1+9+4=") == "11 12 21 Answer: 25"  # 3+8, +1, +9, then the answer
    assert worked_response("2+3=") == "Answer: 5"  # two terms: no middle sum
    assert worked_response("9+9+9+9+9+9=") == "18 27 36 45 Answer: 54"
    assert direct_response("3+8+1+9+4=") == "Answer: 25"
    # one token per character, plus EOS: 19 + 1, 9 + 1, 22 + 1
    assert [response_tokens(worked_response(p)) for p in ("3+8+1+9+4=", "2+3=", "9+9+9+9+9+9=")] == [20, 10, 23]


def test_response_tokens_counts_what_the_tiny_tokenizer_encodes():
    from dapo_megatron.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    for text in ("18 27 36 45 Answer: 54", "Answer: 5"):
        assert response_tokens(text) == len(tok.encode(text, add_special_tokens=False)) + 1


@pytest.mark.parametrize("bad", ["3+8", "3+=", "3*4=", "=", "12="])
def test_a_prompt_that_is_no_chain_sum_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="not a compact chain-sum prompt"):
        parse_terms(bad)


def _exact_share_over_budget() -> float:
    """P(worked response > BUDGET tokens) under the generator: k uniform in 2..6, terms uniform in 1..9,
    by enumerating every problem (only k = 6 can exceed: k = 5 is at most 3 x 3 + 10 + 1 = 20 tokens)."""
    share = 0.0
    for k in range(2, 7):
        over = sum(
            response_tokens(worked_response("+".join(map(str, terms)) + "=")) > BUDGET
            for terms in itertools.product(range(1, 10), repeat=k)
        )
        share += over / 9**k / 5
    return share


def test_the_budget_truncates_the_share_of_worked_responses_the_enumeration_says():
    exact = _exact_share_over_budget()
    # a 6-term worked response is 8 + 2 + 1 tokens plus (digits + 1) per running sum: over 20 as soon as two
    # of its four running sums have two digits, i.e. unless the first four terms sum to at most 9
    assert 0.19 < exact < 0.2  # 98.1% of the 6-term problems, a fifth of all: a sizeable tail, not most
    records = make_synthetic_task(4000, difficulty=CHAIN_LEVEL, seed=7, style="compact")
    over = sum(response_tokens(worked_response(r.prompt)) > BUDGET for r in records) / len(records)
    assert abs(over - exact) < 4 * math.sqrt(exact * (1 - exact) / len(records))  # 4 binomial sigmas


def test_terms_and_lengths_span_the_range():
    records = make_synthetic_task(4000, difficulty=CHAIN_LEVEL, seed=7, style="compact")
    counts = Counter(len(parse_terms(r.prompt)) for r in records)
    assert sorted(counts) == [2, 3, 4, 5, 6]
    assert all(abs(c / 4000 - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 4000) for c in counts.values())  # uniform k
    lengths = [response_tokens(worked_response(r.prompt)) for r in records]
    assert (min(lengths), max(lengths)) == (10, 23)
    assert all(r.ground_truth == str(sum(parse_terms(r.prompt))) for r in records)
    assert max(len(r.prompt) + 2 for r in records) <= 16  # + <|user|> <|assistant|>: max_prompt_length 16


def test_the_held_out_set_avoids_train_prompts_and_is_deterministic():
    train, held = synthetic_train_eval(num_train=2000, num_eval=200, difficulty=CHAIN_LEVEL, seed=1234, style="compact")
    assert len(held) == 200 and not {r.prompt for r in held} & {r.prompt for r in train}
    again = synthetic_train_eval(num_train=2000, num_eval=200, difficulty=CHAIN_LEVEL, seed=1234, style="compact")
    assert [r.prompt for r in again[1]] == [r.prompt for r in held]


def test_warm_start_targets_mix_worked_and_direct_deterministically():
    prompts = [r.prompt for r in make_synthetic_task(4000, difficulty=CHAIN_LEVEL, seed=3, style="compact")]
    targets = warm_start_responses(prompts, seed=1234)
    assert targets == warm_start_responses(prompts, seed=1234)
    direct = [t == direct_response(p) and t != worked_response(p) for p, t in zip(prompts, targets)]
    forms = {(p, t) for p, t in zip(prompts, targets)}
    assert len({p for p, _ in forms}) == len(forms)  # a repeated prompt keeps its form
    two_term = [len(parse_terms(p)) == 2 for p in prompts]  # worked == direct there: not counted
    share = sum(direct) / (len(prompts) - sum(two_term))
    assert abs(share - 0.25) < 0.03
    assert all(t in (worked_response(p), direct_response(p)) for p, t in zip(prompts, targets))
