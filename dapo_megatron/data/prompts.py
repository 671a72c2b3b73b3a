"""Prompt datasets in the DAPO-Math-17K schema (docs/algorithm.md section 8): load, validate, de-duplicate, save.

    records = load_prompts("/shared/data/dapo-math-17k.parquet")      # dedup=True by default
    records.num_duplicates     # the public file repeats each of its 17,917 prompts ~100 times

One row per prompt:
    data_source:  str                                   "math_dapo"
    prompt:       list<struct{content: str, role: str}> one user turn (a plain string is accepted too)
    ability:      str                                   "MATH"                       (optional)
    reward_model: struct{ground_truth: str, style: str} style "rule-lighteval/MATH_v2"
    extra_info:   struct{index: str}                                                 (optional)
Errors name the file, the row (0-based, counting data rows; jsonl errors also give the 1-based line)
and the column.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["PromptRecord", "PromptList", "load_prompts", "save_prompts", "apply_template", "DAPO_TEMPLATE"]

log = logging.getLogger(__name__)

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
PROMPT_TEMPLATES = ("as-is", "dapo")
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def apply_template(problem: str) -> str:
    """The DAPO prompt around a raw problem (the public files already contain it)."""
    return DAPO_TEMPLATE.format(problem=problem)


@dataclass
class PromptRecord:
    prompt: str  # the user turn's content (what the chat template wraps)
    ground_truth: str
    data_source: str = "math_dapo"  # selects the reward scorer (dapo_megatron.reward.scorer_for_data_source)
    index: str = ""
    ability: str = "MATH"
    reward_style: str = "rule-lighteval/MATH_v2"
    messages: list[dict[str, str]] = field(default_factory=list)  # full chat; [] = one user turn `prompt`

    def chat(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.prompt}]

    def to_row(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": [{"content": m["content"], "role": m["role"]} for m in self.chat()],
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.reward_style},
            "extra_info": {"index": self.index},
        }


class PromptList(list):
    """A list of PromptRecord that remembers where it came from and what de-duplication dropped."""

    def __init__(self, records: Iterable[PromptRecord] = (), *, path: str = "", num_rows: int = 0,
                 num_duplicates: int = 0) -> None:
        super().__init__(records)
        self.path = path
        self.num_rows = num_rows  # rows in the file
        self.num_duplicates = num_duplicates  # rows dropped as repeats of an earlier (prompt, answer)


def load_prompts(path: str | Path, *, dedup: bool = True, prompt_template: str = "as-is") -> PromptList:
    """Read a parquet or jsonl file in the DAPO-Math schema into PromptRecords.

    dedup drops rows whose (chat, ground truth) repeat an earlier row, keeping the first, and logs how
    many were dropped (also `result.num_duplicates`). prompt_template="dapo" wraps each user turn in
    the DAPO template (for files of raw problems); "as-is" leaves the text unchanged.
    """
    path = Path(path)
    if prompt_template not in PROMPT_TEMPLATES:
        raise ValueError(f"load_prompts: prompt_template={prompt_template!r} is not allowed; choose one of {list(PROMPT_TEMPLATES)}")
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path}")
    seen: set[tuple] = set()
    records: list[PromptRecord] = []
    num_rows = num_duplicates = 0
    for row_number, where, row in _iter_rows(path):
        record = _parse_row(row, row_number, where)
        num_rows += 1
        if dedup:
            key = (tuple((m["role"], m["content"]) for m in record.chat()), record.ground_truth)
            if key in seen:
                num_duplicates += 1
                continue
            seen.add(key)
        if prompt_template == "dapo":
            record = _templated(record)
        records.append(record)
    if num_duplicates:
        log.warning("%s: dropped %d duplicate rows of %d (%d unique prompts kept)", path, num_duplicates, num_rows,
                    len(records))
    return PromptList(records, path=str(path), num_rows=num_rows, num_duplicates=num_duplicates)


def save_prompts(records: Iterable[PromptRecord], path: str | Path) -> Path:
    """Write records in the same schema (.parquet / .pq or .jsonl by suffix); returns the path."""
    path = Path(path)
    rows = [r.to_row() for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in _PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows, schema=_arrow_schema()), path)
    elif path.suffix in _JSONL_SUFFIXES:
        with path.open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"save_prompts: {path}: unknown suffix '{path.suffix}'; use .parquet or .jsonl")
    return path


# --------------------------------------------------------------------------------------------


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ])


def _iter_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(0-based data row, "file, row N (0-based)[, line L]" for messages, row) for every row."""
    if path.suffix in _PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for a broken file
            raise ValueError(f"{path}: not a readable parquet file ({err})") from None
        names = pf.schema_arrow.names
        for column in REQUIRED_COLUMNS:
            if column not in names:
                raise ValueError(f"{path}: row 0 (0-based) and every other row: column '{column}' is missing "
                                 f"(columns: {', '.join(names)})")
        row_number = 0
        for batch in pf.iter_batches(batch_size=16384):  # bounded memory on the 1.79M-row public file
            for row in batch.to_pylist():
                yield row_number, f"{path}: row {row_number} (0-based)", row
                row_number += 1
    elif path.suffix in _JSONL_SUFFIXES:
        row_number = 0
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line_number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{path}: row {row_number} (0-based), line {line_number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
                yield row_number, where, row
                row_number += 1
    else:
        raise ValueError(f"{path}: unknown prompt file type '{path.suffix}'; use .parquet or .jsonl")


def _parse_row(row: Any, row_number: int, where: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with columns {list(REQUIRED_COLUMNS)}, got {type(row).__name__}")
    for column in REQUIRED_COLUMNS:
        if row.get(column) is None:
            raise ValueError(f"{where}: column '{column}' is missing or null")
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"{where}: column 'data_source' must be a non-empty string, got {data_source!r}")

    messages = _parse_messages(row["prompt"], where)
    user_turns = [m["content"] for m in messages if m["role"] == "user"]
    if not user_turns:
        raise ValueError(f"{where}: column 'prompt' has no message with role 'user'")

    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict):
        raise ValueError(f"{where}: column 'reward_model' must be a struct {{ground_truth, style}}, got {reward_model!r:.80}")
    truth = reward_model.get("ground_truth")
    if isinstance(truth, bool) or not isinstance(truth, (str, int)):
        raise ValueError(f"{where}: column 'reward_model.ground_truth' must be a string, got {truth!r:.80}")
    style = reward_model.get("style") or "rule-lighteval/MATH_v2"

    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise ValueError(f"{where}: column 'ability' must be a string, got {ability!r:.80}")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: column 'extra_info' must be a struct {{index}}, got {extra!r:.80}")
    index = extra.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, (str, int))):
        raise ValueError(f"{where}: column 'extra_info.index' must be a string, got {index!r:.80}")

    single_user_turn = len(messages) == 1
    return PromptRecord(
        prompt=user_turns[-1],
        ground_truth=str(truth),
        data_source=data_source,
        index=str(row_number) if index is None else str(index),
        ability=ability or "MATH",
        reward_style=str(style),
        messages=[] if single_user_turn else messages,
    )


def _parse_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: column 'prompt' must be a non-empty list of {{content, role}} messages, got {prompt!r:.80}")
    messages = []
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: column 'prompt[{k}]' must be a {{content, role}} struct, got {message!r:.80}")
        content, role = message.get("content"), message.get("role")
        if not isinstance(content, str):
            raise ValueError(f"{where}: column 'prompt[{k}].content' must be a string, got {content!r:.80}")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: column 'prompt[{k}].role' must be system, user or assistant, got {role!r:.80}")
        messages.append({"role": role, "content": content})
    return messages


def _templated(record: PromptRecord) -> PromptRecord:
    wrapped = apply_template(record.prompt)
    messages = [dict(m) for m in record.messages]
    for m in reversed(messages):  # the last user turn is the problem
        if m["role"] == "user":
            m["content"] = wrapped
            break
    return PromptRecord(prompt=wrapped, ground_truth=record.ground_truth, data_source=record.data_source,
                        index=record.index, ability=record.ability, reward_style=record.reward_style,
                        messages=messages)
