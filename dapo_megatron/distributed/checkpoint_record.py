"""A parallel layout as plain sizes, for what outlives the ranks: a checkpoint's record of the layout it
was saved under (actor/checkpoint.py) and the launcher's check of a resume against the config's layout
(trainer/checkpoint/resume_check.py). No torch here: the launcher reads it before any rank starts.

    {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "vpp": 1, "ep": 1, "etp": 2, "world": 2}
    describe_sizes(sizes)  ->  "TP=2 PP=1 CP=1 DP=1"
"""

from __future__ import annotations

SIZE_KEYS = ("tp", "pp", "cp", "dp", "vpp", "ep", "etp", "world")


def describe_sizes(sizes: dict) -> str:
    """'TP=2 PP=1 CP=1 DP=1', plus VPP and EP where they are not 1 (a missing key reads as 1)."""
    keys = ["tp", "pp", "cp", "dp"] + [k for k in ("vpp", "ep") if int(sizes.get(k) or 1) != 1]
    return " ".join(f"{k.upper()}={int(sizes.get(k) or 1)}" for k in keys)


def changed_sizes(saved: dict, current: dict, keys: tuple[str, ...] = SIZE_KEYS[:-1]) -> list[str]:
    """The keys whose sizes differ (a missing key reads as 1)."""
    return [k for k in keys if int(saved.get(k) or 1) != int(current.get(k) or 1)]
