"""The weight-sync time `dapo-megatron plan` predicts (memplan/sync_time.py): every term by hand on a
small dense model, the FP8 byte count, the gloo tree, the preflight links, and a line per placement for
every shipped preset."""

import json
import math
from pathlib import Path

import pytest

from dapo_megatron.memplan.arch import dims_from_hf_config
from dapo_megatron.memplan.static import Layout, total_params
from dapo_megatron.memplan.sync_time import (
    DEVICE_COPY_BYTES_PER_S,
    SYNC_BUCKET_OVERHEAD_S,
    Engines,
    Links,
    links_from_preflight,
    sync_bytes,
    sync_time,
)

REPO = Path(__file__).resolve().parents[2]
# hidden 1024, 8 heads of 128 (2 KV heads), FFN 4096, 10 layers, vocabulary 10000, untied, bf16
DIMS = dims_from_hf_config(
    {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 10000,
        "torch_dtype": "bfloat16",
    },
    name="hand",
    source="test",
)
# per layer: q 1024x1024 + k, v 2 x 256x1024 + o 1024x1024 = 2,621,440; MLP 3 x 4096 x 1024 = 12,582,912;
# two norms 2,048 -> 15,206,400; x 10 layers = 152,064,000; embedding + head 2 x 10000 x 1024 = 20,480,000;
# final norm 1,024 -> 172,545,024 parameters, 345,090,048 bytes in bf16
PARAMS, BYTES = 172_545_024, 345_090_048
LINKS = Links(network_gbps=8.0, intra_node_gbps=80.0)  # 1e9 and 1e10 bytes per second
LAYOUT = Layout(tp=2, pp=2, dp=2)  # 8 ranks, 4 per stage: with 4 GPUs per node the stages sit on two nodes


TWO_ENGINES = Engines(2, 2)


def _time(placement, *, engines=TWO_ENGINES, backend="nccl", fp8=False, gpus_per_node=4, **copy):
    return sync_time(
        DIMS,
        LAYOUT,
        placement=placement,
        engines=engines,
        links=LINKS,
        gpus_per_node=gpus_per_node,
        bucket_bytes=100 << 20,
        fp8=fp8,
        backend=backend,
        **copy,
    )


def test_the_hand_model_has_the_hand_counted_parameters():
    assert total_params(DIMS) == PARAMS
    assert sync_bytes(DIMS, fp8=False) == BYTES


def test_disaggregated_terms_by_hand():
    t = _time("disaggregated")
    assert t.bytes_per_engine == BYTES and t.senders == 1
    assert t.buckets == 4  # 345,090,048 / 104,857,600 = 3.29 -> 4
    assert t.export_s == pytest.approx(BYTES / 2 * (1 / 2) / 1e10, rel=1e-12)  # half a stage over NVLink
    assert t.stages_s == pytest.approx(BYTES / 2 / 1e9, rel=1e-12)  # the other stage, across nodes
    assert t.send_s == pytest.approx(BYTES / 1e9, rel=1e-12)  # NCCL pipelines: once over the sender's link
    assert t.buckets_s == pytest.approx(4 * SYNC_BUCKET_OVERHEAD_S)
    # the stage exporters overlap the export and the stage funnel with the broadcast (no expert parallelism):
    # max(0.0086 + 0.1725, 0.3451) + the first bucket's gather (104,857,600 / 2 / 1e10) and stage transfer
    # (104,857,600 / 1e9) + 4 buckets x 5 ms
    assert t.overlapped and t.fill_s == pytest.approx(0.00524288 + 0.1048576, rel=1e-12)
    assert t.total_s == pytest.approx(0.345090048 + 0.11010048 + 0.02, rel=1e-9)


def test_stages_on_one_node_use_nvlink():
    assert _time("disaggregated", gpus_per_node=8).stages_s == pytest.approx(BYTES / 2 / 1e10, rel=1e-12)


