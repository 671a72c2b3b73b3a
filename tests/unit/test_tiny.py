"""The embedded default's tokenizer, tiny Qwen2, warm start and train/eval split (dapo_megatron.data.tiny_model)."""

import math

import pytest
import torch

from dapo_megatron.config import load_config
from dapo_megatron.data.tiny_model import (
    TinyModelSpec,
    build_tiny_model,
    sft_batch,
    smoothed_nll,
    synthetic_train_eval,
    warm_start,
)
from dapo_megatron.data.tiny_tokenizer import ASSISTANT, EOS, PAD, USER, build_tiny_tokenizer, prompt_ids
from dapo_megatron.launch.prepare import tiny_model_dir

SMALL = TinyModelSpec(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=64
)


def test_tokenizer_one_token_per_character_and_round_trip():
    tok = build_tiny_tokenizer()
    assert len(tok) == 5 + 256
    assert [tok.convert_tokens_to_ids(t) for t in (PAD, EOS, "<|unk|>", USER, ASSISTANT)] == [0, 1, 2, 3, 4]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    text = "Answer: 1234\n 27+58= x"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # every character, every digit, is its own token
    assert len({tok.convert_ids_to_tokens(i) for i in tok.encode("0123456789", add_special_tokens=False)}) == 10
    assert tok.decode(ids) == text
    # chat template: <|user|> content <|assistant|>, and the EOS closes an assistant turn
    p = prompt_ids(tok, "27+58=")
    assert p == [3] + tok.encode("27+58=", add_special_tokens=False) + [4]
    full = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "Answer: 2"}], tokenize=False
    )
    assert full == f"{USER}1+1={ASSISTANT}Answer: 2{EOS}"


