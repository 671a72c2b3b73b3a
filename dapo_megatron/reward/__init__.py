"""Rule-based reward scorers and their registry.

from dapo_megatron.reward import get_scorer
result = get_scorer("math_dapo")(response_text, ground_truth)   # RewardResult(score, acc, pred)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from dapo_megatron.reward.math_dapo import RewardResult
from dapo_megatron.reward.math_dapo import score as math_dapo_score

__all__ = ["RewardResult", "Scorer", "get_scorer", "register_scorer", "scorer_for_data_source", "SCORERS"]

Scorer = Callable[[str, str], RewardResult]
SCORERS: dict[str, Scorer] = {"math_dapo": math_dapo_score}


def register_scorer(name: str, scorer: Scorer) -> None:
    if name in SCORERS and SCORERS[name] is not scorer:
        raise ValueError(f"reward scorer '{name}' is already registered")
    SCORERS[name] = scorer


def get_scorer(name: str) -> Scorer:
    if name not in SCORERS:
        close = difflib.get_close_matches(name, SCORERS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown reward scorer '{name}'{hint} (registered: {', '.join(sorted(SCORERS))})")
    return SCORERS[name]


def scorer_for_data_source(data_source: str) -> Scorer:
    """The scorer for a dataset row's `data_source`: AIME eval sets ("aime24", "aime_2024", ...) are
    scored by math_dapo, as in the public recipe; otherwise the registry name itself."""
    if data_source.lower().startswith("aime"):
        return SCORERS["math_dapo"]
    return get_scorer(data_source)
