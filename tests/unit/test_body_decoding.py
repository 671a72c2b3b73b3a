"""The CPU engine's decoding of large bodies (cpu_engine/guard.py): loads_yielding gives json.loads's value
or json.loads's exception, message and position included, for every body (the engine's 400 texts come
from them), while never holding the GIL for more than one container element; decode_json maps both the
same way."""

from __future__ import annotations

import json
import random

import pytest

from dapo_megatron.benchmarks.engine_abuse import ENDPOINTS, RAW, garbage
from dapo_megatron.cpu_engine import guard
from dapo_megatron.cpu_engine.protocol import RequestError

SHAPES = [
    b'{"input_ids": [[1,2],[3, 4]], "sampling_params": [{"a": 1}, {"b": [1, {"c": []}]}]}',
    b"[[[]]]",
    b'{"a": [[1] , [2] ] , "b": {"c": {"d": [[{}]]}}}',
    b"[ [ 1 ] ]",
    b'[{"a":1},{"a":2}]',
    b' \n{"x": [ {"y": [[1, 2], [3]]} ]}\n ',
    b"[[1,2] [3,4]]",
    b'{"a": 1,}',
    b"[[1],]",
    b'[[1], "x"]',
    b"[\t\n [1]]",
    b'{"a": [ ]}',
    b'{"a": 1, "a": [[2]]}',
    b'{"a": NaN, "b": [[Infinity]]}',
    b"  ",
    b"",
    # flat arrays, cut into pieces of _FLAT_PIECE characters (8 in these tests)
    b"[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]",
    b"[1,2,3,4,5,6,7,8,NaN,true,null,-1.5e3,false,-Infinity]",
    b'{"input_ids": [10, 20, 30, 40, 50, 60, 70, 80, 90] , "x": [1, 2, "a,b]", 3, 4, 5, 6, 7]}',
    b"[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]",
]


def outcome(fn, raw: bytes):
    try:
        return "value", repr(fn(raw))
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return type(err).__name__, str(err)


def corpus() -> list[bytes]:
    rng = random.Random(0)
    cases = list(RAW) + [garbage(rng, rng.choice(ENDPOINTS)[2]) for _ in range(1500)]
    for shape in SHAPES:  # every shape cut short, with a byte changed, with a byte inserted
        cases.append(shape)
        for cut in range(1, len(shape)):
            cases += [
                shape[:cut],
                shape[:cut] + bytes([rng.choice(b'[]{},:" 1x\xff\t')]) + shape[cut + 1 :],
                shape[:cut] + bytes([rng.choice(b'[]{},:" 1x\t')]) + shape[cut:],
            ]
    return cases + [
        b"[" * 5000,
        b'{"a":' * 3000,
        b"[" * 100 + b"]" * 100,
        b"\xef\xbb\xbf{}",
        b"\xef\xbb\xbf\xef\xbb\xbf{}",
        '{"a": "\u00e9"}'.encode("utf-16"),
        "[[1]]".encode("utf-32"),
    ]


def test_loads_yielding_is_json_loads(monkeypatch):
    monkeypatch.setattr(guard, "_FLAT_PIECE", 8)  # every flat array above is decoded in several pieces
    cases = corpus()
    differ = [
        (c[:60], outcome(json.loads, c), outcome(guard.loads_yielding, c))
        for c in cases
        if outcome(json.loads, c) != outcome(guard.loads_yielding, c)
    ]
    assert not differ, differ[:5]
    kinds = {outcome(json.loads, c)[0] for c in cases}
    assert kinds == {"value", "JSONDecodeError", "UnicodeDecodeError", "RecursionError"}  # every path was taken


def test_a_batch_is_decoded_one_prompt_per_c_call(monkeypatch):
    """Each call of json's C scanner (the GIL is held for its whole length) covers one prompt at most,
    and a piece of _FLAT_PIECE characters of a long flat prompt."""
    spans: list[tuple[int, int]] = []
    c_scan = guard._C_SCAN

    def counting(s, idx):
        value, end = c_scan(s, idx)
        spans.append((idx, end))
        return value, end

    monkeypatch.setattr(guard, "_C_SCAN", counting)
    prompts = [[7] * 100 for _ in range(50)]
    raw = json.dumps({"input_ids": prompts, "sampling_params": {"max_new_tokens": 3}, "rid": "r"}).encode()
    assert guard.loads_yielding(raw) == json.loads(raw)
    widest = max(end - start for start, end in spans)
    assert widest == len(json.dumps(prompts[0])), widest  # one prompt
    assert len(spans) >= len(prompts)
    spans.clear()
    monkeypatch.setattr(guard, "_FLAT_PIECE", 1000)
    flat = json.dumps({"input_ids": list(range(5000))}).encode()
    assert guard.loads_yielding(flat) == json.loads(flat)
    assert len(spans) > len(flat) // 1100 and max(end - start for start, end in spans) < 1000 + 10


@pytest.mark.parametrize("yielding", [False, True])
def test_decode_json_maps_errors_the_same_either_way(yielding):
    def message(raw, **kw):
        with pytest.raises(RequestError) as err:
            guard.decode_json(raw, yielding=yielding, **kw)
        return err.value.field, str(err.value)

    assert message(b'{"input_ids": [1,]}') == ("body", "body: not valid JSON (Expecting value at char 17)")
    assert message(b'{"a": "\xff"}') == ("body", "body: not UTF-8 text (byte 7: invalid start byte)")
    assert message(b"[" * 5000) == ("body", "body: JSON nested too deeply (no SGLang request nests more than 4 levels)")
    assert message(b"[[1]]") == ("body", "body: must be a JSON object")
    assert guard.decode_json(b"", optional=True, yielding=yielding) == {}
    assert guard.decode_json(b"null", optional=True, yielding=yielding) == {}
    assert guard.decode_json(b'{"a": [[1], {"b": 2}]}', yielding=yielding) == {"a": [[1], {"b": 2}]}
