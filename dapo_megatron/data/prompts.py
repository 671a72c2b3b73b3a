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
and the column. Every row is checked before a run starts (launch/data_check.py): the first MAX_LISTED problems
are listed with the count of the rest, or, with data.skip_bad_rows, the bad rows are left out and counted.
on_rows(done, total) reports the reading of a large file (the public file has 1.79M rows) every
ROWS_PER_REPORT rows and once at its end; its caller draws the progress line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict

__all__ = [
    "PromptRecord",
    "PromptList",
    "load_prompts",
    "save_prompts",
    "apply_template",
    "DAPO_TEMPLATE",
    "prompt_token_ids",
]

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
MAX_LISTED = 10  # bad rows listed in one error; the rest are counted
ROWS_PER_REPORT = 4096  # rows between two on_rows calls (the call is cheap; the progress line decides what it prints)


def apply_template(problem: str) -> str:
    """The DAPO prompt around a raw problem (the public files already contain it)."""
    return DAPO_TEMPLATE.format(problem=problem)


class ChatMessage(TypedDict):
    content: str
    role: str  # system | user | assistant


class RewardModelColumn(TypedDict):
    ground_truth: str
    style: str


class ExtraInfoColumn(TypedDict):
    index: str


class PromptRow(TypedDict):
    """One row of a prompt file (the DAPO-Math-17k schema, _arrow_schema) as save_prompts writes it."""

    data_source: str
    prompt: list[ChatMessage]
    ability: str
    reward_model: RewardModelColumn
    extra_info: ExtraInfoColumn


class HasPrompt(Protocol):
    """What prompt_token_ids reads: a PromptRecord, or any record with a `prompt` text (and optionally
    `prompt_ids`, ready token ids, or `chat()`, the conversation)."""

    prompt: str


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

    def to_row(self) -> PromptRow:
        return {
            "data_source": self.data_source,
            "prompt": [{"content": m["content"], "role": m["role"]} for m in self.chat()],
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.reward_style},
            "extra_info": {"index": self.index},
        }


class PromptList(list):
    """A list of PromptRecord that remembers where it came from and what de-duplication dropped."""

    def __init__(
        self,
        records: Iterable[PromptRecord] = (),
        *,
        path: str = "",
        num_rows: int = 0,
        num_duplicates: int = 0,
        num_skipped: int = 0,
    ) -> None:
        super().__init__(records)
        self.path = path
        self.num_rows = num_rows  # rows in the file
        self.num_duplicates = num_duplicates  # rows dropped as repeats of an earlier (prompt, answer)
        self.num_skipped = num_skipped  # bad rows left out (skip_bad_rows)


def load_prompts(
    path: str | Path,
    *,
    dedup: bool = True,
    prompt_template: str = "as-is",
    skip_bad_rows: bool = False,
    prompt_length: Callable[[PromptRecord], int] | None = None,
    max_prompt_length: int = 0,
    key: str = "data.train_path",
    on_rows: Callable[[int, int], None] | None = None,
) -> PromptList:
    """Read a parquet or jsonl file in the DAPO-Math schema into PromptRecords, checking every row.

    dedup drops rows whose (chat, ground truth) repeat an earlier row, keeping the first, and logs how
    many were dropped (also `result.num_duplicates`). prompt_template="dapo" wraps each user turn in
    the DAPO template (for files of raw problems); "as-is" leaves the text unchanged.
    prompt_length (record -> tokens after the chat template and tokenizer: prompt_token_ids) with
    max_prompt_length > 0 checks each kept prompt against rollout.max_prompt_length (a duplicate of a
    row counts as a duplicate, not again as bad).
    A bad row raises one ValueError listing the first MAX_LISTED problems (file, row, column or config
    key) and the count of the rest; skip_bad_rows leaves them out instead and logs the count
    (`result.num_skipped`). `key` is the config key that named the file. on_rows(rows read, rows in the
    file) while it reads, and (rows, rows) at the end.
    """
    path = Path(path)
    if prompt_template not in PROMPT_TEMPLATES:
        raise ValueError(
            f"load_prompts: prompt_template={prompt_template!r} is not allowed; choose one of {list(PROMPT_TEMPLATES)}"
        )
    if not path.is_file():
        raise ValueError(f"{key}: prompt file not found: {path}")
    records, problems, num_rows, num_duplicates = _read_records(
        path,
        dedup=dedup,
        prompt_template=prompt_template,
        prompt_length=prompt_length,
        max_prompt_length=max_prompt_length,
        on_rows=on_rows,
    )
    if problems and not skip_bad_rows:
        raise ValueError(bad_rows_message(key, path, problems, num_rows))
    if problems:
        log.warning(
            "%s %s: skipped %d bad rows of %d (data.skip_bad_rows=true); the first: %s",
            key,
            path,
            len(problems),
            num_rows,
            problems[0],
        )
    if not records:
        raise ValueError(f"{key}: {path} has no usable rows ({num_rows} rows, {len(problems)} bad)")
    if num_duplicates:
        log.warning(
            "%s: dropped %d duplicate rows of %d (%d unique prompts kept)", path, num_duplicates, num_rows, len(records)
        )
    return PromptList(
        records, path=str(path), num_rows=num_rows, num_duplicates=num_duplicates, num_skipped=len(problems)
    )


