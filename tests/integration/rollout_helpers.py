"""Helpers for the rollout tests: a tiny Qwen2 checkpoint with an offline-trained tokenizer, and
real `dapo-megatron serve-rollout` processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from dapo_megatron.rollout.client import EngineClient
from helpers_tiny import VOCAB_SIZE, save_tiny_hf

REPO = Path(__file__).resolve().parents[2]


def save_tiny_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE of VOCAB_SIZE tokens trained on arithmetic text; ids 0/1/2 = pad/bos/eos
    (the tiny config's pad/bos/eos ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? Answer: {a + b}\n" for a in range(40) for b in range(0, 40, 3)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


def make_tiny_checkpoint(out_dir: Path, *, seed: int = 0, shape: dict | None = None) -> Path:
    save_tiny_hf(out_dir, arch="qwen2", tied=False, num_layers=2, seed=seed, shape=shape)
    save_tiny_tokenizer(out_dir)
    return out_dir


class ServerProcess:
    """One `dapo-megatron serve-rollout` subprocess; url known once it has registered."""

    def __init__(
        self,
        model_dir: Path,
        register_dir: Path,
        *,
        seed: int = 0,
        log_path: Path | None = None,
        port: int = 0,
        extra_args: tuple[str, ...] = (),
    ):
        self.register_dir = Path(register_dir)
        before = set(self.register_dir.glob("*.json")) if self.register_dir.exists() else set()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.log = open(log_path or os.devnull, "ab")  # noqa: SIM115 (the server writes it until close())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dapo_megatron.cli",
                "serve-rollout",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--register-dir",
                str(register_dir),
                "--seed",
                str(seed),
                "--threads",
                "1",
                *extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        try:
            self.record = self._wait_registered(before)
        except BaseException:
            self.kill()  # never leave a server behind a failed start
            raise
        self.url = self.record["url"]

    def _wait_registered(self, before: set, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve-rollout exited with {self.proc.returncode}")
            for path in self.register_dir.glob("*.json"):  # a restart on a known port rewrites its file
                if path.name.startswith("."):  # write_registration's temp file, possibly half written
                    continue
                rec = json.loads(path.read_text())
                if rec["pid"] == self.proc.pid:
                    return rec
            time.sleep(0.1)
        raise TimeoutError("serve-rollout did not register")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def request_json(
    url: str, data: bytes | None = None, *, key: str | None = None, method: str = "POST"
) -> tuple[int, object]:
    """(status, body): a success's JSON body (None when empty), an error's JSON body or, when it is not
    JSON, its raw bytes. `key`: sent as `Authorization: Bearer <key>`."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw


@contextlib.contextmanager
def engine_pair(root: Path, *, shape: dict | None = None):
    """{"root", "model_dir", "engines"}: two CPU engines (seeds 0 and 1) serving one tiny checkpoint
    (`shape`: its config overrides), each logging to root/engine_<i>.log; both killed on exit."""
    model_dir = make_tiny_checkpoint(root / "model", seed=0, shape=shape)
    engines = [ServerProcess(model_dir, root / "engines", seed=i, log_path=root / f"engine_{i}.log") for i in range(2)]
    try:
        yield {"root": root, "model_dir": model_dir, "engines": engines}
    finally:
        for e in engines:
            e.kill()


async def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    client = EngineClient(url)
    try:
        # fp32 values through JSON floats: exact (every fp32 is a float64)
        return {
            n: torch.tensor(await client.get_weights_by_name(n, truncate_size=1 << 30), dtype=torch.float32)
            for n in names
        }
    finally:
        await client.close()


PROMPT = [1, 17, 42, 99, 7, 250]


def post(url: str, body) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            return resp.status, (
                json.loads(raw) if raw and resp.headers.get_content_type() == "application/json" else raw
            )
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under a plain transformers forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    scaled = logits[len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def generate(url, **body):
    status, out = post(url + "/generate", body)
    assert status == 200, out
    return out
