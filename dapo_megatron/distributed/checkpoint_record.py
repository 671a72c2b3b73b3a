"""What a checkpoint records about the run that wrote it, as plain values: the parallel layout's sizes and
the model's architecture (actor/checkpoint.py writes them into actor_state.json; the launcher checks a
resume against them: trainer/checkpoint/resume_check.py). No torch here: the launcher reads it before any
rank starts.

    {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "vpp": 1, "ep": 1, "etp": 2, "world": 2}
    describe_sizes(sizes)  ->  "TP=2 PP=1 CP=1 DP=1"
    architecture_record(hf_config) -> {"model_type": "qwen2", "hidden_size": 64, ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

META_FILE = "actor_state.json"  # the actor checkpoint's record, written last (actor/checkpoint.py)
# the distributed-optimizer format assumed when actor_state.json names none (every checkpoint before 2026-11-28)
LEGACY_OPTIMIZER_FORMAT = "dp_reshardable"


def finished_actor_dir(path: str | Path) -> Path | None:
    """`path` if it is a finished actor checkpoint (its META_FILE written), else `<path>.old` (a crash
    between the two renames of a save), else None."""
    final = Path(path).absolute()
    for candidate in (final, final.with_name(final.name + ".old")):
        if (candidate / META_FILE).is_file():
            return candidate
    return None


SIZE_KEYS = ("tp", "pp", "cp", "dp", "vpp", "ep", "etp", "world")


def describe_sizes(sizes: dict) -> str:
    """'TP=2 PP=1 CP=1 DP=1', plus VPP and EP where they are not 1 (a missing key reads as 1)."""
    keys = ["tp", "pp", "cp", "dp"] + [k for k in ("vpp", "ep") if int(sizes.get(k) or 1) != 1]
    return " ".join(f"{k.upper()}={int(sizes.get(k) or 1)}" for k in keys)


def changed_sizes(saved: dict, current: dict, keys: tuple[str, ...] = SIZE_KEYS[:-1]) -> list[str]:
    """The keys whose sizes differ (a missing key reads as 1)."""
    return [k for k in keys if int(saved.get(k) or 1) != int(current.get(k) or 1)]


# what a checkpoint's model is, as far as its tensors' shapes and meaning go: a resume may change the
# parallel layout and the allocation, never these (trainer/checkpoint/resume_check.py)
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def architecture_record(config: Mapping[str, object]) -> dict[str, object]:
    """The ARCHITECTURE_KEYS of a config.json's dict (a key the model type lacks is left out; a
    multimodal config's text_config first); head_dim as the model uses it (hidden / heads where
    config.json has none)."""
    raw: dict[str, object] = {**dict(config.get("text_config") or {}), **config}  # type: ignore[call-overload]
    if not raw.get("head_dim") and raw.get("hidden_size") and raw.get("num_attention_heads"):
        raw["head_dim"] = int(raw["hidden_size"]) // int(raw["num_attention_heads"])  # type: ignore[call-overload]
    return {k: raw[k] for k in ARCHITECTURE_KEYS if raw.get(k) is not None}
