"""Prompt data checked row by row before a run starts (data/prompts.py, data/datasets.py,
launch/data_check.py check_prompt_data): every bad row is found in one pass and named by file, row and
column or config key; the first MAX_LISTED are listed and the rest counted; data.skip_bad_rows leaves
them out and counts them. The real `train` command refuses a bad file before any engine or rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.data.datasets import train_and_eval_records
from dapo_megatron.data.prompts import MAX_LISTED, ROWS_PER_REPORT, load_prompts, prompt_token_ids
from dapo_megatron.data.tiny_model import build_tiny_model, build_tiny_tokenizer
from dapo_megatron.launch.data_check import check_prompt_data
from dapo_megatron.trainer.progress_line import INTERVAL_ENV

REPO = Path(__file__).resolve().parents[2]


def _row(prompt, truth="7") -> str:
    return json.dumps(
        {"data_source": "math_dapo", "prompt": prompt, "reward_model": {"ground_truth": truth, "style": "rule"}}
    )


_CUT = '{"data_source": "math_dapo", "prompt": "4+4=", '


def _bad_file(path: Path, *, num_long: int = 12) -> Path:
    """5 good rows, 4 bad rows of different kinds, then num_long prompts over 16 tokens."""
    lines = [
        _row("1+1="),
        _row([{"role": "user", "content": "2+2="}]),
        json.dumps({"data_source": "math_dapo", "reward_model": {"ground_truth": "3"}}),  # row 2: no prompt
        _row(42),  # row 3: not text
        _row("3+3=", truth=""),  # row 4: empty answer
        _CUT,  # row 5: cut short
        _row("5+5="),
        _row("6+6="),
        _row("7+7="),
    ]
    lines += [_row("9" * (20 + k)) for k in range(num_long)]  # rows 9..: too long
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_row_listed_with_file_row_and_key(tmp_path):
    tokenizer = build_tiny_tokenizer()
    length = lambda record: len(prompt_token_ids(tokenizer, record))  # noqa: E731
    path = _bad_file(tmp_path / "train.jsonl")
    assert length(load_prompts(path, skip_bad_rows=True)[0]) == 6  # "<|user|>1+1=<|assistant|>": 1 + 4 + 1 tokens
    with pytest.raises(ValueError) as err:
        load_prompts(path, prompt_length=length, max_prompt_length=16)
    lines = str(err.value).splitlines()
    assert lines[0] == (
        f"data.train_path: {path}: 16 of 21 rows cannot be trained on (fix them, or set "
        "data.skip_bad_rows=true to leave them out):"
    )
    assert lines[1:5] == [
        f"  {path}: row 2 (0-based), line 3: column 'prompt' is missing or null",
        f"  {path}: row 3 (0-based), line 4: column 'prompt' must be a non-empty list of {{content, role}} "
        "messages, got 42",
        f"  {path}: row 4 (0-based), line 5: column 'reward_model.ground_truth' is empty",
        f"  {path}: row 5 (0-based), line 6: not valid JSON (Expecting property name enclosed in double quotes "
        f"at column {len(_CUT) + 1})",
    ]
    # "<|user|>" + 20 nines + "<|assistant|>" = 22 tokens (one per byte between the two tags)
    assert lines[5] == (
        f"  {path}: row 9 (0-based), line 10: the prompt is 22 tokens after the chat template and "
        "tokenizer, over rollout.max_prompt_length=16"
    )
    assert len(lines) == 1 + MAX_LISTED + 1 and lines[-1] == "  ... and 6 more bad rows"
    # skipping: the 5 good rows, the count kept
    kept = load_prompts(path, prompt_length=length, max_prompt_length=16, skip_bad_rows=True)
    assert [r.prompt for r in kept] == ["1+1=", "2+2=", "5+5=", "6+6=", "7+7="] and kept.num_skipped == 16


def test_config_path_checks_train_and_eval_and_synthetic_lengths(tmp_path):
    tokenizer = build_tiny_tokenizer()
    train = _bad_file(tmp_path / "train.jsonl", num_long=0)
    evals = tmp_path / "eval.jsonl"
    evals.write_text(_row("1+2=") + "\n" + _row("1" * 30) + "\n")
    cfg = load_config(
        str(REPO / "configs/runs/tiny_cpu.yaml"),
        [
            "tiny.enabled=false",
            f"model.path={tmp_path}",
            f"data.train_path={train}",
            f"data.eval_path={evals}",
            "data.skip_bad_rows=true",
        ],
    )
    got_train, got_eval = train_and_eval_records(cfg.data, tokenizer=tokenizer, max_prompt_length=16)
    assert (len(got_train), got_train.num_skipped) == (5, 4)
    assert ([r.prompt for r in got_eval], got_eval.num_skipped) == (["1+2="], 1)
    # the launcher's line before anything starts says how many were left out
    assert check_prompt_data(cfg, str(build_tiny_model(tmp_path / "m", seed=0))) == (
        "5 train and 1 eval prompts checked (prompts within rollout.max_prompt_length=16 tokens); "
        "4 bad train rows left out (data.skip_bad_rows), 1 bad eval rows left out (data.skip_bad_rows)"
    )
    cfg.data.skip_bad_rows = False
    with pytest.raises(ValueError, match=r"data\.train_path: .*train\.jsonl: 4 of 9 rows"):
        train_and_eval_records(cfg.data, tokenizer=tokenizer, max_prompt_length=16)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg.data.train_path = str(empty)
    with pytest.raises(ValueError, match=r"data\.train_path: .*empty\.jsonl has no usable rows \(0 rows, 0 bad\)"):
        train_and_eval_records(cfg.data)
    # the synthetic task: "<|user|>27+58=<|assistant|>" is 8 tokens
    cfg = load_config(str(REPO / "configs/runs/tiny_cpu.yaml"), [])
    with pytest.raises(ValueError, match=r"data\.synthetic \(train\): problem 0 \(0-based\): the prompt is 8 tokens"):
        train_and_eval_records(cfg.data, tokenizer=tokenizer, max_prompt_length=7)
    assert len(train_and_eval_records(cfg.data, tokenizer=tokenizer, max_prompt_length=8)[0]) == 2000


def test_a_large_file_is_checked_with_a_progress_line_of_its_rows(tmp_path, monkeypatch, capsys):
    """10,000 train rows (jsonl) and 3,000 eval rows (parquet): the check's own "[data]" lines count the
    rows of each file every ROWS_PER_REPORT rows up to its total, then the phase line says the counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every report (the default: one per 15 s)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(_row(f"{k}+1=", truth=str(k + 1)) + "\n" for k in range(10_000)))
    evals = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(_row(f"{k}*2=", truth=str(2 * k))) for k in range(3_000)]), evals)
    cfg = load_config(
        str(REPO / "configs/runs/tiny_cpu.yaml"),
        ["tiny.enabled=false", f"model.path={tmp_path}", f"data.train_path={train}", f"data.eval_path={evals}"],
    )
    assert check_prompt_data(cfg) == "10000 train and 3000 eval prompts checked"
    lines = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()]
    assert ROWS_PER_REPORT == 4096 and lines == [
        "[data] data.train_path: 4096/10000 rows",
        "[data] data.train_path: 8192/10000 rows",
        "[data] data.train_path: 10000/10000 rows",
        "[data] data.eval_path: 3000/3000 rows",
    ]


def test_train_refuses_bad_data_before_any_process(tmp_path):
    """The real command: exit 2 with the listed rows; no engine registry, no logs (nothing started)."""
    train = _bad_file(tmp_path / "train.jsonl")
    model = build_tiny_model(tmp_path, seed=0)  # a HF directory (random init) with the tiny tokenizer
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "train",
            str(REPO / "configs/runs/tiny_cpu.yaml"),
            f"trainer.output_dir={out}",
            "tiny.enabled=false",
            f"model.path={model}",
            f"data.train_path={train}",
            "--skip-plan",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"data.train_path: {train}: 16 of 21 rows cannot be trained on" in proc.stderr
    assert f"{train}: row 4 (0-based), line 5: column 'reward_model.ground_truth' is empty" in proc.stderr
    assert "... and 6 more bad rows" in proc.stderr and "Traceback" not in proc.stderr
    # nothing started: no engines/, metrics or model stage; the run directory holds only the console's log
    # (logs/train.log keeps the refusal for `dapo-megatron status`) and the launcher's emptied lock file
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".run.lock", "logs", "logs/train.log"]
    assert "16 of 21 rows cannot be trained on" in (out / "logs" / "train.log").read_text()
