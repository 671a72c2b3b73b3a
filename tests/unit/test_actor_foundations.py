"""Pieces of actor/parallel.py and actor/model.py that need no process group: launcher
environments (torchrun, srun), the packed-attention mask, vocab padding, config errors."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor import model as model_mod
from dapo_megatron.actor.parallel import _first_slurm_host, launch_env


def test_launch_env_from_torchrun():
    env = launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "2222",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
        }
    )  # torchrun inside sbatch: torchrun wins
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 4, 1, "node7", 2222)


def test_launch_env_from_srun_takes_the_first_node_and_a_job_port():
    env = launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[003-004,9],cpu1",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert env.master_addr == "gpu003"
    assert env.master_port == 20000 + 123456 % 20000


def test_slurm_host_parsing_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the fallback parser answers
    assert _first_slurm_host("node[07-09]") == "node07"
    assert _first_slurm_host("a1,b[2-3]") == "a1"
    assert _first_slurm_host("single") == "single"


def test_launch_env_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        launch_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_block_causal_mask_by_hand():
    from attention_reference import block_causal_mask

    # sequences of 3 and 2 tokens, then 1 padding token: its own block (the tests' dense reference)
    mask = block_causal_mask(torch.tensor([0, 3, 5]), 6).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_packed_helpers():
    params = model_mod.packed_seq_params_from_lengths([3, 2], device="cpu")
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.max_seqlen_q == 3 and params.qkv_format == "thd"
    assert model_mod.packed_position_ids([3, 2]).tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(ValueError, match="positive"):
        model_mod.packed_seq_params_from_lengths([3, 0])


def test_padded_vocab_size():
    assert model_mod.padded_vocab_size(300, tp=1) == 384
    assert model_mod.padded_vocab_size(300, tp=2) == 512
    assert model_mod.padded_vocab_size(151936, tp=4) == 152064  # Qwen2.5: already 128-aligned -> 512-aligned


def test_unsupported_configs_raise_value_errors():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        model_mod.model_type_of(GPT2Config())
    scaled = LlamaConfig(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        }
    )
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        model_mod.rope_theta_of(scaled)


def test_te_backend_without_transformer_engine_names_the_config_key():
    try:
        import transformer_engine  # noqa: F401

        pytest.skip("Transformer Engine is installed here")
    except (ImportError, RuntimeError):
        pass
    with pytest.raises(ValueError, match="actor.attention_backend"):
        model_mod.te_layer_spec()


def test_llama3_rope_settings_and_unsupported_constants():
    from transformers import LlamaConfig

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert model_mod.rope_settings_of(LlamaConfig(max_position_embeddings=131072, rope_parameters=params)) == (
        500000.0,
        8.0,
    )
    odd = LlamaConfig(max_position_embeddings=131072, rope_parameters={**params, "high_freq_factor": 2.0})
    with pytest.raises(ValueError, match="high_freq_factor"):
        model_mod.rope_settings_of(odd)
