"""The run's prompt sets from its `data` config section.

    train, evals = train_and_eval_records(cfg.data)
"""

from __future__ import annotations

from dapo_megatron.data.prompts import load_prompts
from dapo_megatron.data.synthetic import synthetic_train_eval


def train_and_eval_records(data_cfg) -> tuple[list, list]:
    """(train, eval) prompt records: files in the DAPO-Math schema (data.train_path / eval_path), or
    the synthetic task with a held-out eval split (eval problems that also occur in the train split
    are dropped)."""
    d = data_cfg
    if d.train_path:
        train = load_prompts(d.train_path, dedup=d.dedup, prompt_template=d.prompt_template)
        evals = load_prompts(d.eval_path, dedup=False, prompt_template=d.prompt_template) if d.eval_path else []
        return list(train), list(evals)
    s = d.synthetic
    return synthetic_train_eval(num_train=s.num_train, num_eval=s.num_eval, difficulty=s.difficulty, seed=s.seed,
                                style=s.style)