def test_saved_model_dir_reloads_the_same_tokenizer(tmp_path):
    """AutoTokenizer rebuilds the tokenizer of any qwen2 checkpoint as Qwen2Tokenizer: it must not change it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path, seed=0, spec=SMALL)
    tok, reloaded = build_tiny_tokenizer(), AutoTokenizer.from_pretrained(path)
    for text in ["a  b\n\n12 + 7 = ?", "Answer: -42", "ünï€"]:
        assert reloaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert prompt_ids(reloaded, "9*9=") == prompt_ids(tok, "9*9=")
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == ("qwen2", 320, 32, 1)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (2, 2, False)
    assert cfg.eos_token_id == 1 and model.dtype == torch.float32


def test_build_is_idempotent_and_seeded(tmp_path):
    path = build_tiny_model(tmp_path, seed=0, spec=SMALL)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path, seed=0, spec=SMALL) == path
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    from safetensors.torch import load_file

    before = load_file(weights)
    build_tiny_model(tmp_path, seed=1, spec=SMALL)  # another seed rebuilds in place
    after = load_file(weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[name], after[name])
    other = build_tiny_model(tmp_path / "again", seed=1, spec=SMALL)
    assert torch.equal(load_file(other / "model.safetensors")[name], after[name])


def test_spec_validation():
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        TinyModelSpec(hidden_size=48, num_heads=3, num_kv_heads=2).validate()


def test_smoothed_nll_hand_computed():
    # V = 4, one labelled position whose logits are [0, 1, 2, 3] and whose target is 3; smoothing over
    # S = {1, 2, 3}. With lse = log(1 + e + e^2 + e^3): nll = lse - 3, uniform = mean(lse - s for s in S) = lse - 2,
    # loss = (1 - eps) nll + eps uniform = lse - 3 + eps.
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]]])  # the last position predicts nothing
    labels = torch.tensor([[-100, 3]])
    lse = math.log(1 + math.e + math.e**2 + math.e**3)
    for eps in (0.0, 0.1, 0.5):
        got = smoothed_nll(logits, labels, eps=eps, smooth_ids=torch.tensor([1, 2, 3]))
        assert float(got) == pytest.approx(lse - 3 + eps, abs=1e-6)
    plain = torch.nn.functional.cross_entropy(logits[0, :1], torch.tensor([3]))
    assert float(smoothed_nll(logits, labels, eps=0.0, smooth_ids=torch.tensor([0]))) == pytest.approx(float(plain))


def test_sft_batch_labels_only_the_response():
    tok = build_tiny_tokenizer()
    batch = sft_batch(tok, ["1+1=", "10+10="], ["2", "20"])
    row = batch["labels"][0].tolist()
    p = prompt_ids(tok, "1+1=")
    resp = tok.encode("Answer: 2", add_special_tokens=False) + [tok.eos_token_id]
    assert row[: len(p)] == [-100] * len(p)
    assert row[len(p) : len(p) + len(resp)] == resp
    assert row[len(p) + len(resp) :] == [-100] * (len(row) - len(p) - len(resp))  # right padding
    assert batch["attention_mask"][0].sum() == len(p) + len(resp)


def test_warm_start_is_deterministic_cached_and_learns(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, _ = synthetic_train_eval(num_train=64, num_eval=8, difficulty=1, seed=3, style="compact")
    prompts, answers = [r.prompt for r in train], [r.ground_truth for r in train]
    init = build_tiny_model(tmp_path / "a", seed=0, spec=SMALL)
    kw = dict(prompts=prompts, answers=answers, steps=40, batch_size=16, lr=3e-3, seed=5, label_smoothing=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warm_a = warm_start(init, tmp_path / "a", **kw)
    finally:
        torch.set_num_threads(threads)
    stamp = (warm_a / "model.safetensors").stat().st_mtime_ns
    done: list[int] = []  # on_step: the progress line's count (launch/prepare.py), never the maths
    assert warm_start(init, tmp_path / "a", **kw, on_step=done.append) == warm_a
    assert (warm_a / "model.safetensors").stat().st_mtime_ns == stamp and done == []  # cache hit: no steps
    torch.set_num_threads(2)  # the caller's thread count does not reach the warm start (it runs on 1)
    try:
        warm_b = warm_start(init, tmp_path / "b", **kw, on_step=done.append)
        assert done == list(range(1, 41))
        assert torch.get_num_threads() == 2  # and is restored afterwards
    finally:
        torch.set_num_threads(threads)
    wa, wb = load_file(warm_a / "model.safetensors"), load_file(warm_b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # same seed -> bit-identical weights

    tok = AutoTokenizer.from_pretrained(warm_a)
    batch = sft_batch(tok, prompts[:16], answers[:16])

    def nll(path):
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            return float(model(**batch).loss)

    assert nll(warm_a) < 0.6 * nll(init)  # 40 steps already learn most of the answer format


def test_train_eval_split_is_disjoint_and_deterministic():
    train, held = synthetic_train_eval(num_train=2000, num_eval=100, difficulty=2, seed=1234, style="compact")
    assert len(train) == 2000 and len(held) == 100
    assert not {r.prompt for r in held} & {r.prompt for r in train}
    again, held_again = synthetic_train_eval(num_train=2000, num_eval=100, difficulty=2, seed=1234, style="compact")
    assert [r.prompt for r in held_again] == [r.prompt for r in held]
    with pytest.raises(ValueError, match="cannot draw 50 eval problems"):
        synthetic_train_eval(num_train=2000, num_eval=50, difficulty=1, seed=0, style="compact")  # 100 problems only


def test_prepare_tiny_model_from_config(tmp_path):
    cfg = load_config(
        None,
        [
            "tiny.enabled=true",
            "tiny.hidden_size=32",
            "tiny.num_layers=1",
            "tiny.num_heads=2",
            "tiny.intermediate_size=64",
            "tiny.warm_start_steps=2",
            "tiny.warm_start_batch_size=4",
            "data.synthetic.num_train=32",
            "data.synthetic.num_eval=4",
            "data.synthetic.style=compact",
            "rollout.max_prompt_length=16",
            "rollout.max_response_length=16",
            "actor.micro_batch_tokens=64",
            "algorithm.overlong_buffer_length=4",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    path = tiny_model_dir(cfg)
    assert path == str(tmp_path / "tiny_model" / "warm")
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).hidden_size == 32
    cfg.tiny.enabled = False
    with pytest.raises(ValueError, match="tiny.enabled is false"):
        tiny_model_dir(cfg)


def test_require_cached_uses_the_cache_or_names_why_it_cannot(tmp_path):
    """tiny.require_cached=true (the GPU check's e2e runs): the model prepared beforehand is used as is; an
    empty cache or one built with other settings stops with the key, the directory and what differs, and
    nothing is built or written."""
    keys = [
        "tiny.enabled=true",
        "tiny.hidden_size=32",
        "tiny.num_layers=1",
        "tiny.num_heads=2",
        "tiny.intermediate_size=64",
        "tiny.warm_start_steps=2",
        "tiny.warm_start_batch_size=4",
        "data.synthetic.num_train=32",
        "data.synthetic.num_eval=4",
        "data.synthetic.style=compact",
        "rollout.max_prompt_length=16",
        "rollout.max_response_length=16",
        "actor.micro_batch_tokens=64",
        "algorithm.overlong_buffer_length=4",
        f"tiny.cache_dir={tmp_path / 'cache'}",
    ]
    cached = [*keys, "tiny.require_cached=true"]
    with pytest.raises(ValueError, match=r"tiny.require_cached=true: .*cache/tiny_model/init: nothing is built there"):
        tiny_model_dir(load_config(None, cached))
    assert not (tmp_path / "cache").exists()
    built = tiny_model_dir(load_config(None, keys))
    stamp = (tmp_path / "cache" / "tiny_model" / "warm" / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir(load_config(None, cached)) == built
    with pytest.raises(ValueError, match=r"warm: it was built with other settings \(build.json differs in steps\)"):
        tiny_model_dir(load_config(None, [*cached, "tiny.warm_start_steps=3"]))
    with pytest.raises(ValueError, match=r"init: it was built with other settings \(build.json differs in seed\)"):
        tiny_model_dir(load_config(None, [*cached, "trainer.seed=7"]))
    assert (tmp_path / "cache" / "tiny_model" / "warm" / "model.safetensors").stat().st_mtime_ns == stamp
