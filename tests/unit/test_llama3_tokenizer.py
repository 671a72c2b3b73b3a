"""Llama 3's tokenizer pipeline in this repo's prompt path (configs/runs/llama3.1-8b_dapo.yaml).

The tokenizer is built by transformers' own TikTokenConverter.converted() (the converter
convert_llama_weights_to_hf.py's Llama3Converter subclasses: the tiktoken regex Split, then ByteLevel
without its own regex, no normalizer) over a small BPE trained here, with Llama 3's special tokens: no
download. Checked: cpu_engine/token_bound.py's bound is sound for it (byte-level BPE), and a base tokenizer
without a chat template still starts every prompt with <|begin_of_text|> (the tokenizer's own leading special
tokens are kept: data/prompts.py), and a chat_template.jinja that writes it gives one, not two."""

import json
import random

import pytest

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|reserved_special_token_250|>",
]


@pytest.fixture(scope="module")
def llama3_style_dir(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class TrainedTikToken(TikTokenConverter):  # converted() with a BPE trained here instead of a tiktoken file
        def __init__(self, bpe):
            super().__init__(vocab_file=None)
            self.bpe = bpe

        def tokenizer(self):
            return self.bpe

    rng = random.Random(0)
    words = ["the", "answer", "is", " 42", "Solve", "math", "problem", "\n\n", "    ", "=====", "x^2", "中文", "é"]
    corpus = ["".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(50)) for _ in range(300)]
    bpe = Tokenizer(models.BPE())
    converter = TrainedTikToken(bpe)
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [  # the same split for training as converted() sets
            pre_tokenizers.Split(Regex(converter.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    backend = converter.converted()
    backend.add_special_tokens(LLAMA3_SPECIAL)
    # Meta's tokenizer.json ends with this post-processor: <|begin_of_text|> before every text encoded
    # with special tokens (ByteLevel offsets, then TemplateProcessing "<|begin_of_text|> $A")
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    out = tmp_path_factory.mktemp("llama3_tok")
    tok.save_pretrained(out)
    return out


def test_the_pipeline_is_llama3s(llama3_style_dir):
    spec = json.loads((llama3_style_dir / "tokenizer.json").read_text())
    kinds = [p["type"] for p in spec["pre_tokenizer"]["pretokenizers"]]
    assert kinds == ["Split", "ByteLevel"] and spec["pre_tokenizer"]["pretokenizers"][1]["use_regex"] is False
    assert spec["normalizer"] is None


def test_token_bound_is_sound_for_llama3_byte_level_bpe(llama3_style_dir):
    """A bound exists (ByteLevel pre-tokenizer, no normalizer) and never exceeds the true token count, special
    tokens written in the text included (one 30-character added token is one token)."""
    from transformers import AutoTokenizer

    from dapo_megatron.cpu_engine.token_bound import max_chars_per_token

    tok = AutoTokenizer.from_pretrained(llama3_style_dir)
    bound = max_chars_per_token(tok)
    assert bound == len("<|reserved_special_token_250|>")  # the longest entry: an added token, by its UTF-8 length
    rng = random.Random(1)
    alphabet = list("ab \n1234567890=") + ["éü中文한국어", "    ", "=====", "the answer"] + LLAMA3_SPECIAL
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) + "=" * rng.choice([0, 1000])
        assert -(-len(text) // bound) <= len(tok(text, add_special_tokens=False)["input_ids"]), text[:80]


def test_prompt_starts_with_one_begin_of_text_with_or_without_a_chat_template(llama3_style_dir, tmp_path):
    """Llama 3 always saw <|begin_of_text|> first. Without a chat template the prompt is the text after the
    tokenizer's own leading special tokens (data/prompts.py), so one BOS; with a template that writes
    {{ bos_token }} itself (chat_template.jinja takes precedence over tokenizer_config.json's), still one."""
    import shutil

    from transformers import AutoTokenizer

    from dapo_megatron.data.prompts import PromptRecord, apply_template, prompt_token_ids

    record = PromptRecord(prompt=apply_template("What is 6 x 7?"), ground_truth="42")
    plain = AutoTokenizer.from_pretrained(llama3_style_dir)
    assert plain.chat_template is None
    text_ids = plain(record.prompt, add_special_tokens=False)["input_ids"]
    assert plain(record.prompt)["input_ids"] == [plain.bos_token_id] + text_ids  # the post-processor's BOS
    assert prompt_token_ids(plain, record) == [plain.bos_token_id] + text_ids
    with_template = tmp_path / "model"
    shutil.copytree(llama3_style_dir, with_template)
    (with_template / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = AutoTokenizer.from_pretrained(with_template)
    assert prompt_token_ids(tok, record) == [tok.bos_token_id] + text_ids  # one BOS, then the same text
    # a snapshot whose tokenizer_config.json carries a chat template: chat_template.jinja takes precedence
    config = json.loads((with_template / "tokenizer_config.json").read_text())
    config["chat_template"] = "<|start_header_id|>user<|end_header_id|>{{ messages[0]['content'] }}<|eot_id|>"
    (with_template / "tokenizer_config.json").write_text(json.dumps(config))
    assert prompt_token_ids(AutoTokenizer.from_pretrained(with_template), record) == [tok.bos_token_id] + text_ids


def test_a_tokenizer_adding_only_an_end_token_gets_none_before_the_prompt(llama3_style_dir, tmp_path):
    """Only the special tokens before the text are kept: an end-of-text the tokenizer appends would end the
    prompt before the answer."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from dapo_megatron.data.prompts import prompt_token_ids

    tok = AutoTokenizer.from_pretrained(llama3_style_dir)
    backend = tok.backend_tokenizer
    eos_id = backend.token_to_id("<|end_of_text|>")
    bos_id = backend.token_to_id("<|begin_of_text|>")
    for template, expected_prefix in (("$A <|end_of_text|>", []), ("<|begin_of_text|> $A <|end_of_text|>", [bos_id])):
        backend.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<|begin_of_text|>", bos_id), ("<|end_of_text|>", eos_id)]
        )
        out = tmp_path / f"tok_{len(expected_prefix)}"
        PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
        ).save_pretrained(out)
        variant = AutoTokenizer.from_pretrained(out)
        text_ids = variant("6 x 7 =", add_special_tokens=False)["input_ids"]
        assert variant("6 x 7 =")["input_ids"][-1] == eos_id
        assert prompt_token_ids(variant, _Record("6 x 7 =")) == expected_prefix + text_ids


class _Record:
    """A prompt given as plain text (no chat): what prompt_token_ids reads of a record."""

    def __init__(self, prompt):
        self.prompt = prompt
