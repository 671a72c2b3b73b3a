"""Prompt files in the DAPO-Math schema: round trips, de-duplication counts, errors naming file/row/column,
the DAPO template, and the synthetic arithmetic task."""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_megatron.data.prompts import PromptRecord, apply_template, load_prompts, save_prompts
from dapo_megatron.data.synthetic import DIFFICULTY_LEVELS, make_synthetic_task
from dapo_megatron.reward import get_scorer


def _public_row(problem, truth, index):
    """A row exactly as the public DAPO-Math-17K parquet holds it."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": apply_template(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def test_apply_template_is_the_dapo_text():
    assert apply_template("What is 1+1?") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 1+1?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )


def test_public_style_parquet_with_repeats_is_deduplicated(tmp_path, caplog):
    # 3 unique problems, each repeated 4 times (with different indices, as in the public file), plus
    # problem 0 again with a different answer: that one is NOT a duplicate
    rows = [_public_row(f"problem {k}", str(10 + k), f"id-{k}-{rep}") for rep in range(4) for k in range(3)]
    rows.append(_public_row("problem 0", "999", "id-x"))
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING):
        records = load_prompts(path)
    assert (records.num_rows, records.num_duplicates, len(records)) == (13, 9, 4)  # 12 rows of 3 problems: 9 repeats
    assert "dropped 9 duplicate rows of 13" in caplog.text
    first = records[0]
    assert first == PromptRecord(
        prompt=apply_template("problem 0"),
        ground_truth="10",
        data_source="math_dapo",
        index="id-0-0",
        ability="MATH",
        reward_style="rule-lighteval/MATH_v2",
    )
    assert [r.ground_truth for r in records] == ["10", "11", "12", "999"]
    all_rows = load_prompts(path, dedup=False)
    assert len(all_rows) == 13 and all_rows.num_duplicates == 0


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_save_then_load_round_trip(tmp_path, suffix):
    records = make_synthetic_task(20, difficulty=2, seed=3, style="raw")
    records.append(
        PromptRecord(
            prompt="p",
            ground_truth="1",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "p"}],
        )
    )
    path = save_prompts(records, tmp_path / f"sub/task{suffix}")
    loaded = load_prompts(path, dedup=False)
    assert list(loaded) == records
    templated = load_prompts(path, dedup=False, prompt_template="dapo")
    assert templated[0].prompt == apply_template(records[0].prompt)
    assert templated[-1].chat() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": apply_template("p")},
    ]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad_row, column",
    [
        ({"reward_model": {"ground_truth": ["4"]}}, "reward_model.ground_truth"),
        ({"reward_model": {"style": "x"}}, "reward_model.ground_truth"),
        ({"reward_model": "4"}, "reward_model"),
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [{"content": 5, "role": "user"}]}, "prompt[0].content"),
        ({"prompt": [{"content": "hi", "role": "bot"}]}, "prompt[0].role"),
        ({"prompt": [{"content": "hi", "role": "system"}]}, "prompt"),
        ({"data_source": 3}, "data_source"),
        ({"extra_info": {"index": [1]}}, "extra_info.index"),
    ],
)
def test_jsonl_schema_errors_name_file_row_and_column(tmp_path, bad_row, column):
    good = _public_row("q", "4", "i")
    bad = dict(good, **bad_row)
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", good, bad])  # a blank line is skipped
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert str(path) in msg and "row 2 (0-based), line 4" in msg and f"'{column}'" in msg


def test_jsonl_invalid_json_and_missing_column(tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [_public_row("q", "4", "i"), "{not json"])
    with pytest.raises(ValueError, match=r"broken\.jsonl: row 1 \(0-based\), line 2: not valid JSON"):
        load_prompts(path)
    row = _public_row("q", "4", "i")
    del row["data_source"]
    path = _write_jsonl(tmp_path / "missing.jsonl", [row])
    with pytest.raises(ValueError, match=r"missing\.jsonl: row 0 \(0-based\), line 1: column 'data_source' is missing"):
        load_prompts(path)


def test_parquet_missing_column_and_bad_cell(tmp_path):
    rows = [_public_row("q", "4", "i")]
    for row in rows:
        del row["reward_model"]
    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"nocol\.parquet: row 0 .*column 'reward_model' is missing"):
        load_prompts(path)
    rows = [_public_row("q", "4", "i"), _public_row("r", None, "j")]  # a null ground truth in row 1
    path = tmp_path / "null.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"null\.parquet: row 1 \(0-based\): column 'reward_model.ground_truth'"):
        load_prompts(path)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_prompts(tmp_path / "nope.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown prompt file type '.csv'"):
        load_prompts(tmp_path / "x.csv")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_prompts(tmp_path / "junk.parquet")
    with pytest.raises(ValueError, match="prompt_template"):
        load_prompts(tmp_path / "x.csv", prompt_template="chatml")


# ---- synthetic task ----

_EXPR = re.compile(r"^(\d+)([+*])(\d+)(?:([+-])(\d+))?=$")


def _evaluate_compact(prompt):
    a, op, b, op2, c = _EXPR.match(prompt).groups()
    value = int(a) + int(b) if op == "+" else int(a) * int(b)
    if op2:
        value = value + int(c) if op2 == "+" else value - int(c)
    return value


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY_LEVELS))
def test_synthetic_answers_are_the_arithmetic(difficulty):
    records = make_synthetic_task(200, difficulty=difficulty, seed=7, style="compact")
    assert len(records) == 200
    for r in records:
        # level 6 (chain sums) has 2-6 terms, beyond _EXPR's three: its value is the sum of the terms
        chain = sum(int(t) for t in r.prompt.rstrip("=").split("+")) if difficulty == 6 else None
        assert r.ground_truth == str(chain if difficulty == 6 else _evaluate_compact(r.prompt))
        assert get_scorer(r.data_source)(f"Answer: {r.ground_truth}", r.ground_truth).acc
    numbers = [int(n) for r in records for n in re.findall(r"\d+", r.prompt)]
    if difficulty == 1:
        assert max(numbers) <= 9 and all(_EXPR.match(r.prompt).group(2) == "+" for r in records)
    if difficulty == 2:
        assert min(numbers) >= 10 and max(numbers) <= 99
    if difficulty == 3:
        ops = {_EXPR.match(r.prompt).group(2) for r in records}
        assert ops == {"+", "*"}
    if difficulty == 5:
        assert any(int(r.ground_truth) > 1000 for r in records)
    if difficulty == 6:
        assert max(numbers) <= 9 and min(numbers) >= 1 and {r.prompt.count("+") for r in records} == {1, 2, 3, 4, 5}


def test_synthetic_is_deterministic_and_styled():
    a = make_synthetic_task(50, difficulty=3, seed=11)
    assert a == make_synthetic_task(50, difficulty=3, seed=11)
    assert a != make_synthetic_task(50, difficulty=3, seed=12)
    compact = make_synthetic_task(50, difficulty=3, seed=11, style="compact")
    raw = make_synthetic_task(50, difficulty=3, seed=11, style="raw")
    assert [r.ground_truth for r in compact] == [r.ground_truth for r in a] == [r.ground_truth for r in raw]
    assert a[0].prompt == apply_template(raw[0].prompt)
    assert raw[0].prompt.replace(" ", "").replace("Whatis", "").replace("?", "=") == compact[0].prompt
    assert len({r.index for r in a}) == 50


def test_synthetic_bad_arguments():
    with pytest.raises(ValueError, match="difficulty=9"):
        make_synthetic_task(1, difficulty=9, seed=0)
    with pytest.raises(ValueError, match="style"):
        make_synthetic_task(1, difficulty=1, seed=0, style="chat")
