"""How long one weight sync takes: the plan's prediction from link bandwidths, per placement.

    t = sync_time(dims, layout, placement="disaggregated", engines=Engines(16, 2), links=Links(400, 2880), ...)
    t.total_s, t.lines()          # seconds, and the terms it adds up

What moves (transfer/weight_sync.py, transfer/colocated_sync.py, docs/architecture.md "weight sync"):
  export   every rank iterates the actor's weights as full HF tensors: each tensor is all-gathered over its
           tensor-parallel group (and an expert tensor over the expert-parallel group), so a rank receives
           (tp-1)/tp of its stage's dense bytes on NVLink and (ep-1)/ep of its stage's expert bytes (on the
           network when ep x etp ranks span more than a node);
  stages   with pp > 1 the other stages' tensors reach the sender (disaggregated: global rank 0) or every
           engine GPU (colocated) by broadcast over the network when the stages sit on different nodes;
  send     disaggregated: ONE sender (global rank 0) broadcasts each flattened bucket to every engine TP
           rank over one weight group. NCCL pipelines a broadcast along a chain, so its time is about
           bytes / (the sender's link) whatever the number of receivers (one NIC per sender assumed);
           gloo's broadcast (the CPU path) sends the whole buffer once per step of a binomial tree, so the
           root's link carries it ceil(log2(world)) times, and over TCP a configured line rate carries
           payload at 1448/1514 of it (TCP_PAYLOAD_FRACTION; NCCL over InfiniBand's 4 KB MTU loses
           under 1%, not modelled). colocated: each engine TP rank copies its shard
           (bytes / engine_tp) out of the CUDA-IPC handles into its own weights on the same GPU: a device
           copy (read + write) at the GPU's copy bandwidth (DEVICE_COPY_BYTES_PER_S: the GPU a config's
           slurm.gpu_memory_gb stands for, or a rate measured on the device, copy_bytes_per_s=);
  buckets  a fixed cost per bucket: the HTTP request, the engine's load_weights call, the flatten or the
           IPC-handle serialization (an allowance, SYNC_BUCKET_OVERHEAD_S, not measured on a GPU here).
How the terms add up follows the code path. The disaggregated sync of a layout without expert
parallelism runs through the stage exporters (transfer/stage_export.py, covers_layout): bucket k+1's
shards travel to the exporter, and a later stage's buckets to the driver, while bucket k is broadcast,
so total = max(export + stages, send) + one bucket's fill (its gather and stage transfer) + buckets.
Colocated syncs and expert-parallel layouts walk iter_hf_weights on every rank, whose all-gathers run
between the sends: total = export + stages + send + buckets.

Bandwidths: Links from config (slurm.network_gbps: one sender's NIC, default 400 Gbit/s = one NDR
InfiniBand NIC per GPU as on DGX H100; slurm.intra_node_gbps: the NVLink all-gather bus bandwidth per GPU,
default 2880 Gbit/s = 360 GB/s, what nccl-tests' all_gather_perf reaches on 8 x H100 SXM) or from a
preflight.json (`dapo-megatron plan CONFIG --links RUN_DIR/preflight.json`: the slowest measured broadcast).

Anchors (published, not ours): verl, Qwen2.5-32B disaggregated over NCCL on H100 nodes, 14.2 s per sync;
MoonshotAI's checkpoint-engine, Qwen3-235B-A22B, 6.2 s; SkyRL, a 14B model colocated on 8 H100s, 1.6 s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.memplan.arch import ModelDims
from dapo_megatron.memplan.static import Layout, expert_params, fp8_bytes, linear_params, total_params

DEFAULT_NETWORK_GBPS = 400.0
DEFAULT_INTRA_NODE_GBPS = 2880.0
# One GPU's device-to-device copy, bytes read + written per second: what a colocated engine's copy out of the
# CUDA-IPC handles runs at. Defaults where nothing was measured on the device (`plan` on a cluster); each is
# a measurement of that GPU, named with its source. A rate measured on the device in the same run (the GPU
# check's preflight) replaces them: sync_time(copy_bytes_per_s=..., copy_source=...).
DEVICE_COPY_BYTES_PER_S = {
    "H100": 2.97e12,  # H100 80GB HBM3 (SXM), a 2 GiB torch copy_, docs/benchmarks.md (first H100 run)
    "H200": 4.3e12,  # NVIDIA H200 (SXM, 141 GB), 8.6 GB moved in 2.0 ms by torch, measured on a lent H200 (2026-11-04)
}
DEFAULT_COPY_DEVICE = "H100"  # the presets' cluster (the network defaults above are DGX H100's too)
H200_MIN_MEMORY_GB = 130.0  # slurm.gpu_memory_gb at or above this is an H200 (141 GB; an H100 has 80 or 94)
SYNC_BUCKET_OVERHEAD_S = 0.005
# gloo sends over TCP: of each 1514-byte Ethernet frame (MTU 1500) 1448 bytes are payload (20 IPv4 + 32
# TCP with timestamps + 14 Ethernet). A configured network_gbps is a line rate; measured on the shaped
# twin (docs/benchmarks.md "Weight sync at link speed"): the sender's eth0 carried 1.045 x the payload.
TCP_PAYLOAD_FRACTION = 1448 / 1514


@dataclass(frozen=True)
class Links:
    network_gbps: float  # one sender's link to the engines (Gbit/s)
    intra_node_gbps: float  # NVLink all-gather bus bandwidth per GPU (Gbit/s)
    source: str = "config: slurm.network_gbps, slurm.intra_node_gbps"
    measured: bool = False  # a preflight's rates are payload bytes per second already (no header share)

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbps * 1e9 / 8

    @property
    def intra_node_bytes_per_s(self) -> float:
        return self.intra_node_gbps * 1e9 / 8


def links_from_preflight(path: str | Path, *, intra_node_gbps: float) -> Links:
    """The links a preflight measured (launch/preflight/command.py writes <run_dir>/preflight.json, schema version 1):
    the slowest weight_group broadcast (a trainer rank to an engine node: the sync's own path), else the
    slowest trainer-pair broadcast; the intra-node rate where the preflight measured one (a GPU-to-GPU
    copy on the first node), else `intra_node_gbps` (the config's)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read it as a preflight.json ({err})") from None
    links = data.get("links") if isinstance(data, dict) else None
    if not isinstance(links, list):
        raise ValueError(f"{path}: no 'links' list (is it a preflight.json from `dapo-megatron preflight`?)")
    rates: dict[str, list[float]] = {"weight_group": [], "trainer": []}
    for link in links:
        if isinstance(link, dict) and link.get("kind") == "broadcast" and link.get("path") in rates:
            rate = link.get("gbit_per_s")
            if not isinstance(rate, (int, float)) or rate <= 0:
                raise ValueError(f"{path}: a {link['path']} broadcast between {link.get('nodes')} has no rate")
            rates[link["path"]].append(float(rate))
    measured = rates["weight_group"] or rates["trainer"]
    if not measured:
        raise ValueError(f"{path}: no broadcast was measured (a one-node preflight measures no link)")
    which = "weight_group" if rates["weight_group"] else "trainer"
    intra = data.get("intra_node_gbit_per_s")
    intra_source = "measured" if isinstance(intra, (int, float)) and intra > 0 else "config"
    return Links(
        min(measured),
        float(intra) if intra_source == "measured" else intra_node_gbps,
        source=f"{path}: slowest {which} broadcast of {len(measured)}; intra-node from the {intra_source}",
        measured=True,
    )


@dataclass(frozen=True)
class Engines:
    count: int  # rollout.num_engines
    tp: int  # rollout.engine_tp


@dataclass(frozen=True)
class SyncTime:
    placement: str
    bytes_per_engine: int
    senders: int
    buckets: int
    export_s: float
    stages_s: float
    send_s: float
    buckets_s: float
    send_how: str
    fill_s: float = 0.0  # overlapped: the first bucket's export and stage transfer, before any send
    overlapped: bool = False  # the export and stage transfers run while the previous bucket is sent

    @property
    def total_s(self) -> float:
        if self.overlapped:
            return max(self.export_s + self.stages_s, self.send_s) + self.fill_s + self.buckets_s
        return self.export_s + self.stages_s + self.send_s + self.buckets_s

    def lines(self) -> list[str]:
        moved = f"export {_s(self.export_s)} + stages {_s(self.stages_s)}"
        send = f"send {_s(self.send_s)} ({self.send_how})"
        if self.overlapped:
            terms = f"max({moved}, {send}) + fill {_s(self.fill_s)} + buckets {_s(self.buckets_s)}"
        else:
            terms = f"{moved} + {send} + buckets {_s(self.buckets_s)}"
        return [
            f"weight sync ({self.placement}): {_bytes(self.bytes_per_engine)} per engine, {self.senders} sender, "
            f"{self.buckets} bucket{'s' if self.buckets > 1 else ''}: {terms} = {_s(self.total_s)} "
            f"({_bytes(self.bytes_per_engine / self.total_s)}/s)"
        ]


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def copy_device_for(gpu_memory_gb: float) -> str:
    """The GPU whose copy rate `plan` assumes for a config: slurm.gpu_memory_gb is the one GPU fact a config
    holds (141 -> "H200"; 80 or 94 -> "H100")."""
    return "H200" if gpu_memory_gb >= H200_MIN_MEMORY_GB else DEFAULT_COPY_DEVICE


def sync_bytes(dims: ModelDims, *, fp8: bool) -> int:
    """Bytes of one full copy of the weights as the engines receive them: the checkpoint dtype, or with
    rollout.quantization=fp8 one byte per weight of every transformer Linear (modelopt's block FP8; the
    fp32 128x128 block scales add 4 bytes per 16384 weights) and the rest (embeddings, LM head, norms,
    routers) in the checkpoint dtype."""
    params = total_params(dims)
    if not fp8:
        return params * dims.dtype_bytes
    linear = linear_params(dims)
    return fp8_bytes(linear) + (params - linear) * dims.dtype_bytes


def _copy_rate(copy_bytes_per_s: float | None, copy_source: str) -> float:
    """The colocated copy rate: the one given, else the named device's default; a ValueError for an
    unknown device or a rate <= 0."""
    if copy_bytes_per_s is None:
        if copy_source not in DEVICE_COPY_BYTES_PER_S:
            raise ValueError(
                f"copy_source {copy_source!r}: no default copy rate; known {sorted(DEVICE_COPY_BYTES_PER_S)}"
            )
        copy_bytes_per_s = DEVICE_COPY_BYTES_PER_S[copy_source]
    if copy_bytes_per_s <= 0:
        raise ValueError(f"copy_bytes_per_s must be > 0, got {copy_bytes_per_s}")
    return copy_bytes_per_s


def sync_time(
    dims: ModelDims,
    layout: Layout,
    *,
    placement: str,
    engines: Engines,
    links: Links,
    gpus_per_node: int,
    bucket_bytes: int,
    fp8: bool = False,
    backend: str = "nccl",
    copy_bytes_per_s: float | None = None,
    copy_source: str = DEFAULT_COPY_DEVICE,
) -> SyncTime:
    """The predicted seconds of one sync of the whole model into every engine (module docstring).
    copy_bytes_per_s: the device copy rate of a colocated sync; None = DEVICE_COPY_BYTES_PER_S[copy_source]."""
    copy_bytes_per_s = _copy_rate(copy_bytes_per_s, copy_source)
    total = sync_bytes(dims, fp8=fp8)
    experts = expert_params(dims) * (1 if fp8 else dims.dtype_bytes)
    dense = total - experts
    per_stage_dense, per_stage_experts = dense / layout.pp, experts / layout.pp
    intra, network = links.intra_node_bytes_per_s, links.network_bytes_per_s
    # an expert group wider than a node all-gathers over the network (megatron's order: etp-ep-edp-pp)
    expert_link = network if layout.ep * layout.expert_tp > gpus_per_node else intra
    export = per_stage_dense * (layout.tp - 1) / layout.tp / intra
    export += per_stage_experts * (layout.ep - 1) / layout.ep / expert_link
    ranks_per_stage = layout.tp * layout.cp * layout.dp
    stage_link = network if ranks_per_stage >= gpus_per_node else intra  # megatron's order puts pp outermost
    stages = total * (layout.pp - 1) / layout.pp / stage_link
    buckets = max(1, math.ceil(total / bucket_bytes))
    bucket = min(bucket_bytes, total)
    stage_exporters = placement == "disaggregated" and layout.ep == 1 and layout.expert_tp == layout.tp
    fill = bucket * (layout.tp - 1) / layout.tp / intra + (bucket / stage_link if layout.pp > 1 else 0.0)
    if placement == "colocated":
        shard = total / engines.tp
        send = 2 * shard / copy_bytes_per_s
        how = f"IPC copy of {_bytes(shard)} per engine TP rank at {copy_bytes_per_s / 1e12:.2f} TB/s ({copy_source})"
    else:
        receivers = engines.count * engines.tp
        hops = 1 if backend == "nccl" else math.ceil(math.log2(receivers + 1))
        # a configured line rate over TCP (gloo): the TCP/IP and Ethernet headers take their share
        payload_rate = network * (TCP_PAYLOAD_FRACTION if backend == "gloo" and not links.measured else 1.0)
        send = hops * total / payload_rate
        how = f"{backend} broadcast to {receivers} engine ranks" + (f", {hops} tree steps" if hops > 1 else "")
    return SyncTime(
        placement=placement,
        bytes_per_engine=total,
        senders=1,
        buckets=buckets,
        export_s=export,
        stages_s=stages,
        send_s=send,
        buckets_s=buckets * SYNC_BUCKET_OVERHEAD_S,
        send_how=how,
        fill_s=fill if stage_exporters else 0.0,
        overlapped=stage_exporters,
    )
