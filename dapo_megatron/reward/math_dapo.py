r"""The DAPO rule-based math reward (docs/algorithm.md section 3), equal to the public recipe's math_dapo scorer.

    score("...so the total is 12.\nAnswer: $1,234$", "1234") -> RewardResult(score=1.0, acc=True, pred="1234")

1. keep the last 300 characters of the response (special tokens already removed by the caller);
2. the prediction is the LAST match of the case-insensitive `Answer\s*:\s*([^\n]+)`; none = "[INVALID]";
3. prediction and ground truth are normalized (`normalize_final_answer`, Minerva's rules as in verl):
   text after the last '=', substitutions, unit words removed, $...$ / \text{} / \textbf{} /
   \overline{} / \boxed{} unwrapped, \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}, '$' dropped,
   commas dropped from digit strings ("1,234" -> "1234");
4. +1.0 if the normalized strings are equal, else -1.0.

It never raises and its work is linear in the input: the extraction regex only sees 300 characters,
and the five regex passes of the reference normalization (`(.*?)(\$)(.*?)(\$)(.*)`, lazy/greedy
brace unwrapping) are re-implemented as linear scans with the same results (the reference regexes
are quadratic to cubic per line, which matters for the ground truth: it is not truncated). A test
checks the scans against the reference regexes on random strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["RewardResult", "score", "extract_answer", "normalize_final_answer", "INVALID", "TAIL_CHARS"]

TAIL_CHARS = 300  # "the longest answer in MATH-500 has 159 characters" (verl)
INVALID = "[INVALID]"
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalization tables (Lewkowycz et al. 2022, appendix), as in verl's math_dapo.py.
SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]
_FRAC_RE = re.compile(r"(frac)([^{])(.)")  # linear: fixed-width
_SQRT_RE = re.compile(r"(sqrt)([^{])")


@dataclass(frozen=True)
class RewardResult:
    score: float  # +1.0 correct, -1.0 wrong or no answer (overlong shaping is added elsewhere)
    acc: bool
    pred: str  # the normalized prediction ("[INVALID]" when there is no Answer: line)


def score(response: str, ground_truth: str) -> RewardResult:
    """Score one response against its ground truth; never raises."""
    try:
        raw = extract_answer(response)
        if raw is INVALID:  # no `Answer:` line: wrong whatever the ground truth says
            return RewardResult(score=-1.0, acc=False, pred=INVALID)
        pred = normalize_final_answer(raw)
        correct = pred == normalize_final_answer(_as_text(ground_truth))
    except Exception:  # pragma: no cover - defensive: a reward bug must not kill a 48-hour run
        return RewardResult(score=-1.0, acc=False, pred=INVALID)
    return RewardResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


def extract_answer(response: str) -> str:
    """The raw text after the last `Answer:` in the response's last 300 characters, or "[INVALID]"."""
    tail = _as_text(response)[-TAIL_CHARS:]
    matches = _ANSWER_RE.findall(tail)
    return matches[-1] if matches else INVALID


def normalize_final_answer(final_answer: str) -> str:
    """Minerva / verl normalization of a final answer (see the module docstring)."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = _keep_first_dollar_pair(final_answer)  # re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\3$")
    final_answer = _unwrap_lazy(final_answer, "\\text{")  # re.sub(r"(\\text\{)(.*?)(\})", r"\2")
    final_answer = _unwrap_lazy(final_answer, "\\textbf{")
    final_answer = _unwrap_lazy(final_answer, "\\overline{")
    final_answer = _unwrap_boxed_greedy(final_answer)  # re.sub(r"(\\boxed\{)(.*)(\})", r"\2")
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    final_answer = _FRAC_RE.sub("frac{\\2}{\\3}", final_answer)
    final_answer = _SQRT_RE.sub("sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():  # "1,234" -> "1234"
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return "" if value is None else str(value)


# ---- linear scans equal to the reference regexes ('.' does not match '\n': they work per line) ----


def _keep_first_dollar_pair(text: str) -> str:
    """Every line holding two or more '$' becomes '$' + (text between its first two '$') + '$'."""
    if text.count("$") < 2:
        return text
    lines = text.split("\n")
    for k, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[k] = "$" + line[first + 1 : second] + "$"
    return "\n".join(lines)


def _unwrap_lazy(text: str, opener: str) -> str:
    """Replace `opener + inner + '}'` by inner, inner running to the FIRST '}' on the same line, scanning
    left to right like re.sub; an opener with no '}' later on its line stays as it is."""
    i = text.find(opener)
    if i < 0:
        return text
    out: list[str] = []
    pos = 0  # text[pos:] is not yet copied to out
    close = newline = -2  # cached "next '}' / '\n' at or after some earlier start" (-1: none left)
    while i >= 0:
        start = i + len(opener)
        if close != -1 and close < start:
            close = text.find("}", start)
        if newline != -1 and newline < start:
            newline = text.find("\n", start)
        if close != -1 and (newline == -1 or close < newline):
            out.append(text[pos:i])
            out.append(text[start:close])
            pos = close + 1
            i = text.find(opener, pos)
        else:
            i = text.find(opener, i + 1)
    out.append(text[pos:])
    return "".join(out)


def _unwrap_boxed_greedy(text: str) -> str:
    """Per line: the first '\\boxed{' that has a '}' after it loses the opener and the LAST '}' of the line."""
    opener = "\\boxed{"
    if opener not in text:
        return text
    lines = text.split("\n")
    for k, line in enumerate(lines):
        i = line.find(opener)
        if i < 0:
            continue
        last = line.rfind("}")
        if last >= i + len(opener):
            lines[k] = line[:i] + line[i + len(opener) : last] + line[last + 1 :]
    return "\n".join(lines)
