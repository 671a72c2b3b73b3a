"""`dapo-megatron serve-rollout`: a CPU generation server that behaves like SGLang's HTTP server wherever a
client can tell (cpu_engine/server.py; docs/sglang.md lists every endpoint and the CPU differences).

    dapo-megatron serve-rollout --model DIR --host 127.0.0.1 --port 30000 [--register-dir RUN/engines]
        [--context-length N] [--no-enable-deterministic-inference] [--config KEYS.yaml] [--max-request-bytes N]

Its command line only (cpu_engine/serve.py serves): no torch here, so `serve-rollout --help` answers at once.
"""

from __future__ import annotations

import argparse

from dapo_megatron.cpu_engine.guard import DEFAULT_MAX_REQUEST_BYTES

_RAW = argparse.RawDescriptionHelpFormatter  # the module docstring's examples keep their lines


def with_config_file(ap: argparse.ArgumentParser, argv: list[str]) -> list[str]:
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dapo-megatron serve-rollout", description=__doc__, formatter_class=_RAW)
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


def parse_help(argv: list[str]) -> None:
    """`serve-rollout --help` (cli.py): the parser's help, without the server's imports."""
    parser().parse_args(argv)
