"""`dapo-megatron serve-rollout`: the command line and the serving loop of the CPU engine (server.py).

    dapo-megatron serve-rollout --model DIR --host 127.0.0.1 --port 30000 [--register-dir RUN/engines]
        [--context-length N] [--no-enable-deterministic-inference] [--config KEYS.yaml] [--max-request-bytes N]

Keys as SGLang takes them: --api-key, --admin-api-key, or (what our launchers use, so no key is on a
command line) --config FILE.yaml holding `api-key` / `admin-api-key` (SGLang's --config format; any other
option of this command may be in it too, the command line wins).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import socket
import sys

import torch
from aiohttp import web

from dapo_megatron.cpu_engine.engine import CpuEngine
from dapo_megatron.cpu_engine.guard import Limits
from dapo_megatron.cpu_engine.serve_args import parser as _parser
from dapo_megatron.cpu_engine.serve_args import with_config_file as _with_config_file
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