def test_colocated_sends_by_a_device_copy_of_each_engine_ranks_shard():
    t = _time("colocated")
    assert t.send_s == pytest.approx(2 * (BYTES / 2) / 2.97e12, rel=1e-12)  # the H100's copy, by default
    assert "per engine TP rank at 2.97 TB/s (H100)" in t.send_how
    assert t.export_s == _time("disaggregated").export_s and t.stages_s == _time("disaggregated").stages_s
    # every rank walks iter_hf_weights: its all-gathers run between the sends, so the terms add up
    assert not t.overlapped and t.total_s == pytest.approx(t.export_s + t.stages_s + t.send_s + 0.02, rel=1e-12)


def test_gloo_broadcast_costs_one_pass_per_tree_step():
    # 2 engines x tp 1 + the trainer = 3 ranks: a binomial tree of ceil(log2 3) = 2 steps from the root
    # over TCP a configured line rate of 1e9 bytes/s carries 1448 payload bytes per 1514-byte frame
    t = _time("disaggregated", engines=Engines(2, 1), backend="gloo")
    assert t.send_s == pytest.approx(2 * BYTES / (1e9 * 1448 / 1514), rel=1e-12)
    one = _time("disaggregated", engines=Engines(1, 1), backend="gloo")
    assert one.send_s == pytest.approx(BYTES / (1e9 * 1448 / 1514), rel=1e-12)


def test_measured_links_are_payload_rates_already():
    measured = Links(network_gbps=8.0, intra_node_gbps=80.0, measured=True)
    t = sync_time(DIMS, LAYOUT, placement="disaggregated", engines=Engines(2, 1), links=measured,
                  gpus_per_node=4, bucket_bytes=100 << 20, backend="gloo")  # fmt: skip
    assert t.send_s == pytest.approx(2 * BYTES / 1e9, rel=1e-12)


def test_fp8_sends_one_byte_per_linear_weight_plus_block_scales():
    linear = 10 * (2_621_440 + 12_582_912)  # 152,043,520 weights in Linears
    scales = linear * 4 // (128 * 128)  # 37,120 bytes of fp32 block scales
    assert sync_bytes(DIMS, fp8=True) == linear + scales + (PARAMS - linear) * 2 == 193_083_648


def _preflight(path, links, intra=None):
    path.write_text(json.dumps({"version": 1, "links": links, "intra_node_gbit_per_s": intra}))
    return path


def _broadcast(path, rate, nodes=("h1", "h2")):
    return {"kind": "broadcast", "path": path, "backend": "gloo", "nodes": list(nodes), "gbit_per_s": rate}


def test_links_from_a_preflight_file(tmp_path):
    """The slowest weight-group broadcast sets the network rate (the sync's own path), else the slowest
    trainer pair; an all-reduce is no broadcast; the intra-node rate is the measured copy or the config's."""
    path = tmp_path / "preflight.json"
    all_reduce = {"kind": "all_reduce", "path": "trainer", "nodes": ["h1", "h2"], "gbit_per_s": 0.1}
    _preflight(
        path,
        [
            all_reduce,
            _broadcast("trainer", 0.25),
            _broadcast("weight_group", 0.29),
            _broadcast("weight_group", 0.27, ("h1", "h3")),
        ],
    )
    links = links_from_preflight(path, intra_node_gbps=2880)
    assert (links.network_gbps, links.intra_node_gbps) == (0.27, 2880.0)
    assert (
        str(path) in links.source
        and "weight_group broadcast of 2" in links.source
        and "from the config" in links.source
    )
    _preflight(path, [_broadcast("trainer", 0.25), _broadcast("trainer", 0.31)], intra=1200.0)
    links = links_from_preflight(path, intra_node_gbps=2880)
    assert (links.network_gbps, links.intra_node_gbps) == (0.25, 1200.0) and "from the measured" in links.source
    assert links.measured  # payload rates: no header share applied


