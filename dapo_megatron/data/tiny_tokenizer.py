"""The embedded default's tokenizer: a fixed byte-level vocabulary with no merges (every byte, so every
digit, is one token) and its chat template. Apart from the model (data/tiny_model.py) so that what
only needs the vocabulary (the memory plan, the submit checks) does not load torch; transformers is
imported where the tokenizer is built.
"""

from __future__ import annotations

import math

PAD, EOS, UNK, USER, ASSISTANT = "<|pad|>", "<|endoftext|>", "<|unk|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, EOS, UNK, USER, ASSISTANT]  # ids 0..4
# One user turn in, the assistant's text out; a finished assistant turn ends with EOS (the stop token).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    + ASSISTANT
    + "{{ m['content'] }}"
    + EOS
    + "{% else %}"
    + USER
    + "{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """The 256 symbols byte-level BPE uses for bytes 0..255 (GPT-2 / Qwen2 mapping: ' ' -> 'Ġ')."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbol, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbol[b] = chr(b)
        else:
            symbol[b] = chr(256 + extra)
            extra += 1
    return [symbol[b] for b in range(256)]


def build_tiny_tokenizer():
    """Byte-level tokenizer with no merges: every byte (so every digit) is exactly one token.

    It is a Qwen2Tokenizer on purpose: transformers' AutoTokenizer rebuilds any tokenizer of a
    `qwen2` checkpoint as Qwen2Tokenizer (byte-level, Qwen2's split regex), so a tokenizer of
    another kind would silently change when the rollout server or the actor reloads it. Vocabulary:
    5 special tokens (ids 0..4) + 256 byte symbols = 261 ids.
    """
    from transformers import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + _byte_level_alphabet())}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def prompt_ids(tokenizer, prompt_text: str) -> list[int]:
    """Token ids of one user turn followed by the assistant tag (what the engine generates after)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def padded_vocab_size(n: int) -> int:
    """Embedding rows of a vocabulary of n ids."""
    return int(math.ceil(n / 64) * 64)  # 261 -> 320: a multiple that TP=2 (and TP=4) divides
