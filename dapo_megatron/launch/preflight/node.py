"""One node's part of the preflight (launch/preflight/command.py starts one per node with srun, under the role's
own interpreter and container): the checks that need nothing from the other nodes, then the ones that
do (launch/preflight/mesh.py: shared filesystem, run lock, clocks, routes, collectives), then one
`PREFLIGHT-RESULT {json}` line on stdout.

    python -m dapo_megatron.launch.preflight.node --role trainer --rank 0 --hosts n0,n1,n2 --trainer-nodes 2 \
        --store-port 21234 --run-dir /shared/run --job 1234 [--check-port 21240] [--gpus 8 --gpu-memory-gb 80]

The imports are checked first and torch is imported only after, so a node whose python lacks torch
still reports what it lacks (its peers then report it absent from the collectives).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import warnings

from dapo_megatron.distributed import addresses
from dapo_megatron.launch.preflight import mesh as preflight_mesh
from dapo_megatron.launch.preflight.report import Check, result_line

# (module, required, distribution for the version): what each role's python must import
TRAINER_MODULES = (
    ("torch", True, "torch"),
    ("megatron.core", True, "megatron-core"),
    ("transformers", True, "transformers"),
    ("transformer_engine", False, "transformer-engine"),
    ("apex", False, "apex"),
)
ENGINE_MODULES = {
    "sglang": (
        ("torch", True, "torch"),
        ("transformers", True, "transformers"),
        ("sglang", True, "sglang"),
        ("sgl_kernel", True, "sgl-kernel"),
        ("flashinfer", False, "flashinfer-python"),
    ),
    "cpu": (("torch", True, "torch"), ("transformers", True, "transformers")),
}
GPU_MEMORY_TOLERANCE = 0.98  # "80 GB" H100s report 79.6 GiB: within 2% of slurm.gpu_memory_gb is the GPU meant


def _version(module, dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def check_imports(host: str, role: str, modules, where: str, python: str = "") -> tuple[Check, dict]:
    """Import every module of the role; versions of those present; a failed check names the missing ones.
    python: the interpreter as the config names it (a wrapper script shows as itself, not its target)."""
    python = python or sys.executable
    found: dict[str, str | None] = {}
    missing = []
    for name, required, dist in modules:
        try:
            with warnings.catch_warnings():  # megatron warns about TE/apex at import: the report says it
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - an ImportError, or whatever a broken install raises
            found[name] = None
            if required:
                missing.append(f"{name} ({type(err).__name__}: {err})")
            continue
        found[name] = _version(module, dist)
        if name == "torch":
            found["torch.cuda"] = module.version.cuda or "cpu build"
    shown = ", ".join(f"{k} {v}" if v else f"{k}: no" for k, v in found.items())
    if missing:
        fix = (
            f"install {', '.join(m.split(' ')[0] for m in missing)} into the {role} environment ({python}, "
            f"chosen by {where})"
        )
        return Check("imports", host, False, f"{role} python {python}: missing {'; '.join(missing)}", fix), found
    return Check("imports", host, True, f"{role} python {python}: {shown}"), found


def _gpus_from_torch() -> list[tuple[str, float]] | None:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 2**30)
        for i in range(torch.cuda.device_count())
    ]


def _gpus_from_nvidia_smi() -> list[tuple[str, float]]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    gpus = []
    for line in out.stdout.splitlines():
        name, _, mib = line.rpartition(",")
        if name and mib.strip().isdigit():
            gpus.append((name.strip(), int(mib) / 1024))
    return gpus


def check_gpus(host: str, *, expected: int, memory_gb: float) -> tuple[Check, list[tuple[str, float]]]:
    """The GPUs this process may use (torch honours CUDA_VISIBLE_DEVICES, which Slurm sets), else
    nvidia-smi's list; against slurm.gpus_per_node and the plan's slurm.gpu_memory_gb."""
    gpus = _gpus_from_torch()
    if not gpus:
        gpus = _gpus_from_nvidia_smi()
    if not gpus:
        if expected == 0:
            return Check("gpus", host, True, "no GPU (slurm.gpus_per_node=0 asks for none)"), []
        return Check(
            "gpus",
            host,
            False,
            f"no GPU visible; slurm.gpus_per_node={expected}",
            "a GPU partition (slurm.partition) and a working driver on this node (nvidia-smi); or "
            "slurm.gpus_per_node=0 for a CPU run",
        ), []
    names = sorted({name for name, _ in gpus})
    smallest = min(mem for _, mem in gpus)
    detail = f"{len(gpus)} x {'/'.join(names)}, {smallest:.1f} GiB each (plan: slurm.gpu_memory_gb={memory_gb:g})"
    if len(gpus) < expected:
        return Check(
            "gpus",
            host,
            False,
            detail + f"; slurm.gpus_per_node={expected}",
            "set slurm.gpus_per_node to what the nodes have, or a partition/constraint whose nodes have that many",
        ), gpus
    if smallest < memory_gb * GPU_MEMORY_TOLERANCE:
        return Check(
            "gpus",
            host,
            False,
            detail,
            f"slurm.gpu_memory_gb={smallest:.0f} (then `dapo-megatron plan CONFIG` again), or slurm.constraint "
            "for nodes with the GPUs the plan assumed",
        ), gpus
    return Check("gpus", host, True, detail), gpus


def port_taken(port: int) -> str:
    """ "" if a listener could bind 0.0.0.0:port here (SO_REUSEADDR, as torch's TCPStore), else the error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
            sock.listen(1)
        except OSError as err:
            return err.strerror or str(err)
    return ""


def check_ports(host: str, ports: list[tuple[int, str]]) -> list[Check]:
    checks = []
    for port, what in ports:
        err = port_taken(port)
        if err:
            checks.append(
                Check(
                    "ports",
                    host,
                    False,
                    f"port {port} ({what}) is taken: {err}",
                    f"stop what listens there (`ss -ltnp 'sport = :{port}'` on {host} names it), or resubmit: the "
                    "port derives from the job id",
                )
            )
        else:
            checks.append(Check("ports", host, True, f"port {port} ({what}) is free"))
    return checks


def check_routes(host: str, hosts: list[str]) -> tuple[list[Check], dict[str, dict]]:
    """The address and interface this node picks toward every other node (distributed/addresses.py)."""
    checks, routes = [], {}
    for peer in hosts:
        if peer == host:
            continue
        try:
            route = addresses.interface_toward(peer)
        except ValueError as err:
            checks.append(
                Check("routes", host, False, f"-> {peer}: {err}", "fix /etc/hosts or set GLOO/NCCL_SOCKET_IFNAME")
            )
            continue
        routes[peer] = {"peer": route.peer, "address": route.address, "interface": route.interface}
    if routes and len(checks) == 0:
        picked = sorted({f"{r['address']} ({r['interface']})" for r in routes.values()})
        checks.append(Check("routes", host, True, f"picks {', '.join(picked)} toward {', '.join(sorted(routes))}"))
    return checks, routes


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dapo_megatron.launch.preflight.node")
    ap.add_argument("--role", choices=("trainer", "engine"), required=True)
    ap.add_argument("--rank-offset", type=int, default=0, help="added to SLURM_PROCID (the engine step's nodes)")
    ap.add_argument("--hosts", required=True, help="every node of the preflight, comma-separated, trainer nodes first")
    ap.add_argument("--trainer-nodes", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--python", default="", help="the interpreter as the config names it (shown in the report)")
    ap.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", "0"))
    ap.add_argument("--engine-kind", default="cpu", choices=sorted(ENGINE_MODULES))
    ap.add_argument("--engine-imports", action="store_true", help="a trainer node that also runs colocated engines")
    ap.add_argument("--gpus", type=int, default=0, help="slurm.gpus_per_node")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--check-port", action="append", default=[], metavar="PORT:WHAT")
    ap.add_argument("--bytes", type=int, default=64 << 20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    hosts = args.hosts.split(",")
    rank = int(os.environ.get("SLURM_PROCID", "0")) + args.rank_offset
    host = hosts[rank] if rank < len(hosts) else socket.gethostname()
    where = (
        "slurm.engine_python / engine_setup / engine_container_image"
        if args.role == "engine"
        else ("slurm.python / setup / container_image")
    )
    modules = ENGINE_MODULES[args.engine_kind] if args.role == "engine" else TRAINER_MODULES
    if args.engine_imports:
        modules = tuple(dict.fromkeys(TRAINER_MODULES + ENGINE_MODULES[args.engine_kind]))
    imports, versions = check_imports(host, args.role, modules, where, args.python)
    gpus, gpu_list = check_gpus(host, expected=args.gpus, memory_gb=args.gpu_memory_gb)
    ports = [(int(p), what) for p, _, what in (item.partition(":") for item in args.check_port)]
    route_checks, routes = check_routes(host, hosts)
    checks = [imports, gpus, *check_ports(host, ports), *route_checks]
    facts = {"versions": versions, "gpus": [list(g) for g in gpu_list], "routes": routes}
    links: list[dict] = []
    if versions.get("torch"):
        mesh = preflight_mesh.Mesh(args, rank=rank, host=host, hosts=hosts, routes=routes)
        mesh_checks, links, mesh_facts = mesh.run()
        checks += mesh_checks
        facts.update(mesh_facts)
    payload = {
        "rank": rank,
        "host": host,
        "role": args.role,
        "python": args.python or sys.executable,
        "facts": facts,
        "checks": [c.as_dict() for c in checks],
        "links": links,
    }
    print(result_line(payload), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