def _read_records(
    path: Path,
    *,
    dedup: bool,
    prompt_template: str,
    prompt_length: Callable[[PromptRecord], int] | None,
    max_prompt_length: int,
    on_rows: Callable[[int, int], None] | None = None,
) -> tuple[list[PromptRecord], list[str], int, int]:
    """(records kept, one problem per bad row, rows read, duplicates dropped) of one prompt file
    (load_prompts's reading: every row parsed, de-duplicated, templated and length-checked)."""
    seen: set[tuple] = set()
    records: list[PromptRecord] = []
    problems: list[str] = []
    num_rows = num_duplicates = 0
    total = _count_rows(path) if on_rows is not None else 0
    for row_number, where, row in _iter_rows(path):
        num_rows += 1
        if on_rows is not None and num_rows % ROWS_PER_REPORT == 0:
            on_rows(num_rows, max(total, num_rows))
        try:
            record = _parse_row(row, row_number, where)
            if dedup:
                key_of_row = (tuple((m["role"], m["content"]) for m in record.chat()), record.ground_truth)
                if key_of_row in seen:
                    num_duplicates += 1
                    continue
                seen.add(key_of_row)
            if prompt_template == "dapo":
                record = _templated(record)
            if prompt_length is not None and max_prompt_length > 0:
                num_tokens = prompt_length(record)
                if num_tokens > max_prompt_length:
                    raise ValueError(
                        f"{where}: the prompt is {num_tokens} tokens after the chat template and "
                        f"tokenizer, over rollout.max_prompt_length={max_prompt_length}"
                    )
        except ValueError as err:
            problems.append(str(err))
            continue
        records.append(record)
    if on_rows is not None:
        on_rows(num_rows, num_rows)
    return records, problems, num_rows, num_duplicates


def _count_rows(path: Path) -> int:
    """Rows in a prompt file, for a progress line's total: parquet's metadata, a jsonl file's lines (blank
    lines included: an upper bound); 0 when it cannot be read (the reading then names the problem)."""
    try:
        if path.suffix in _PARQUET_SUFFIXES:
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        lines, ends_with_newline = 0, True
        with path.open("rb") as fh:
            while block := fh.read(16 << 20):
                lines += block.count(b"\n")
                ends_with_newline = block.endswith(b"\n")
        return lines + (0 if ends_with_newline else 1)
    except Exception:  # pyarrow raises several types for a broken file; the reading reports it
        return 0


def bad_rows_message(key: str, path: str | Path, problems: list[str], num_rows: int) -> str:
    """One error for every bad row: the first MAX_LISTED listed, the rest counted."""
    listed = "\n  ".join(problems[:MAX_LISTED])
    rest = f"\n  ... and {len(problems) - MAX_LISTED} more bad rows" if len(problems) > MAX_LISTED else ""
    return (
        f"{key}: {path}: {len(problems)} of {num_rows} rows cannot be trained on (fix them, or set "
        f"data.skip_bad_rows=true to leave them out):\n  {listed}{rest}"
    )


def _plain_text_ids(tokenizer, text: str) -> list[int]:
    """text's ids after the special tokens the tokenizer itself puts before a text (Llama 3's
    tokenizer.json adds <|begin_of_text|>, which the model always saw first; Qwen's and GPT-2's add
    none), never the ones after it (an end-of-text there would end the prompt before the answer)."""
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    full = tokenizer(text)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]) + plain
    return plain


def prompt_token_ids(tokenizer, record: HasPrompt) -> list[int]:
    """The prompt's token ids as the engines get them: a PromptRecord's chat through the tokenizer's chat
    template (ready for the answer), or where there is no template the plain text after the special tokens
    the tokenizer itself puts first (Llama 3's <|begin_of_text|>). What
    rollout.max_prompt_length bounds (the sampler and the start-up check use this one function)."""
    ids = getattr(record, "prompt_ids", None)
    if ids:
        return list(ids)
    chat = record.chat() if hasattr(record, "chat") else record.prompt
    if isinstance(chat, str) or not getattr(tokenizer, "chat_template", None):
        text = chat if isinstance(chat, str) else record.prompt
        return _plain_text_ids(tokenizer, text)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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

    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )


def _iter_rows(path: Path) -> Iterator[tuple[int, str, object]]:
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
                raise ValueError(
                    f"{path}: row 0 (0-based) and every other row: column '{column}' is missing "
                    f"(columns: {', '.join(names)})"
                )
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
                    row = json.loads(line.rstrip("\r\n"))  # (a cut line's error then points into it)
                except json.JSONDecodeError as err:  # one bad row: reported with the others (_parse_row)
                    row = _Unreadable(f"not valid JSON ({err.msg} at column {err.colno})")
                yield row_number, where, row
                row_number += 1
    else:
        raise ValueError(f"{path}: unknown prompt file type '{path.suffix}'; use .parquet or .jsonl")


class _Unreadable(str):
    """A row that could not be read at all (its reason)."""


def _parse_row(row: object, row_number: int, where: str) -> PromptRecord:
    if isinstance(row, _Unreadable):
        raise ValueError(f"{where}: {row}")
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
        raise ValueError(
            f"{where}: column 'reward_model' must be a struct {{ground_truth, style}}, got {reward_model!r:.80}"
        )
    truth = reward_model.get("ground_truth")
    if isinstance(truth, bool) or not isinstance(truth, (str, int)):
        raise ValueError(f"{where}: column 'reward_model.ground_truth' must be a string, got {truth!r:.80}")
    if not str(truth).strip():  # an empty answer would score a response of "Answer: " as correct
        raise ValueError(f"{where}: column 'reward_model.ground_truth' is empty")
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


def _parse_messages(prompt: object, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: column 'prompt' must be a non-empty list of {{content, role}} messages, got {prompt!r:.80}"
        )
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
    return PromptRecord(
        prompt=wrapped,
        ground_truth=record.ground_truth,
        data_source=record.data_source,
        index=record.index,
        ability=record.ability,
        reward_style=record.reward_style,
        messages=messages,
    )
