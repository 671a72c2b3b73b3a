"""rollout.quantization=fp8 on a real SGLang GPU engine (what the CPU conformance cannot run: the block-FP8
GEMMs and SGLang's own start-up on a GPU): an engine started by our launcher's command line from the
block-FP8 export serves, and a sync through the weight-update session reloads it in place.

    tests/gpu/run_all.sh --call 3 OUT   (step sglang_fp8), or: pytest -m gpu tests/gpu/test_sglang_fp8_gpu.py

Needs sglang==0.5.21 with its GPU kernels (sgl_kernel) and nvidia-modelopt on the GPU machine: skipped
when they are missing. A random Qwen2 whose projections are whole 128-blocks (SGLang's block-shape rule),
the tiny byte tokenizer. Checks, with greedy decoding of one prompt:
  1. the engine starts (SGLang reads quant_method fp8 + weight_block_size from the export) and answers;
  2. syncing the export's own tensors (begin / update_weights_from_tensor over CUDA IPC / end) gives the
     same tokens and log-probs as before: the reload lands where the start-up load did;
  3. syncing moved weights changes the log-probs; syncing the base weights again restores them.
"""

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_megatron.data.tiny_model import build_tiny_tokenizer

    torch.manual_seed(0)
    tok = build_tiny_tokenizer()
    cfg = Qwen2Config(
        hidden_size=512,
        head_dim=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        num_hidden_layers=2,
        vocab_size=len(tok),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    return root / "base"


async def _greedy(client) -> tuple[list[int], list[float]]:
    out = await client.generate(
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    )
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


async def _sync(client, named, version: str) -> None:
    from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank

    await client.begin_weight_update()
    try:
        await client.update_weights_from_tensor([serialize_for_engine_rank(named)], weight_version=version)
    finally:
        await client.end_weight_update()


def test_sglang_fp8_engine_starts_from_the_export_and_reloads_syncs(tmp_path):
    pytest.importorskip("sgl_kernel", reason="sglang's GPU kernels are not installed on this machine")
    pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed on this machine")
    from safetensors.torch import load_file

    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
    from dapo_megatron.quant.fp8_format import check_sglang_block_shapes
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command, wait_healthy

    base = _model(tmp_path)
    check_sglang_block_shapes(__import__("json").loads((base / "config.json").read_text()))
    export = export_fp8_checkpoint(base, tmp_path / "fp8")
    port = _free_port()
    cmd = sglang_command(
        SGLangSettings(
            model_path=str(export),
            quantization="fp8",
            port=port,
            host="127.0.0.1",
            mem_fraction_static=0.3,
            context_length=256,
            python=sys.executable,
        )
    )
    log = open(tmp_path / "sglang.log", "wb")  # noqa: SIM115 (the engine writes it until the finally closes it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=proc, timeout_s=900)
        conv = Fp8SyncConverter.from_checkpoint(export)
        start = {k: v.cuda() for k, v in load_file(str(export / "model.safetensors")).items()}
        state = {k: v.float().cuda() for k, v in load_file(str(base / "model.safetensors")).items()}
        gen = torch.Generator(device="cuda").manual_seed(1)
        moved = {
            k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=gen, device="cuda") for k, v in state.items()
        }

        async def scenario():
            async with EngineClient(url) as client:
                first = await _greedy(client)
                await _sync(client, list(start.items()), "same")
                same = await _greedy(client)
                await _sync(client, list(conv.convert(moved.items())), "moved")
                after_move = await _greedy(client)
                await _sync(client, list(conv.convert(state.items())), "back")
                back = await _greedy(client)
                return first, same, after_move, back

        first, same, after_move, back = asyncio.run(scenario())
        assert all(torch.isfinite(torch.tensor(first[1]))), first
        assert same[0] == first[0] and same[1] == pytest.approx(first[1], abs=1e-3)
        assert after_move[1] != pytest.approx(first[1], abs=1e-3)  # the sync really changed the weights
        assert back[0] == first[0] and back[1] == pytest.approx(first[1], abs=1e-3)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "sglang.log").read_text(errors="replace")[-3000:])
