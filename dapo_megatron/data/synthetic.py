"""Synthetic integer-answer arithmetic tasks in the DAPO-Math schema (the tiny CPU run and the tests).

    records = make_synthetic_task(2000, difficulty=2, seed=1234)                  # DAPO template
    records = make_synthetic_task(64, difficulty=1, seed=0, style="compact")      # "3+4=" -> "Answer: 7"
    train, held_out = synthetic_train_eval(num_train=2000, num_eval=100, difficulty=2, seed=1234, style="compact")

Difficulty levels (operands drawn uniformly; answers are integers, possibly negative at level 5):
    1  a + b               a, b in 0..9                       ("3+4")
    2  a + b               a, b in 10..99                     ("27+58")
    3  a + b + c  or a * b a, b, c in 0..9 / a, b in 2..9     ("3+8+1", "7*6"), half each
    4  a * b               a in 10..99, b in 2..9             ("34*7")
    5  a * b - c           a, b in 10..99, c in 10..999       ("34*27-512")
    6  a1 + ... + ak       k in 2..6, each in 1..9            ("3+8+1+9+4"): chain sums, the tiny
                           ablation ladder's task (data/chain_task.py: worked responses of 11-23 tokens)
Styles of the user turn:
    "dapo"     the DAPO template around "What is 27 + 58?" (what the 7B/32B runs see)
    "raw"      just "What is 27 + 58?" (for data.prompt_template=dapo to wrap later)
    "compact"  "27+58=" : a very short prompt for the tiny CPU model; a correct response is
               "Answer: 85" (math_dapo needs the `Answer:` line in the response)
The same (num, difficulty, seed, style) always gives the same records; problems may repeat
(level 1 has only 100 distinct ones).
"""

from __future__ import annotations

import random

from dapo_megatron.data.chain_task import CHAIN_LEVEL, chain_problem
from dapo_megatron.data.prompts import PromptRecord, apply_template

__all__ = ["make_synthetic_task", "synthetic_train_eval", "DIFFICULTY_LEVELS", "SYNTHETIC_STYLES"]

DIFFICULTY_LEVELS = {
    1: "a + b, a and b in 0..9",
    2: "a + b, a and b in 10..99",
    3: "a + b + c with a, b, c in 0..9, or a * b with a, b in 2..9",
    4: "a * b, a in 10..99, b in 2..9",
    5: "a * b - c, a and b in 10..99, c in 10..999",
    CHAIN_LEVEL: "a1 + ... + ak, k in 2..6 terms in 1..9 (chain sums: data/chain_task.py)",
}
SYNTHETIC_STYLES = ("dapo", "raw", "compact")


def _problem(rng: random.Random, difficulty: int) -> tuple[list[int | str], int]:
    """Tokens of the expression (numbers and operators) and its value."""
    if difficulty == 1:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return [a, "+", b], a + b
    if difficulty == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return [a, "+", b], a + b
    if difficulty == 3:
        if rng.random() < 0.5:
            a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
            return [a, "+", b, "+", c], a + b + c
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return [a, "*", b], a * b
    if difficulty == CHAIN_LEVEL:
        return chain_problem(rng)
    if difficulty == 4:
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return [a, "*", b], a * b
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 999)
    return [a, "*", b, "-", c], a * b - c


def make_synthetic_task(num: int, *, difficulty: int, seed: int, style: str = "dapo") -> list[PromptRecord]:
    """`num` arithmetic prompts with integer ground truths, deterministic in (difficulty, seed, style)."""
    if num < 0:
        raise ValueError(f"make_synthetic_task: num={num} must be >= 0")
    if difficulty not in DIFFICULTY_LEVELS:
        raise ValueError(
            f"make_synthetic_task: difficulty={difficulty!r} is not allowed; choose one of "
            f"{sorted(DIFFICULTY_LEVELS)} ({'; '.join(f'{k}: {v}' for k, v in DIFFICULTY_LEVELS.items())})"
        )
    if style not in SYNTHETIC_STYLES:
        raise ValueError(f"make_synthetic_task: style={style!r} is not allowed; choose one of {list(SYNTHETIC_STYLES)}")
    rng = random.Random(f"synthetic-{difficulty}-{seed}")  # str seeds hash deterministically (sha512)
    records = []
    for i in range(num):
        tokens, value = _problem(rng, difficulty)
        if style == "compact":
            prompt = "".join(map(str, tokens)) + "="
        else:
            question = f"What is {' '.join(map(str, tokens))}?"
            prompt = apply_template(question) if style == "dapo" else question
        records.append(
            PromptRecord(
                prompt=prompt,
                ground_truth=str(value),
                data_source="math_dapo",
                index=f"synthetic-d{difficulty}-s{seed}-{i}",
                ability="ARITHMETIC",
            )
        )
    return records


def synthetic_train_eval(*, num_train: int, num_eval: int, difficulty: int, seed: int, style: str):
    """Train and held-out eval PromptRecords of the synthetic task; no eval prompt occurs in train.

    Train is make_synthetic_task(num_train, seed=seed); eval draws from seed + 1 and skips prompts
    the train set holds (level 2 has 90 * 90 = 8100 distinct problems: 2000 train prompts cover
    ~22% of them, so an unfiltered eval set would be ~22% memorisable).
    """
    train = make_synthetic_task(num_train, difficulty=difficulty, seed=seed, style=style)
    seen = {r.prompt for r in train}
    held: list = []
    draw = num_eval
    while len(held) < num_eval:
        pool = [
            r
            for r in make_synthetic_task(draw, difficulty=difficulty, seed=seed + 1, style=style)
            if r.prompt not in seen
        ]
        held = pool[:num_eval]
        if draw > 64 * max(num_eval, 1):
            raise ValueError(
                f"data.synthetic: cannot draw {num_eval} eval problems outside the {num_train} train "
                f"problems at difficulty {difficulty}; lower data.synthetic.num_eval or num_train"
            )
        draw *= 2
    return train, held
