"""run_all.sh's first step: can the later steps start at all? Seconds, before any of them spends minutes.

    python tests/gpu/preflight.py [--carry .gpu] [--metrics FILE]

Imports every module the GPU steps import (each failure named, not only the first), prints the versions, the
GPU (name, capability, memory) and that a CUDA tensor and an NCCL process group work, and checks that the
warm-started tiny models prepared on the CPU machine travelled (.gpu/tiny, .gpu/tiny_moe: tests/gpu/prepare.sh).
Exit 1 if anything is missing. --metrics writes the versions and the device as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path

# what the steps import, grouped by who needs them
MODULES = {
    "image": [
        "torch",
        "triton",
        "transformers",
        "safetensors",
        "tokenizers",
        "yaml",
        "numpy",
        "pyarrow",
        "aiohttp",
        "psutil",
        "pytest",
    ],
    "carried wheels": ["megatron.core", "liger_kernel.transformers"],
    "this repo": [
        "dapo_kernels",
        "dapo_kernels.bench.run",
        "dapo_kernels.bench.targets",
        "dapo_megatron.actor.actor",
        "dapo_megatron.benchmarks.actor",
        "dapo_megatron.cli",
        "dapo_megatron.cpu_engine.server",
        "dapo_megatron.trainer.train",
    ],
}
VERSIONS = ["torch", "triton", "transformers", "megatron.core", "liger_kernel", "numpy", "safetensors"]
TINY_DIRS = ["tiny", "tiny_moe"]


def _version(name: str) -> str:
    from importlib import metadata

    dist = {"megatron.core": "megatron-core", "liger_kernel": "liger-kernel"}.get(name, name)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return getattr(sys.modules.get(name), "__version__", "?")


def check_imports() -> list[str]:
    failures = []
    for group, names in MODULES.items():
        for name in names:
            start = time.perf_counter()
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - every failure is reported, then the step fails
                failures.append(f"{name} ({group}): {type(err).__name__}: {err}")
                print(f"  FAIL {name:48s} {type(err).__name__}: {err}")
            else:
                print(f"  ok   {name:48s} {time.perf_counter() - start:.1f} s")
    return failures


def _varlen_signature() -> str:
    """The keyword parameters of this torch's varlen_attn (actor/attention_varlen.py decides by them), or why none."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        return f"absent ({err})"
    params = inspect.signature(varlen_attn).parameters.values()
    return ",".join(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_gpu() -> tuple[dict, list[str]]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return {}, ["torch.cuda.is_available() is False"]
    props = torch.cuda.get_device_properties(0)
    info = {
        "gpu": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "gpu_mem_gib": round(props.total_memory / 2**30, 1),
        "num_gpus": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "varlen_attn": _varlen_signature(),
    }
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    problems = [] if float(x.sum()) == (1 << 20) * ((1 << 20) - 1) / 2 else ["a CUDA sum came out wrong"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y)
    problems += [] if float(y.sum()) == 4.0 else ["an NCCL all_reduce came out wrong"]
    dist.destroy_process_group()
    return info, problems


def check_carry(carry: Path) -> list[str]:
    missing = [
        f"{carry / d}/tiny_model/warm: not carried (run tests/gpu/prepare.sh on the CPU machine and pass "
        f"carry=['.gpu'])"
        for d in TINY_DIRS
        if not (carry / d / "tiny_model" / "warm" / "build.json").is_file()
    ]
    for line in missing:
        print(f"  FAIL {line}")
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carry", default=str(Path(__file__).resolve().parents[2] / ".gpu"))
    ap.add_argument("--metrics", default=None)
    args = ap.parse_args(argv)
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    problems = check_imports()
    versions = {name: _version(name) for name in VERSIONS}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    info, gpu_problems = {}, []
    if not any(line.startswith("torch ") for line in problems):
        try:
            info, gpu_problems = check_gpu()
        except Exception as err:  # noqa: BLE001 - a CUDA or NCCL failure is the finding: name it, go on
            gpu_problems = [f"GPU / NCCL check: {type(err).__name__}: {err}"]
    print(f"device: {json.dumps(info)}")
    problems += gpu_problems + check_carry(Path(args.carry))
    if args.metrics:
        Path(args.metrics).write_text(json.dumps({**info, "versions": versions, "problems": problems}))
    for line in problems:
        print(f"preflight: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