def test_a_preflight_without_links_is_named(tmp_path):
    path = tmp_path / "preflight.json"
    with pytest.raises(ValueError, match=r"preflight\.json: cannot read it"):
        links_from_preflight(path, intra_node_gbps=1)
    path.write_text(json.dumps({"checks": []}))
    with pytest.raises(ValueError, match=r"preflight\.json: no 'links' list"):
        links_from_preflight(path, intra_node_gbps=1)
    _preflight(path, [{"kind": "all_reduce", "path": "trainer", "gbit_per_s": 1.0}])
    with pytest.raises(ValueError, match=r"no broadcast was measured"):
        links_from_preflight(path, intra_node_gbps=1)
    _preflight(path, [_broadcast("weight_group", None)])
    with pytest.raises(ValueError, match=r"a weight_group broadcast between \['h1', 'h2'\] has no rate"):
        links_from_preflight(path, intra_node_gbps=1)


@pytest.mark.parametrize("preset", sorted((REPO / "configs" / "runs").glob("*.yaml")), ids=lambda p: p.name)
def test_plan_prints_the_sync_time_of_both_placements(preset, capsys):
    from dapo_megatron.memplan.report import main

    main([str(preset)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("weight sync (")]
    assert [line.split(")")[0] for line in lines] == ["weight sync (colocated", "weight sync (disaggregated"]
    assert sum("[configured]" in line for line in lines) == 1
    for line in lines:
        seconds = float(line.rsplit(" = ", 1)[1].split()[0])
        assert math.isfinite(seconds) and seconds > 0


def test_plan_reads_measured_links(tmp_path, capsys):
    from dapo_megatron.memplan.report import main

    path = tmp_path / "preflight.json"
    _preflight(path, [_broadcast("weight_group", 200.0)])
    main([str(REPO / "configs" / "runs" / "qwen2.5-7b_dapo.yaml"), "--links", str(path)])
    out = capsys.readouterr().out
    assert f"network 200 Gbit/s, intra-node 2880 Gbit/s ({path}: slowest weight_group broadcast of 1;" in out
    # 15.23 GB at 25 GB/s: 0.61 s of broadcast instead of the default 400 Gbit/s's 0.30 s
    assert "send 0.61 s (nccl broadcast to 32 engine ranks)" in out


@pytest.mark.parametrize("key", ["slurm.network_gbps", "slurm.intra_node_gbps"])
def test_a_link_rate_must_be_positive(key):
    from dapo_megatron.config import load_config

    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(str(REPO / "configs" / "runs" / "tiny_cpu.yaml"), [f"{key}=0"])


def test_colocated_copy_rate_is_the_devices_own_or_a_measured_one():
    """Issue 49: no H100-only constant. An H200 (slurm.gpu_memory_gb 141) copies at its own 4.3 TB/s; a rate
    measured on the device replaces either; an unknown device or a rate <= 0 is refused."""
    from dapo_megatron.memplan.sync_time import copy_device_for

    assert DEVICE_COPY_BYTES_PER_S == {"H100": 2.97e12, "H200": 4.3e12}
    assert [copy_device_for(gb) for gb in (80, 94, 141)] == ["H100", "H100", "H200"]
    h200 = _time("colocated", copy_source="H200")
    assert h200.send_s == pytest.approx(BYTES / 4.3e12, rel=1e-12) and "at 4.30 TB/s (H200)" in h200.send_how
    measured = _time("colocated", copy_bytes_per_s=4.0e12, copy_source="measured on NVIDIA H200")
    assert measured.send_s == pytest.approx(BYTES / 4.0e12, rel=1e-12)
    assert measured.send_how.endswith("at 4.00 TB/s (measured on NVIDIA H200)")
    with pytest.raises(ValueError, match="copy_source 'B200': no default copy rate"):
        _time("colocated", copy_source="B200")
    with pytest.raises(ValueError, match="copy_bytes_per_s must be > 0"):
        _time("colocated", copy_bytes_per_s=0.0)
