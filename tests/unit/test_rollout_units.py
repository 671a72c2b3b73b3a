"""Pure pieces of the rollout layer: request parsing, the SGLang command line, buckets, the
registry, checkpoint shapes, group scoring (overlong shaping by hand)."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.rollout.protocol import RequestError, parse_generate
from dapo_megatron.rollout.registry import read_registrations, write_registration
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command
from dapo_megatron.rollout.weight_sync import buckets, check_against, checkpoint_shapes

V = 100


def parse(body):
    return parse_generate(body, vocab_size=V, tokenize=lambda t: [ord(c) % V for c in t])


def test_parse_single_batch_and_n_expansion():
    seqs, as_list = parse({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "rid": "r"})
    assert not as_list and len(seqs) == 1 and seqs[0].rid == "r" and seqs[0].params.max_new_tokens == 3
    seqs, as_list = parse({"input_ids": [[1], [2, 3]], "sampling_params": {"n": 2}, "rid": "b"})
    assert as_list
    assert [(s.prompt_ids, s.rid, s.sample_index) for s in seqs] == [
        ([1], "b_0", 0), ([1], "b_0", 1), ([2, 3], "b_1", 0), ([2, 3], "b_1", 1)]
    seqs, as_list = parse({"text": "ab", "sampling_params": {"n": 3}})
    assert as_list and len(seqs) == 3 and seqs[0].prompt_ids == [97 % V, 98 % V]
    seqs, _ = parse({"input_ids": [[1], [2]], "sampling_params": [{"temperature": 0.5}, {"top_k": 4}],
                     "return_logprob": [True, False]})
    assert (seqs[0].params.temperature, seqs[1].params.top_k) == (0.5, 4)
    assert (seqs[0].return_logprob, seqs[1].return_logprob) == (True, False)


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"n": True}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, "sampling_params.sampling_seed"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "return_logprob": [True, True]}, "return_logprob"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ({"text": ""}, "text"),
])
def test_parse_errors_name_the_field(body, field):
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.field == field


def test_text_without_tokenizer_is_refused():
    with pytest.raises(RequestError, match="no tokenizer"):
        parse_generate({"text": "hi"}, vocab_size=V, tokenize=None)


def test_sglang_command_line():
    cmd = sglang_command(SGLangSettings(model_path="/ckpt/q7b", tp_size=4, mem_fraction_static=0.55, colocate=True,
                                        seed=42, host="0.0.0.0", port=31000, python="python3",
                                        extra_args=("--disable-radix-cache",)))
    assert cmd == ["python3", "-m", "sglang.launch_server", "--model-path", "/ckpt/q7b", "--tp-size", "4",
                   "--mem-fraction-static", "0.55", "--random-seed", "42", "--host", "0.0.0.0", "--port", "31000",
                   "--dtype", "auto", "--base-gpu-id", "0", "--enable-memory-saver", "--disable-radix-cache"]
    assert "--enable-memory-saver" not in sglang_command(SGLangSettings(model_path="/m", python="p"))
    for bad in (dict(tp_size=0), dict(mem_fraction_static=1.0), dict(port=70000), dict(model_path="")):
        with pytest.raises(ValueError):
            sglang_command(SGLangSettings(**{"model_path": "/m", **bad}))


def test_buckets_bound_bytes_and_keep_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])]  # bytes 40 40 120 20 4
    out = [[n for n, _ in b] for b in buckets(named, 80)]
    assert out == [["t0", "t1"], ["t2"], ["t3", "t4"]]  # 80 | 120 alone (over the bound) | 24
    with pytest.raises(ValueError):
        list(buckets(named, 0))


def test_check_against_names_the_tensor():
    specs = {"a.weight": [2, 3]}
    check_against(specs, [("a.weight", torch.zeros(2, 3))], engine="e")
    with pytest.raises(ValueError, match="'b.weight' does not exist"):
        check_against(specs, [("b.weight", torch.zeros(1))], engine="e")
    with pytest.raises(ValueError, match=r"'a.weight' has shape \[3, 2\], engine e expects \[2, 3\]"):
        check_against(specs, [("a.weight", torch.zeros(3, 2))], engine="e")


def test_checkpoint_shapes_reads_safetensors_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(4, 5), "y": torch.zeros(7)}, tmp_path / "model-1.safetensors")
    save_file({"z": torch.zeros(1, 2, 3)}, tmp_path / "model-2.safetensors")
    assert checkpoint_shapes(str(tmp_path)) == {"x": [4, 5], "y": [7], "z": [1, 2, 3]}
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "model-3.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    assert checkpoint_shapes(str(tmp_path))["w"] == [3]


def test_registry_roundtrip_and_bad_files(tmp_path):
    rec = {"host": "n1", "port": 30000, "url": "http://n1:30000", "tp_size": 2, "started_at": "2026-01-01T00:00:00"}
    path = write_registration(str(tmp_path), rec)
    assert path.endswith("n1_30000.json") and read_registrations(str(tmp_path)) == [rec]
    with pytest.raises(ValueError, match="lacks"):
        write_registration(str(tmp_path), {"host": "x"})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        read_registrations(str(tmp_path))


def test_score_group_overlong_shaping_truncation_and_logprobs():
    settings = RolloutSettings(n=3, max_new_tokens=10, gen_batch_size=1, overlong_buffer_length=4,
                               overlong_penalty_factor=0.5, progress=False)
    rewards = {"a": SimpleNamespace(score=1.0, acc=True, pred="7"), "b": SimpleNamespace(score=-1.0, acc=False, pred="x")}
    sampler = RolloutSampler(pool=None, tokenizer=None, settings=settings, reward_fn=lambda text, gt: rewards[text])

    def out(text, n_tokens, finish):
        return {"text": text, "output_ids": list(range(n_tokens)), "prompt_ids": [1, 2],
                "meta_info": {"finish_reason": {"type": finish},
                              "output_token_logprobs": [[-0.5 * i, i, None] for i in range(n_tokens)]}}

    group = sampler.score_group(SimpleNamespace(ground_truth="7"),
                                [out("a", 5, "stop"), out("a", 8, "stop"), out("b", 10, "length")])
    # L_max 10, L_cache 4: no penalty up to 6 tokens, (6 - L) / 4 after, times 0.5
    assert [s.reward for s in group] == pytest.approx([1.0, 1.0 + 0.5 * (6 - 8) / 4, -1.0 + 0.5 * (6 - 10) / 4])
    assert [s.acc for s in group] == [1.0, 1.0, 0.0]
    assert [s.truncated for s in group] == [False, False, True]
    assert group[1].rollout_logprobs == [-0.5 * i for i in range(8)]
    assert group[2].extra["pred"] == "x" and group[0].prompt_ids == [1, 2] and group[0].ground_truth == "7"


def test_settings_from_config():
    from dapo_megatron.config import Config

    cfg = Config()
    s = RolloutSettings.from_config(cfg, progress=False)
    assert (s.n, s.max_new_tokens, s.gen_batch_size) == (cfg.rollout.n, cfg.rollout.max_response_length,
                                                         cfg.rollout.gen_batch_size)
    assert (s.overlong_buffer_length, s.max_num_gen_batches, s.on_exhausted) == (
        cfg.algorithm.overlong_buffer_length, cfg.algorithm.max_num_gen_batches, cfg.algorithm.on_gen_batches_exhausted)
