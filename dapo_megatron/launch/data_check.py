"""The prompt data's check before a run starts: every train and eval row, by the local launcher
(launch/local/launcher.py) and by `slurm submit`'s guard (launch/slurm/submit_guard.py), on the shared
level of launch/ because both launchers use it. A large file's reading draws a progress line
("[data] data.train_path: 412000/1791700 rows (41.3K/s, 10 s, 33 s left)": trainer/progress_line.py).
"""

from __future__ import annotations

from dapo_megatron.data.datasets import OnRows, train_and_eval_records
from dapo_megatron.trainer.progress_line import ProgressLines


def check_prompt_data(cfg, model_dir: str = "", *, tokenizer=None, on_rows: OnRows | None = None) -> str:
    """Every train and eval row checked here, before an engine or rank starts (the same check the
    driver repeats): a bad row raises one ValueError naming file, row and key (data/prompts.py); with
    data.skip_bad_rows the count left out is in the returned line. The prompt lengths are checked with
    `tokenizer`, else model_dir's; with neither (`slurm submit` without the model here) only the rows.
    on_rows: each file's reading (default: a "[data]" progress line per file on stdout)."""
    if tokenizer is None and model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, evals = train_and_eval_records(
        cfg.data,
        tokenizer=tokenizer,
        max_prompt_length=cfg.rollout.max_prompt_length,
        on_rows=on_rows or ProgressLines("[data]", unit="rows"),
    )
    skipped = [
        f"{n} bad {kind} rows left out (data.skip_bad_rows)"
        for kind, n in (("train", getattr(train, "num_skipped", 0)), ("eval", getattr(evals, "num_skipped", 0)))
        if n
    ]
    lengths = (
        f" (prompts within rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens)"
        if tokenizer is not None
        else ""
    )
    return f"{len(train)} train and {len(evals)} eval prompts checked{lengths}" + (
        f"; {', '.join(skipped)}" if skipped else ""
    )
