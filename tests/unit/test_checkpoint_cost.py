"""One checkpoint's bytes, host memory and seconds as `plan` predicts them (memplan/checkpoint_cost.py), on a
model small enough to count by hand."""

from __future__ import annotations

import pytest

from dapo_megatron.memplan.arch import ModelDims
from dapo_megatron.memplan.checkpoint_cost import checkpoint_cost
from dapo_megatron.memplan.static import Layout

# hidden 8, FFN 16, 2 layers, 2 heads of 4 + 1 KV head, vocabulary 10, untied, no biases. By hand:
#   embedding 10*8 = 80, LM head 80, final norm 8
#   per layer: q 8*8 = 64, k 8*4 = 32, v 32, o 64, MLP 3*16*8 = 384, two norms 16  -> 592, two layers 1184
#   total 80 + 80 + 8 + 1184 = 1352 parameters
DIMS = ModelDims("qwen2", 8, 16, 2, 2, 1, 4, 10, False, False, 2, "hand", "test")
P = 1352


def test_the_sizes_counted_by_hand():
    cost = checkpoint_cost(DIMS, Layout(tp=2, dp=4), weight_bytes=2, fs_bytes_per_s=1e3)
    assert cost.disk_bytes == P * 14  # bf16 weights + fp32 master + two Adam moments
    assert cost.shard_state_bytes == 12 * P / 2  # one TP rank's position
    assert cost.save_host_bytes == pytest.approx(2.5 * 12 * P / 2)  # gathered over DP, x the measured factor
    # the 4 DP ranks of each of the 2 positions read it once between them and exchange the rest
    assert cost.load_read_bytes == P * 14
    assert cost.exchange_bytes == pytest.approx((12 * P / 2 + 2 * P / 2) * 3 / 4)
    assert cost.save_s == pytest.approx(P * 14 / 1e3) and cost.load_s == pytest.approx(P * 14 / 1e3)
    assert (
        "resume on any layout: the ranks read" in cost.lines()[1] and "from its data-parallel peers" in cost.lines()[1]
    )


def test_the_earlier_format_reads_once_and_gathers_nothing():
    cost = checkpoint_cost(DIMS, Layout(tp=2, dp=4), weight_bytes=2, checkpoint_format="dp_reshardable")
    assert cost.load_read_bytes == P * 14
    assert cost.save_host_bytes == pytest.approx(2.5 * 12 * P / 2 / 4)
    assert "resumes only under the same TP, PP and EP" in cost.lines()[0]


def test_a_save_that_would_exhaust_a_node_is_named_before_the_run():
    """8 ranks per node each gathering 2.5 x 12 x P / 2 = 20,280 bytes (P = 1352): 162,240 bytes per node."""
    from dapo_megatron.memplan.checkpoint_cost import host_memory_problems

    cost = checkpoint_cost(DIMS, Layout(tp=2, dp=4), weight_bytes=2)
    assert cost.save_host_bytes * 8 == pytest.approx(162_240)
    assert host_memory_problems(cost, ranks_per_node=8, host_memory_gb=162_241 / 2**30) == []
    (problem,) = host_memory_problems(cost, ranks_per_node=8, host_memory_gb=162_239 / 2**30)
    assert problem.startswith("checkpoint save: 8 actor ranks per node x ")
    assert "> slurm.host_memory_gb=" in problem and "actor.checkpoint_format=dp_reshardable" in problem


def test_the_235b_preset_on_512_gib_nodes_is_refused_by_plan(capsys):
    """qwen3-235b-a22b: each of a node's 8 ranks gathers its position's 54.6 GB of optimizer state x 2.5 at a
    save: 1,091.5 GB per node, more than 512 GiB. Refused before anything starts; fits the default 2 TiB."""
    from dapo_megatron.memplan.report import main

    preset = "configs/runs/qwen3-235b-a22b_dapo.yaml"
    assert main([preset, "slurm.host_memory_gb=512"]) == 1
    out = capsys.readouterr().out
    assert "checkpoint save: 8 actor ranks per node x 136.4 GB of host memory each" in out
    assert "= 1,091.5 GB > slurm.host_memory_gb=512 (549.8 GB)" in out
    assert main([preset]) == 0
