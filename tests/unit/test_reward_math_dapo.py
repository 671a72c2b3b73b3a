"""math_dapo scorer: >= 30 hand-checked cases, the linear normalization equal to the reference regexes
of the public recipe, and never raising or hanging on pathological input."""

import random
import re

import pytest

from dapo_megatron.reward import RewardResult, get_scorer, scorer_for_data_source
from dapo_megatron.reward.math_dapo import (
    INVALID,
    REMOVED_EXPRESSIONS,
    SUBSTITUTIONS,
    extract_answer,
    normalize_final_answer,
    score,
)

FILLER = "x" * 280

CASES = [
    # (response, ground truth, correct?, normalized prediction)
    ("Answer: 5", "5", True, "5"),
    ("answer: 5", "5", True, "5"),  # case-insensitive
    ("AnSwEr : 5", "5", True, "5"),
    ("ANSWER:5", "5", True, "5"),  # no space
    ("Answer   :    5   ", "5", True, "5"),  # spacing
    ("Answer:\n5", "5", True, "5"),  # \s* after the colon crosses a newline
    ("Answer: $5$", "5", True, "5"),
    ("Answer: \\boxed{5}", "5", True, "5"),
    ("Answer: $\\boxed{5}$", "5", True, "5"),
    ("Answer: \\text{5}", "5", True, "5"),
    ("Answer: \\textbf{5}", "5", True, "5"),
    ("Answer: \\overline{5}", "5", True, "5"),
    ("Answer: 1,234", "1234", True, "1234"),  # thousands comma
    ("Answer: 1234", "1,234", True, "1234"),  # the ground truth is normalized too
    ("Answer: $1,234,567$", "1234567", True, "1234567"),
    ("Answer: 1 000", "1000", True, "1000"),  # spaces are dropped
    ("Answer: x = 5", "5", True, "5"),  # text after the last '='
    ("Answer: $x=5$", "5", True, "5"),
    ("Answer: a = b = 12", "12", True, "12"),
    ("Answer: 5 degrees", "5", True, "5"),  # unit words are removed
    ("Answer: 5 dollars", "5", True, "5"),
    ("Answer: 30^\\circ", "30", True, "30"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),  # shorthand fix
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: 42", "\\boxed{42}", True, "42"),
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: -7", "7", False, "-7"),
    ("Answer: 12", "2", False, "12"),  # no substring matching
    ("Answer: 5.", "5", False, "5."),  # a trailing period is kept (strict, as the recipe)
    ("Answer: 0.5", "1/2", False, "0.5"),  # no numeric equivalence: DAPO answers are integers
    ("Answer: 5\nAnswer: 6", "6", True, "6"),  # several Answer lines: the last counts
    ("Answer: 5\nAnswer: 6", "5", False, "6"),
    ("Answer: 3\nsome reasoning\nAnswer: 4\nthat is all", "4", True, "4"),
    ("Answer: 5\n\ntrailing words", "5", True, "5"),  # only the rest of the line is the answer
    ("The answer is 5", "5", False, INVALID),  # no colon: no answer
    ("", "5", False, INVALID),  # empty response
    ("5", "5", False, INVALID),
    ("Answer: 5\n" + FILLER, "5", True, "5"),  # 290 characters: inside the window
    ("Answer: 5\n" + "y" * 291, "5", False, INVALID),  # the window starts inside the word "Answer"
    ("Answer: 5\n" + "z" * 400, "5", False, INVALID),  # answer > 300 characters before the end
    ("Answer: 1\n" + "w" * 5000 + "\nAnswer: 2", "2", True, "2"),
    ("answer: 7 \\text{ cm}", "7", True, "7"),
]


@pytest.mark.parametrize("response, truth, correct, pred", CASES)
def test_score_cases(response, truth, correct, pred):
    result = score(response, truth)
    assert result == RewardResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


def test_at_least_30_cases():
    assert len(CASES) >= 30


def test_extract_answer_takes_the_last_match_in_the_last_300_characters():
    assert extract_answer("Answer: 1\nAnswer: 2") == "2"
    assert extract_answer("no answer here") == INVALID
    assert extract_answer("Answer: a\n" + "b" * 300) == INVALID


def test_non_string_input_is_scored_not_raised():
    assert score(b"Answer: 5", "5").acc
    assert score(None, "5") == RewardResult(-1.0, False, INVALID)
    assert score("Answer: 5", 5).acc  # an integer ground truth


def test_registry():
    assert get_scorer("math_dapo") is score
    assert scorer_for_data_source("aime24") is score
    with pytest.raises(ValueError, match="did you mean 'math_dapo'"):
        get_scorer("math_dap")


# ---- the reference normalization, verbatim regexes of the public recipe ----


def _reference_normalize(final_answer: str) -> str:
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


PIECES = [
    "$",
    "\\text{",
    "\\textbf{",
    "\\overline{",
    "\\boxed{",
    "}",
    "}",
    "{",
    "\n",
    "1",
    "2",
    ",",
    "=",
    " ",
    "frac",
    "sqrt",
    "\\",
    "a",
    "x",
    "cm",
    ".",
    "\\$",
    "\r",
]


def test_linear_normalization_equals_the_reference_regexes():
    rng = random.Random(0)
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        assert normalize_final_answer(text) == _reference_normalize(text), repr(text)
    for text, _, _, _ in CASES:
        assert normalize_final_answer(text) == _reference_normalize(text)


PATHOLOGICAL = [
    "$" * 200_000,
    "a$" + "b" * 200_000,
    "\\text{" * 100_000,
    "\\boxed{" * 100_000 + "}",
    "\\overline{" * 50_000 + "\n}" * 50_000,
    "Answer:" * 100_000,
    "Answer: " + " " * 200_000,
    " " * 200_000 + "Answer",
    "=" * 200_000,
    "frac" * 100_000,
    "".join(chr(i % 0x2FFF) for i in range(100_000)),  # control and non-ASCII characters
    bytes(range(256)).decode("latin-1") * 500,
    "\ud800\udfff Answer: \ud800",  # lone surrogates
    "\x00" * 1000 + "Answer: 5",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_never_raises_on_pathological_strings(text):
    # as response and as ground truth (the ground truth is not truncated, so normalization must be linear)
    for response, truth in ((text, "5"), ("Answer: 5", text), (text, text)):
        result = score(response, truth)
        assert isinstance(result, RewardResult) and result.score in (1.0, -1.0)
