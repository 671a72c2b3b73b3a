"""`dapo-megatron serve-rollout`: the command line and the serving loop of the CPU engine (server.py).

    dapo-megatron serve-rollout --model DIR --host 127.0.0.1 --port 30000 [--register-dir RUN/engines]
        [--context-length N] [--no-enable-deterministic-inference] [--config KEYS.yaml] [--max-request-bytes N]

Keys as SGLang takes them: --api-key, --admin-api-key, or (what our launchers use, so no key is on a
command line) --config FILE.yaml holding `api-key` / `admin-api-key` (SGLang's --config format; any other
option of this command may be in it too, the command line wins).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import socket
import sys

import torch
from aiohttp import web

from dapo_megatron.cpu_engine import server as server_module
from dapo_megatron.cpu_engine.engine import CpuEngine
from dapo_megatron.cpu_engine.guard import DEFAULT_MAX_REQUEST_BYTES, Limits
from dapo_megatron.cpu_engine.server import RolloutServer
from dapo_megatron.rollout.auth import check_key
from dapo_megatron.rollout.registry import remove_registration, write_registration


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _serve(
    server: RolloutServer, *, host: str, port: int, model: str, register_dir: str, base_gpu_id: int | None = None
) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    url = f"http://{host}:{port}"
    await server.warm_up()  # /health answers 503 until this generation is done
    print(f"serve-rollout: serving {model} at {url}", flush=True)
    # SIGTERM (what the launcher, scancel and `kill` send) ends the wait below like Ctrl-C does, so the
    # `finally` runs: the registration goes away with the engine instead of pointing at a dead port
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registration = ""
    try:
        if register_dir:  # only once the socket accepts connections
            registration = write_registration(
                register_dir,
                {
                    "host": host,
                    "port": port,
                    "url": url,
                    "tp_size": 1,
                    "model": model,
                    "pid": os.getpid(),
                    "engine": "cpu",
                    "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    # where it sits (colocated placement: the trainer rank on this slot feeds it)
                    "node": socket.gethostname(),
                    "base_gpu_id": base_gpu_id,
                },
            )
        await stop.wait()
        print("serve-rollout: stopping", flush=True)
    finally:
        if registration:
            remove_registration(registration, pid=os.getpid())
        await runner.cleanup()


def _with_config_file(ap: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with the options of `--config FILE.yaml` put first (SGLang's ConfigArgumentMerger: the command
    line wins); an option this server does not have is an error naming it."""
    if "--config" not in argv:
        return argv
    import yaml

    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise ValueError("--config needs a YAML file")
    path = argv[at + 1]
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    known = {opt for action in ap._actions for opt in action.option_strings}
    merged: list[str] = []
    for key, value in data.items():
        flag = f"--{str(key).replace('_', '-')}"
        if flag not in known or flag == "--config":
            raise ValueError(f"--config {path}: serve-rollout has no option {flag}")
        if isinstance(value, bool):
            merged += [flag] if value else ([f"--no-{flag[2:]}"] if f"--no-{flag[2:]}" in known else [])
        else:
            merged += [flag, str(value)]
    return merged + argv[:at] + argv[at + 2 :]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dapo-megatron serve-rollout", description=server_module.__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (config + safetensors [+ tokenizer])")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = pick a free port (written to the registry)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0, help="draws of requests when seeds are not honoured")
    ap.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="prompt + max_new_tokens limit (SGLang's flag; 0 = the model's max_position_embeddings)",
    )
    ap.add_argument(
        "--enable-deterministic-inference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="honour sampling_seed as SGLang does with this flag (default on: the CPU engine is "
        "deterministic); off: ignore it, as SGLang does by default",
    )
    ap.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together")
    ap.add_argument("--register-dir", default="", help="write <host>_<port>.json here once serving")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument(
        "--base-gpu-id",
        type=int,
        default=None,
        help="the device slot this engine occupies on its node, as SGLang's flag (the CPU twin of a "
        "colocated engine's GPU: the trainer rank with this local rank feeds it its weights)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:N]: hold the model and KV cache on that GPU (a colocated engine on one "
        "real GPU: CUDA IPC weight payloads, release/resume of device memory)",
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help="SGLang's --api-key: every endpoint but /health*, /ready needs `Authorization: Bearer KEY` "
        "(the admin endpoints need --admin-api-key instead when that is set); rollout/auth.py",
    )
    ap.add_argument(
        "--admin-api-key",
        default=None,
        help="SGLang's --admin-api-key: the weight, memory, cache, pause and abort endpoints need it",
    )
    ap.add_argument(
        "--config",
        default=None,
        help="SGLang's --config: a YAML file of these options (api-key, admin-api-key, ...), so keys stay "
        "off the command line; options given on the command line win",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="bodies above this many bytes are refused (413) before they are read",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(_with_config_file(ap, argv))
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    for flag, key in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key)):
        if key is not None:
            check_key(key, flag)
    if not os.path.isdir(args.model):
        raise ValueError(f"--model: no such directory '{args.model}'")
    if args.threads:
        torch.set_num_threads(args.threads)
    port = args.port or _free_port(args.host)
    engine = CpuEngine(
        args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_batch_size=args.max_batch_size,
        deterministic=args.enable_deterministic_inference,
        context_length=args.context_length,
        device=args.device,
    )
    server = RolloutServer(
        engine,
        model_name=os.path.basename(os.path.normpath(args.model)),
        seed=args.seed,
        limits=Limits(api_key=args.api_key, admin_api_key=args.admin_api_key, max_request_bytes=args.max_request_bytes),
    )
    asyncio.run(
        _serve(
            server,
            host=args.host,
            port=port,
            model=args.model,
            register_dir=args.register_dir,
            base_gpu_id=args.base_gpu_id,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
