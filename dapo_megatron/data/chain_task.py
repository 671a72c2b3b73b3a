"""Chain sums: the tiny ablation ladder's task (configs/ablations_tiny/), synthetic level 6.

    "3+8+1+9+4="  ->  worked:  "11 12 21 Answer: 25"     (the running sums, then the answer)
                  ->  direct:  "Answer: 25"

A problem adds k single-digit terms (1..9), k uniform in MIN_TERMS..MAX_TERMS. The warm start
(data/tiny_model.py) teaches the worked form on most train problems and the direct form on a fixed
DIRECT_FRACTION of them, so the warm model writes either. What makes it a ladder task:

* variable length: a worked response is 8 + len(answer) + 1 (EOS) tokens plus one running sum and
  a space per middle term: 11 tokens at k=2, up to 23 at k=6 (every digit and space is a token);
* a budget that real responses exceed: configs/ablations_tiny/ cap responses at 20 tokens, so the worked
  form of 98.1% of the k=6 problems (19.6% of all problems; enumerated in tests/unit/test_chain_task.py)
  is truncated (no `Answer:`, reward -1) and the long worked k=5 ones sit in the soft-punishment
  buffer; only the direct form answers those within the budget;
* a hard tail: direct sums of 5-6 terms are what the 0.4M-parameter model gets wrong most, while
  short worked sums are mostly right, so groups are all-wrong, mixed and (as RL sharpens) all-right;
* headroom: the warm start's label smoothing keeps per-token accuracy near 1 - eps, so accuracy
  falls with length ((1 - eps)^L) and RL has tens of points to gain.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

__all__ = [
    "CHAIN_LEVEL",
    "MIN_TERMS",
    "MAX_TERMS",
    "DIRECT_FRACTION",
    "chain_problem",
    "parse_terms",
    "worked_response",
    "direct_response",
    "response_tokens",
    "warm_start_responses",
]

CHAIN_LEVEL = 6  # data.synthetic.difficulty of this task
MIN_TERMS, MAX_TERMS = 2, 6
DIRECT_FRACTION = 0.25  # of the warm start's train problems taught in the direct form


def chain_problem(rng: random.Random) -> tuple[list[int | str], int]:
    """Tokens of one expression ([3, "+", 8, ...]) and its value, as data/synthetic.py's levels return."""
    k = rng.randint(MIN_TERMS, MAX_TERMS)
    terms = [rng.randint(1, 9) for _ in range(k)]
    tokens: list[int | str] = []
    for i, term in enumerate(terms):
        tokens.extend(([] if i == 0 else ["+"]) + [term])
    return tokens, sum(terms)


def parse_terms(prompt: str) -> list[int]:
    """The terms of a compact chain prompt ("3+8+1=" -> [3, 8, 1]); ValueError naming the prompt otherwise."""
    body = prompt[:-1] if prompt.endswith("=") else ""
    parts = body.split("+")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"chain task: {prompt!r} is not a compact chain-sum prompt like '3+8+1='")
    return [int(p) for p in parts]


def worked_response(prompt: str) -> str:
    """The running sums after each middle term, then the answer: "3+8+1+9+4=" -> "11 12 21 Answer: 25"."""
    terms = parse_terms(prompt)
    running, partials = terms[0], []
    for term in terms[1:-1]:
        running += term
        partials.append(str(running))
    return " ".join(partials + [f"Answer: {sum(terms)}"])


def direct_response(prompt: str) -> str:
    return f"Answer: {sum(parse_terms(prompt))}"


def response_tokens(text: str) -> int:
    """Tokens of a response under the tiny byte-level tokenizer (one per character) plus the closing EOS."""
    return len(text.encode()) + 1


def warm_start_responses(prompts: Sequence[str], *, seed: int, direct_fraction: float = DIRECT_FRACTION) -> list[str]:
    """The warm start's target per train prompt: direct for a fixed fraction of them, worked otherwise.
    Which ones is a hash of (prompt, seed), so the same prompt always gets the same form."""
    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"chain task: direct_fraction={direct_fraction} must be in [0, 1]")
    out = []
    for prompt in prompts:
        draw = zlib.crc32(f"{seed}:{prompt}".encode()) / 2**32
        out.append(direct_response(prompt) if draw < direct_fraction else worked_response(prompt))
    return out
