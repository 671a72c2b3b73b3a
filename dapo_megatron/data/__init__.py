"""Prompt datasets: DAPO-Math schema files (parquet / jsonl), the DAPO template, synthetic tasks."""

from dapo_megatron.data.prompts import (
    DAPO_TEMPLATE,
    PromptList,
    PromptRecord,
    apply_template,
    load_prompts,
    save_prompts,
)
from dapo_megatron.data.synthetic import DIFFICULTY_LEVELS, SYNTHETIC_STYLES, make_synthetic_task

__all__ = [
    "DAPO_TEMPLATE",
    "DIFFICULTY_LEVELS",
    "SYNTHETIC_STYLES",
    "PromptList",
    "PromptRecord",
    "apply_template",
    "load_prompts",
    "make_synthetic_task",
    "save_prompts",
]
