"""The preflight's link measurements (launch/preflight/mesh.py runs them after the other checks):

  trainer       the trainer nodes' group, over the trainer's backend (nccl on GPUs, gloo on CPU), each
                rank on the interface distributed/addresses.py picks (as the run's ranks do): one
                all-reduce and one broadcast of --bytes over all trainer nodes, then one broadcast per
                pair (first node, node i): the per-link rate
  weight_group  the first trainer node and each engine node, through transfer/weight_group.py (the
                address trainer_address picks toward the engine's host, open_weight_group): one
                broadcast of --bytes, as the weight sync sends its buckets
  intra_node    on a node with two GPUs or more: a copy GPU 0 -> GPU 1 (the NVLink/PCIe rate)

Each measurement: one warm-up, then --reps timed operations, each between two barriers (a tiny
all-reduce: the closing one adds a round trip, small against the bytes) with the device synchronised;
the median goes into the record. Records come from rank 0 (its clock).
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from functools import partial

from dapo_megatron.distributed import addresses
from dapo_megatron.launch.preflight.report import Check, link_record

LINK_FIX = "the collective failed: read the routes and ports checks above; NCCL_DEBUG=INFO in slurm.setup shows why"


def _timed(op: Callable[[], object], sync: Callable[[], object], barrier: Callable[[], object], reps: int) -> float:
    op()  # warm-up: connections, buffers
    sync()
    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        op()
        sync()
        # a sender's op ends once its bytes are in the socket buffers and queues (MBs), not delivered:
        # the clock stops after a barrier, which no rank passes before every receiver has its bytes
        barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device_sync(device) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure(mesh) -> tuple[list[Check], list[dict], dict]:
    import torch

    args = mesh.args
    gpu = args.gpus > 0 and torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    checks: list[Check] = []
    links: list[dict] = []
    facts: dict = {"intra_node_gbit_per_s": None}
    trainer_ranks = list(range(args.trainer_nodes))
    if mesh.rank in trainer_ranks and args.trainer_nodes > 1:
        absent = [r for r in trainer_ranks if r not in mesh.roster]
        if absent:
            if mesh.rank == 0:
                names = ", ".join(mesh.hosts[r] for r in absent)
                checks.append(Check("link", "all", False, f"trainer group: {names} absent", LINK_FIX))
        else:
            try:
                links += _trainer_group(mesh, "nccl" if gpu else "gloo", device)
            except Exception as err:  # noqa: BLE001 - gloo/nccl errors name the peer
                checks.append(Check("link", mesh.host, False, f"trainer group: {type(err).__name__}: {err}", LINK_FIX))
    backend = "nccl" if gpu and args.engine_kind == "sglang" else "gloo"
    for engine in range(args.trainer_nodes, len(mesh.hosts)):
        if mesh.rank == 0 and engine not in mesh.roster:
            detail = "weight group not measured: this engine node's worker never joined (its imports check says why)"
            checks.append(Check("link", mesh.hosts[engine], False, detail, LINK_FIX))
    for engine in (r for r in mesh.roster if r >= args.trainer_nodes):
        if mesh.rank not in (0, engine):
            continue
        try:
            record = _weight_group(mesh, engine, backend, device)
        except Exception as err:  # noqa: BLE001
            checks.append(Check("link", mesh.host, False, f"weight group -> {mesh.hosts[engine]}: {err}", LINK_FIX))
            continue
        if record:
            links.append(record)
    if mesh.rank == 0 and gpu and torch.cuda.device_count() > 1:
        record = _intra_node(mesh, args.bytes, args.reps)
        links.append(record)
        facts["intra_node_gbit_per_s"] = record["gbit_per_s"]
    if mesh.rank == 0:
        for link in links:
            checks.append(
                Check(
                    "link",
                    "all",
                    True,
                    f"{link['path']} {link['kind']} {' <-> '.join(link['nodes'])}: {link['gbit_per_s']:.3f} Gbit/s",
                )
            )
    return checks, links, facts


def _trainer_group(mesh, backend: str, device) -> list[dict]:
    import torch
    import torch.distributed as dist

    from dapo_megatron.distributed import collectives as coll  # every collective through the device helper

    args = mesh.args
    world = args.trainer_nodes
    # the interface each rank picks, as the run's ranks do (trainer/train.py before init_process_group)
    addresses.choose_socket_interfaces(
        mesh.hosts[0], spans_hosts=True, store=dist.PrefixStore("ifname", mesh.store), timeout_s=args.timeout_s
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("trainer", mesh.store),
        rank=mesh.rank,
        world_size=world,
        timeout=_delta(args.timeout_s),
    )
    tensor = torch.ones(args.bytes // 4, dtype=torch.float32, device=device)
    sync = _device_sync(device)
    tiny = torch.zeros(1, device=device)

    def barrier(group=None) -> Callable[[], object]:
        return lambda: (coll.all_reduce(tiny, group=group), sync())

    hosts = mesh.hosts[:world]
    records = []
    seconds = _timed(lambda: coll.all_reduce(tensor), sync, barrier(), args.reps)
    records.append(
        link_record(
            kind="all_reduce",
            path="trainer",
            backend=backend,
            nodes=hosts,
            nbytes=args.bytes,
            seconds=seconds,
            bus_factor=2 * (world - 1) / world,
        )
    )
    seconds = _timed(lambda: coll.broadcast(tensor, src=0), sync, barrier(), args.reps)
    records.append(
        link_record(kind="broadcast", path="trainer", backend=backend, nodes=hosts, nbytes=args.bytes, seconds=seconds)
    )
    for peer in range(1, world if world > 2 else 1):  # two nodes: the group's broadcast is the pair's
        pair = dist.new_group([0, peer])  # every rank creates every group, in the same order
        if mesh.rank in (0, peer):
            seconds = _timed(partial(coll.broadcast, tensor, src=0, group=pair), sync, barrier(pair), args.reps)
            records.append(
                link_record(
                    kind="broadcast",
                    path="trainer",
                    backend=backend,
                    nodes=[hosts[0], hosts[peer]],
                    nbytes=args.bytes,
                    seconds=seconds,
                )
            )
    dist.destroy_process_group()
    return records if mesh.rank == 0 else []


def _weight_group(mesh, engine: int, backend: str, device) -> dict | None:
    import torch

    from dapo_megatron.distributed import collectives as coll
    from dapo_megatron.transfer import weight_group  # torch at import: after the node's import check

    args = mesh.args
    key = f"wg/{engine}"
    if mesh.rank == 0:
        address = weight_group.trainer_address(engine_urls=[f"http://{mesh.hosts[engine]}:1"], backend=backend)
        with socket.socket() as sock:
            sock.bind((address, 0))
            port = sock.getsockname()[1]
        mesh.store.set(key, f"{address}:{port}")
    else:
        target = mesh.get(key, args.timeout_s)
        if target is None:
            raise TimeoutError(f"the first trainer node published no weight-group address within {args.timeout_s} s")
        address, port_text = target.rsplit(":", 1)
        port = int(port_text)
    pg = weight_group.open_weight_group(
        backend=backend,
        master_address=address,
        master_port=port,
        rank=0 if mesh.rank == 0 else 1,
        world_size=2,
        group_name=f"preflight_wg_{engine}",
        timeout_s=args.timeout_s,
    )
    tensor = torch.ones(args.bytes // 4, dtype=torch.float32, device=device)
    tiny = torch.zeros(1, device=device)
    sync = _device_sync(device)
    seconds = _timed(
        lambda: weight_group.broadcast_from_trainer(pg, tensor),
        sync,
        # the closing barrier: a tiny broadcast FROM the engine side, which it sends only after it received
        # the whole buffer (a sender's broadcast can return while its bytes are still buffered)
        lambda: (coll.pg_broadcast(pg, tiny, src=1), sync()),
        args.reps,
    )
    if mesh.rank != 0:
        return None
    return link_record(
        kind="broadcast",
        path="weight_group",
        backend=backend,
        nodes=[mesh.hosts[0], mesh.hosts[engine]],
        nbytes=args.bytes,
        seconds=seconds,
    )


def _intra_node(mesh, nbytes: int, reps: int) -> dict:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")

    def sync() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    seconds = _timed(lambda: dst.copy_(src, non_blocking=True), sync, sync, reps)
    return link_record(
        kind="copy", path="intra_node", backend="cuda", nodes=[mesh.host, mesh.host], nbytes=nbytes, seconds=seconds
    )


def _delta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
