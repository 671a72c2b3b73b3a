"""The fewest tokens a text can become, known without tokenizing it: so a prompt sure to exceed the context
length is refused at once instead of after seconds of tokenizing (5 MB of text: 6 s on a 2-core Xeon).

    bound = max_chars_per_token(tokenizer)        # None: no sound bound for this tokenizer
    min_tokens = -(-len(text) // bound)           # <= len(tokenizer(text).input_ids), always

Sound for byte-level BPE tokenizers (Qwen2/2.5/3, Llama 3, GPT-2: the `tokenizers` ByteLevel pre-tokenizer),
where a vocabulary entry spells one byte per character: a token stands for at most B bytes of the
(normalized) text, B the longest entry (added tokens by their UTF-8 length), and every character is at
least one byte. A normalizer may shorten the text first: NFC composes at most 3 characters into one
(Hangul jamo L+V+T), so the bound is divided by 3 under NFC; any other normalizer (or none of these
pre-tokenizers) gets no bound and the prompt is tokenized (on a worker thread) as before.
"""

from __future__ import annotations

import json


def _types(node) -> set[str]:
    if not isinstance(node, dict):
        return set()
    found = {node.get("type", "")}
    for child in node.get("pretokenizers", []) or node.get("normalizers", []) or []:
        found |= _types(child)
    return found


def max_chars_per_token(tokenizer) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if "ByteLevel" not in _types(spec.get("pre_tokenizer")):
        return None
    normalizer = spec.get("normalizer")
    kinds = _types(normalizer) - {"Sequence", ""} if normalizer else set()
    if not kinds <= {"NFC"}:
        return None
    added = (
        [t.content for t in tokenizer.added_tokens_decoder.values()]
        if hasattr(tokenizer, "added_tokens_decoder")
        else []
    )
    longest = max(
        [len(tok) for tok in backend.get_vocab(with_added_tokens=False)] + [len(t.encode("utf-8")) for t in added] + [1]
    )
    return longest * (3 if kinds else 1)
