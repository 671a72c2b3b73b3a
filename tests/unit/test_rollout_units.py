"""Pure pieces of the rollout layer: request parsing (SGLang's normalisation), the SGLang command line
and version check, buckets, the registry, checkpoint shapes, group scoring (overlong shaping by hand),
sample rids and seeds, the weight-version check."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.cpu_engine.protocol import RequestError, parse_generate
from dapo_megatron.rollout.registry import read_registrations, write_registration
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
from dapo_megatron.rollout.sglang_launcher import SGLangSettings, check_sglang_version, sglang_command
from dapo_megatron.transfer.weight_sync import check_against, checkpoint_shapes
from dapo_megatron.weights.export import bucketize as buckets

V = 100


def parse(body, context_length: int = 1000):
    return parse_generate(body, vocab_size=V, tokenize=lambda t: [ord(c) % V for c in t], context_length=context_length)


def test_parse_single_batch_and_n_expansion():
    seqs, as_list = parse({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "rid": "r"})
    assert not as_list and len(seqs) == 1 and seqs[0].rid == "r" and seqs[0].params.max_new_tokens == 3
    # a batch of n = 1 items: rid "b" -> b_0, b_1 (GenerateReqInput._normalize_rid); a list is kept as is
    seqs, as_list = parse({"input_ids": [[1], [2, 3]], "rid": "b"})
    assert as_list and [(s.prompt_ids, s.rid) for s in seqs] == [([1], "b_0"), ([2, 3], "b_1")]
    seqs, _ = parse({"input_ids": [[1], [1]], "rid": ["q-0-0.", "q-0-1."]})
    assert [s.rid for s in seqs] == ["q-0-0.", "q-0-1."]
    # n > 1: prompt-major samples, each with a FRESH uuid rid (SGLang's regenerate_rid): never "b", "b_0" ...
    seqs, as_list = parse({"input_ids": [[1], [2, 3]], "sampling_params": {"n": 2}, "rid": "b"})
    assert as_list and [(s.prompt_ids, s.sample_index) for s in seqs] == [([1], 0), ([1], 1), ([2, 3], 0), ([2, 3], 1)]
    assert len({s.rid for s in seqs}) == 4 and all(len(s.rid) == 32 and "_" not in s.rid for s in seqs)
    seqs, as_list = parse({"text": "ab", "sampling_params": {"n": 3}})
    assert as_list and len(seqs) == 3 and seqs[0].prompt_ids == [97 % V, 98 % V]
    seqs, _ = parse(
        {
            "input_ids": [[1], [2]],
            "sampling_params": [{"temperature": 0.5}, {"top_k": 4}],
            "return_logprob": [True, False],
        }
    )
    assert (seqs[0].params.temperature, seqs[1].params.top_k) == (0.5, 4)
    assert (seqs[0].return_logprob, seqs[1].return_logprob) == (True, False)


@pytest.mark.parametrize(
    "body, field, status",
    [
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", 400),
        ({"input_ids": [1], "sampling_params": {"n": True}}, "sampling_params.n", 400),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos", 400),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, "sampling_params.sampling_seed", 400),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params.temprature", 400),  # SGLang: 500
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty", 400),
        ({"input_ids": [1], "stream": True}, "stream", 400),
        ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num", 400),
        ({"input_ids": [1], "return_logprob": [True, True]}, "return_logprob", 400),
        ({"input_ids": [[1], [2]], "return_logprob": [True, True], "sampling_params": {"n": 2}}, "return_logprob", 400),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid", 400),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid", 400),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params", 400),
        ({"text": ""}, "text", 400),
        ({"input_ids": []}, "input_ids", 400),
        ({"input_ids": [1] * 10}, "input_ids", 400),  # prompt >= context length 10
        ({"input_ids": [1] * 4, "sampling_params": {"max_new_tokens": 7}}, "input_ids", 400),  # 4 + 7 > 10
    ],
)
def test_parse_errors_name_the_field(body, field, status):
    with pytest.raises(RequestError) as info:
        parse(body, context_length=10)
    assert (info.value.field, info.value.status) == (field, status)


def test_context_length_boundary_and_ignored_fields():
    seqs, _ = parse({"input_ids": [1] * 4, "sampling_params": {"max_new_tokens": 6}}, context_length=10)  # 4 + 6 = 10
    assert seqs[0].params.max_new_tokens == 6
    seqs, _ = parse({"input_ids": [1], "log_metrics": False, "not_an_sglang_field": 1})  # SGLang ignores extras
    assert len(seqs) == 1


def test_text_without_tokenizer_is_refused():
    with pytest.raises(RequestError, match="no tokenizer"):
        parse_generate({"text": "hi"}, vocab_size=V, tokenize=None, context_length=100)


def test_sglang_command_line():
    cmd = sglang_command(
        SGLangSettings(
            model_path="/ckpt/q7b",
            tp_size=4,
            context_length=22528,
            mem_fraction_static=0.55,
            colocate=True,
            seed=42,
            host="0.0.0.0",
            port=31000,
            python="python3",
            extra_args=("--disable-radix-cache",),
        )
    )
    assert cmd == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/q7b",
        "--tp-size",
        "4",
        "--mem-fraction-static",
        "0.55",
        "--random-seed",
        "42",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--dtype",
        "auto",
        "--base-gpu-id",
        "0",
        "--context-length",
        "22528",
        "--enable-memory-saver",
        "--disable-radix-cache",
    ]
    plain = sglang_command(SGLangSettings(model_path="/m", python="p"))
    assert "--enable-memory-saver" not in plain and "--context-length" not in plain
    for bad in (
        dict(tp_size=0),
        dict(mem_fraction_static=1.0),
        dict(port=70000),
        dict(model_path=""),
        dict(context_length=-1),
    ):
        with pytest.raises(ValueError):
            sglang_command(SGLangSettings(**{"model_path": "/m", **bad}))


def test_launcher_refuses_another_sglang_minor_unless_allowed():
    check_sglang_version("0.5.21", allow_other=False)
    check_sglang_version("0.5.23", allow_other=False)  # same minor release: same protocol
    with pytest.raises(RuntimeError, match=r"sglang 0\.6\.0 is installed.*--allow-sglang-version"):
        check_sglang_version("0.6.0", allow_other=False)
    check_sglang_version("0.6.0", allow_other=True)
    with pytest.raises(RuntimeError, match="not installed"):
        check_sglang_version(None, allow_other=True)


def test_launch_paths_pass_the_context_length():
    """Every engine launcher passes --context-length = max_prompt_length + max_response_length."""
    from dapo_megatron.config import Config
    from dapo_megatron.launch.slurm.colocated import engine_commands
    from dapo_megatron.launch.slurm.render import render_rollout_array

    cfg = Config()
    cfg.rollout.max_prompt_length, cfg.rollout.max_response_length = 2048, 20480
    cfg.model.path = "/ckpt/m"
    for engine in ("sglang", "cpu"):
        cfg.rollout.engine = engine
        cmd = engine_commands(cfg, host="n1")[0]
        assert cmd[cmd.index("--context-length") + 1] == "22528", engine
    cfg.rollout.engine = "sglang"
    script = render_rollout_array(cfg, register_dir="/r/engines")
    assert "CONTEXT_LENGTH=22528" in script and '--context-length "$CONTEXT_LENGTH"' in script


def test_buckets_bound_bytes_and_keep_order():
    named = [
        (f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])
    ]  # bytes 40 40 120 20 4
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
    settings = RolloutSettings(
        n=3, max_new_tokens=10, gen_batch_size=1, overlong_buffer_length=4, overlong_penalty_factor=0.5, progress=False
    )
    rewards = {
        "a": SimpleNamespace(score=1.0, acc=True, pred="7"),
        "b": SimpleNamespace(score=-1.0, acc=False, pred="x"),
    }
    sampler = RolloutSampler(pool=None, tokenizer=None, settings=settings, reward_fn=lambda text, gt: rewards[text])

    def out(text, n_tokens, finish):
        return {
            "text": text,
            "output_ids": list(range(n_tokens)),
            "prompt_ids": [1, 2],
            "meta_info": {
                "finish_reason": {"type": finish},
                "output_token_logprobs": [[-0.5 * i, i, None] for i in range(n_tokens)],
            },
        }

    group = sampler.score_group(
        SimpleNamespace(ground_truth="7"), [out("a", 5, "stop"), out("a", 8, "stop"), out("b", 10, "length")]
    )
    # L_max 10, L_cache 4: no penalty up to 6 tokens, (6 - L) / 4 after, times 0.5
    assert [s.reward for s in group] == pytest.approx([1.0, 1.0 + 0.5 * (6 - 8) / 4, -1.0 + 0.5 * (6 - 10) / 4])
    assert [s.acc for s in group] == [1.0, 1.0, 0.0]
    assert [s.truncated for s in group] == [False, False, True]
    assert group[1].rollout_logprobs == [-0.5 * i for i in range(8)]
    assert group[2].extra["pred"] == "x" and group[0].prompt_ids == [1, 2] and group[0].ground_truth == "7"


def test_settings_from_config():
    from dapo_megatron.config import Config

    cfg = Config()
    s = RolloutSettings.from_sections(cfg.rollout, cfg.algorithm, seed=cfg.trainer.seed, progress=False)
    assert (s.n, s.max_new_tokens, s.gen_batch_size) == (
        cfg.rollout.n,
        cfg.rollout.max_response_length,
        cfg.rollout.gen_batch_size,
    )
    assert (s.overlong_buffer_length, s.max_num_gen_batches, s.on_exhausted) == (
        cfg.algorithm.overlong_buffer_length,
        cfg.algorithm.max_num_gen_batches,
        cfg.algorithm.on_gen_batches_exhausted,
    )


def test_sample_rids_are_prefix_free_and_seeds_per_sample():
    """SGLang's scheduler aborts every request whose rid STARTS with the one named: "s-1-1" would also
    abort "s-1-10". The terminating "." makes no rid a prefix of another."""
    settings = RolloutSettings(n=16, max_new_tokens=4, gen_batch_size=1, seed=3, progress=False)
    sampler = RolloutSampler(pool=None, tokenizer=None, settings=settings, rid_prefix="s")
    rids = [r for k in (1, 10, 11, 100) for r in sampler.rids(k)]
    assert sampler.rids(1)[:2] == ["s-1-0.", "s-1-1."] and len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    params = sampler.sampling_params(5)
    assert [p["sampling_seed"] for p in params] == [3 * 1_000_003 + 5 + j for j in range(16)]
    assert all(p["n"] == 1 for p in params)
    unseeded = RolloutSampler(
        pool=None,
        tokenizer=None,
        rid_prefix="s",
        settings=RolloutSettings(n=2, max_new_tokens=4, gen_batch_size=1, per_sample_seeds=False),
    )
    assert all("sampling_seed" not in p for p in unseeded.sampling_params(0))
    with pytest.raises(ValueError, match="must not contain"):
        RolloutSampler(pool=None, tokenizer=None, settings=settings, rid_prefix="a.b")


def test_stale_weight_versions_are_detected():
    sampler = RolloutSampler(
        pool=None,
        tokenizer=None,
        rid_prefix="s",
        settings=RolloutSettings(n=2, max_new_tokens=4, gen_batch_size=1, progress=False),
    )
    sampler.weight_version = "step_3"

    def out(version, spans=None):
        meta = {"weight_version": version}
        if spans is not None:
            meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
        return {"meta_info": meta}

    assert not sampler.is_stale([out("step_3"), out("step_3", [("step_3", 0, 5)])])
    assert sampler.is_stale([out("step_3"), out("step_2")])
    # the last token's version is current, but the first 2 tokens came from the previous weights
    assert sampler.is_stale([out("step_3", [("step_2", 0, 2), ("step_3", 2, 5)])])
    assert sampler.is_stale([{"meta_info": {}}])  # an engine that does not say: not trusted


def test_the_health_wait_says_how_long_it_has_waited_then_returns_or_names_the_exit():
    """A real HTTP server on loopback answers 503 twice (a server still loading its model), then 200:
    one waiting line per failed poll (every_s=0), none after the 200. A process that exits first is named."""
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dapo_megatron.rollout.sglang_launcher import wait_healthy

    answers = [503, 503, 200]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    lines: list[str] = []
    try:
        wait_healthy(url, timeout_s=30, every_s=0, say=lines.append)
    finally:
        server.shutdown()
    assert len(lines) == 2 and answers == [200]
    assert all(line.startswith(f"[sglang] waiting for {url}/health: ") and "gives up in " in line for line in lines)
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    with pytest.raises(
        RuntimeError, match=r"sglang server exited with code 3 before answering http://127.0.0.1:9/health"
    ):
        wait_healthy("http://127.0.0.1:9", proc=exited, timeout_s=30, every_s=0, say=lines.append)
