"""run_all.sh's first step: can the later steps start at all? Seconds, before any of them spends minutes.

    python tests/gpu/preflight.py [--carry .gpu] [--metrics FILE]

Imports every module the GPU steps import (each failure named, not only the first), prints the versions, the
GPU (name, capability, memory) and that a CUDA tensor and an NCCL process group work, and checks that the
warm-started tiny models prepared on the CPU machine travelled (.gpu/tiny, .gpu/tiny_moe: tests/gpu/prepare.sh).
Then the two ceilings of THIS device, measured (issue 49: targets are fractions of what the call measures,
never a datasheet or another GPU's constant): a 2 GiB device-to-device copy (copy_gb_per_s, bytes read +
written) and an 8192^3 bf16 matrix product on random data (matmul_bf16_tflops), each the median of 10
CUDA-event-timed runs after 3 warm-ups (about a second in all). Exit 1 if anything is missing. --metrics
writes the versions, the device and the ceilings as one JSON object.
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


def ceilings_from(*, copy_bytes: int, copy_s: float, matmul_n: int, matmul_s: float) -> dict[str, float]:
    """The two ceilings from measured seconds: a copy of copy_bytes reads and writes them (2x bytes); an
    n x n x n matrix product is 2 n^3 FLOPs."""
    return {
        "copy_gb_per_s": round(2 * copy_bytes / copy_s / 1e9, 1),
        "matmul_bf16_tflops": round(2 * matmul_n**3 / matmul_s / 1e12, 1),
    }


def measure_ceilings(*, copy_bytes: int = 2 << 30, matmul_n: int = 8192, device: str = "cuda") -> dict[str, float]:
    """The device copy and the bf16 matmul rate of this device (module docstring)."""
    import statistics

    import torch

    def median_s(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    gen = torch.Generator(device=device).manual_seed(0)

    def copy_s() -> float:  # its buffers freed on return, before the matmul's
        # random, never zeros: a matmul on zeros ran 13% faster than on random data on an H200
        src = torch.rand(copy_bytes // 4, device=device, generator=gen)
        dst = torch.empty_like(src)
        return median_s(lambda: dst.copy_(src))

    def matmul_s() -> float:
        a = torch.randn(matmul_n, matmul_n, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(matmul_n, matmul_n, device=device, generator=gen).to(torch.bfloat16)
        return median_s(lambda: a @ b)

    return ceilings_from(copy_bytes=copy_bytes, copy_s=copy_s(), matmul_n=matmul_n, matmul_s=matmul_s())


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
    if info:
        try:
            info.update(measure_ceilings())
        except Exception as err:  # noqa: BLE001 - the steps can run without it; the targets then say so
            gpu_problems.append(f"ceilings (copy, matmul): {type(err).__name__}: {err}")
    print(f"device: {json.dumps(info)}")
    problems += gpu_problems + check_carry(Path(args.carry))
    if args.metrics:
        Path(args.metrics).write_text(json.dumps({**info, "versions": versions, "problems": problems}))
    for line in problems:
        print(f"preflight: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
