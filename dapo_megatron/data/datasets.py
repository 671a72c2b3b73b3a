"""The run's prompt sets from its `data` config section.

    train, evals = train_and_eval_records(cfg.data)
    train, evals = train_and_eval_records(cfg.data, tokenizer=tok, max_prompt_length=cfg.rollout.max_prompt_length)
    train, sets = train_and_eval_sets(cfg.data)       # sets: name -> records (data.eval_sets, else {"eval": evals})

With a tokenizer, every prompt's length after the chat template is checked against
rollout.max_prompt_length too (data/prompts.py, prompt_token_ids): the launcher does this before any
process starts, and the driver does the same so that data.skip_bad_rows leaves out the same rows.
on_rows(key, rows read, rows in the file) reports each file's reading (a progress line: the caller's).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dapo_megatron.data.prompts import PromptList, bad_rows_message, load_prompts, prompt_token_ids
from dapo_megatron.data.synthetic import synthetic_train_eval

DEFAULT_EVAL_SET = "eval"  # the name of a run's only eval set (data.eval_path or the synthetic split)
OnRows = Callable[[str, int, int], None]  # (the file's config key, rows read, rows in the file)


def _rows_of(on_rows: OnRows | None, key: str) -> Callable[[int, int], None] | None:
    return None if on_rows is None else (lambda done, total: on_rows(key, done, total))


def train_and_eval_sets(
    data_cfg, *, tokenizer=None, max_prompt_length: int = 0, on_rows: OnRows | None = None
) -> tuple[list, dict[str, list]]:
    """(train, name -> eval records): data.eval_sets, each file read and checked under its own key
    (data.eval_sets.<name>), or {"eval": the eval records of train_and_eval_records} ({} when empty)."""
    train, evals = _train_and_eval(
        data_cfg,
        tokenizer=tokenizer,
        max_prompt_length=max_prompt_length,
        with_eval=not data_cfg.eval_sets,
        on_rows=on_rows,
    )
    if not data_cfg.eval_sets:
        return train, ({DEFAULT_EVAL_SET: evals} if evals else {})
    length = (lambda record: len(prompt_token_ids(tokenizer, record))) if tokenizer is not None else None
    sets: dict[str, list] = {
        name: load_prompts(
            path,
            dedup=False,
            prompt_template=data_cfg.prompt_template,
            key=f"data.eval_sets.{name}",
            skip_bad_rows=data_cfg.skip_bad_rows,
            prompt_length=length,
            max_prompt_length=max_prompt_length,
            on_rows=_rows_of(on_rows, f"data.eval_sets.{name}"),
        )
        for name, path in data_cfg.eval_sets.items()
    }
    return train, sets


def train_and_eval_records(
    data_cfg, *, tokenizer=None, max_prompt_length: int = 0, on_rows: OnRows | None = None
) -> tuple[list, list]:
    """(train, eval records): every eval set's records one after the other (train_and_eval_sets)."""
    if not data_cfg.eval_sets:
        return _train_and_eval(
            data_cfg, tokenizer=tokenizer, max_prompt_length=max_prompt_length, with_eval=True, on_rows=on_rows
        )
    train, sets = train_and_eval_sets(
        data_cfg, tokenizer=tokenizer, max_prompt_length=max_prompt_length, on_rows=on_rows
    )
    evals = PromptList(
        [r for records in sets.values() for r in records],
        num_skipped=sum(getattr(records, "num_skipped", 0) for records in sets.values()),
    )
    return train, evals


def _train_and_eval(
    data_cfg, *, tokenizer, max_prompt_length: int, with_eval: bool, on_rows: OnRows | None = None
) -> tuple[list, list]:
    """(train, eval) prompt records: files in the DAPO-Math schema (data.train_path / eval_path), or
    the synthetic task with a held-out eval split (eval problems that also occur in the train split
    are dropped)."""
    d = data_cfg
    length = (lambda record: len(prompt_token_ids(tokenizer, record))) if tokenizer is not None else None
    checks = dict(skip_bad_rows=d.skip_bad_rows, prompt_length=length, max_prompt_length=max_prompt_length)
    if d.train_path:
        train = load_prompts(
            d.train_path,
            dedup=d.dedup,
            prompt_template=d.prompt_template,
            key="data.train_path",
            on_rows=_rows_of(on_rows, "data.train_path"),
            **checks,
        )
        evals = (
            load_prompts(
                d.eval_path,
                dedup=False,
                prompt_template=d.prompt_template,
                key="data.eval_path",
                on_rows=_rows_of(on_rows, "data.eval_path"),
                **checks,
            )
            if d.eval_path and with_eval
            else []
        )
        return train, evals  # PromptLists: num_skipped says how many bad rows were left out
    s = d.synthetic
    synthetic_train, synthetic_eval = synthetic_train_eval(
        num_train=s.num_train, num_eval=s.num_eval, difficulty=s.difficulty, seed=s.seed, style=s.style
    )
    if length is not None and max_prompt_length > 0:
        synthetic_train = _within_length(
            synthetic_train, length, max_prompt_length, "data.synthetic (train)", d.skip_bad_rows
        )
        if with_eval:
            synthetic_eval = _within_length(
                synthetic_eval, length, max_prompt_length, "data.synthetic (eval)", d.skip_bad_rows
            )
    return synthetic_train, (synthetic_eval if with_eval else [])


def _within_length(records: list, length, limit: int, key: str, skip: bool) -> list:
    kept, problems = [], []
    for k, record in enumerate(records):
        num_tokens = length(record)
        if num_tokens > limit:
            problems.append(
                f"{key}: problem {k} (0-based): the prompt is {num_tokens} tokens after the chat "
                f"template and tokenizer, over rollout.max_prompt_length={limit}"
            )
        else:
            kept.append(record)
    if problems and (not skip or not kept):
        raise ValueError(bad_rows_message(key, Path("generated"), problems, len(records)))
    return PromptList(kept, num_rows=len(records), num_skipped=len(problems))
