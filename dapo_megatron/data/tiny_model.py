"""The embedded default's model: a fixed byte-level tokenizer (data/tiny_tokenizer.py), a tiny Qwen2, and a warm start.

    path = tiny_model_dir(cfg)           # launch/prepare.py; cfg.tiny.enabled -> <trainer.output_dir>/tiny_model/warm
    # the pieces: build_tiny_model(out_dir, seed=, spec=) -> .../init; warm_start(init, out_dir, ...) -> .../warm
    # the data it warm-starts on lives with the data: data/synthetic.py (synthetic_train_eval)

Nothing is downloaded: the tokenizer is a fixed byte-level vocabulary with no merges (every byte is
one token, so every digit is its own token, which is what small models need for arithmetic), and the
model is a randomly initialised Qwen2 from a Qwen2Config, or (TinyModelSpec.arch="qwen3_moe") a
Qwen3-MoE with every layer sparse: QK-norm, a router and num_experts SwiGLU experts of which each
token uses num_experts_per_tok (configs/runs/tiny_cpu_moe.yaml). The warm start is a short supervised pass
(plain torch on the transformers model) on "prompt -> Answer: N<eos>" so that the model emits the
answer format and gets ~30% of the problems right at temperature 1, leaving room for RL (label
smoothing sets that fraction; see warm_start and docs/LOG.md).

Both stages are cached under `<output_dir>/tiny_model/{init,warm}` next to a `build.json` holding
every argument that shaped them; a second call with the same arguments reuses the directory, a call
with different arguments rebuilds it. Everything is deterministic from the seed (fp32; bit-identical
for the same torch thread count on the same CPU).
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dapo_megatron.data.chain_task import CHAIN_LEVEL, warm_start_responses
from dapo_megatron.data.synthetic import synthetic_train_eval  # the warm start trains on its train split
from dapo_megatron.data.tiny_tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, padded_vocab_size, prompt_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny Qwen2 (defaults chosen in docs/LOG.md, 2026-11-22)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA like Qwen2.5; 2 so that TP=2 splits the KV heads too
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    arch: str = "qwen2"  # or "qwen3_moe"
    num_experts: int = 4  # qwen3_moe only
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def validate(self) -> None:
        if self.arch not in ("qwen2", "qwen3_moe"):
            raise ValueError(f"tiny model: arch={self.arch!r} must be qwen2 or qwen3_moe")
        for name, value in asdict(self).items():
            if name != "arch" and value < 1:
                raise ValueError(f"tiny model: {name}={value} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"tiny model: hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"tiny model: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


# --------------------------------------------------------------------------------------------
# Model


def _cache_ok(path: Path, record: dict, *, cached_only: bool = False) -> bool:
    """Whether `path` holds a build made with `record`; with cached_only a miss is an error naming why."""
    meta = path / "build.json"
    if not meta.is_file() or not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        why = "nothing is built there"
    else:
        try:
            stored = json.loads(meta.read_text())
        except json.JSONDecodeError:
            stored, why = None, "its build.json is not JSON"
        if stored == record:
            return True
        if stored is not None:
            keys = sorted(k for k in set(stored) | set(record) if stored.get(k) != record.get(k))
            why = f"it was built with other settings (build.json differs in {', '.join(keys)})"
    if cached_only:
        raise ValueError(
            f"tiny.require_cached=true: {path}: {why}; build it first with the same config "
            "(python -m dapo_megatron.launch.prepare CONFIG ..., or tests/gpu/prepare.sh for the GPU check)"
        )
    return False


def _write_atomically(path: Path, record: dict, save) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save(tmp)
    (tmp / "build.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _tiny_hf_config(spec: TinyModelSpec, *, eos_token_id: int, pad_token_id: int, vocab: int) -> PretrainedConfig:
    """The transformers config of the tiny model: Qwen2 (dense) or Qwen3-MoE, as `spec` says."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=padded_vocab_size(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,  # like Qwen2.5-7B/32B and Qwen3-30B-A3B: a separate LM head
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=spec.hidden_size // spec.num_heads,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=True,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )  # Qwen3-30B-A3B's routing: every layer sparse, normalised top-k
    return Qwen2Config(**common)


def build_tiny_model(
    out_dir: str | Path, *, seed: int, spec: TinyModelSpec = TinyModelSpec(), cached_only: bool = False
) -> Path:
    """Random-init tiny Qwen2 + tokenizer saved (fp32 safetensors) to `<out_dir>/tiny_model/init`.

    Idempotent: an existing directory built with the same seed and spec is reused (cached_only: or
    ValueError, nothing is built).
    """
    spec.validate()
    path = Path(out_dir) / "tiny_model" / "init"
    spec_record = asdict(spec)
    if spec.arch == "qwen2":  # the dense default's cache key as before the MoE variant existed
        for key in ("arch", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            spec_record.pop(key)
    record = {"stage": "init", "seed": seed, "spec": spec_record}
    if _cache_ok(path, record, cached_only=cached_only):
        return path  # before importing transformers' model classes: ~1.4 s of CPU every launch saves
    from transformers import Qwen2ForCausalLM

    tok = build_tiny_tokenizer()
    config = _tiny_hf_config(spec, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, vocab=len(tok))
    torch.manual_seed(seed)
    if spec.arch == "qwen3_moe":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config).float()
    else:
        model = Qwen2ForCausalLM(config).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _write_atomically(path, record, save)


# --------------------------------------------------------------------------------------------
# Warm start: supervised pass on the answer format

# One thread: the model is so small that a second thread only adds synchronisation, and on a loaded
# 2-core machine OpenMP's spinning made 30 steps take 128 s with 2 threads against 6 s with 1
# (docs/LOG.md, 2026-11-23). A fixed count also makes the result independent of the machine's cores.
WARM_START_THREADS = 1


def answer_text(answer: str) -> str:
    """The response the warm start teaches (and math_dapo parses): `Answer: N`."""
    return f"Answer: {answer}"


def sft_batch(
    tokenizer, prompts: Sequence[str], answers: Sequence[str], *, responses: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / labels: loss only on the response tokens and the closing EOS.
    The response is `Answer: N` for answer N, or responses[i] verbatim where given (data/chain_task.py)."""
    rows, labels = [], []
    texts = list(responses) if responses is not None else [answer_text(a) for a in answers]
    for p, text in zip(prompts, texts):
        p_ids = prompt_ids(tokenizer, p)
        r_ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "labels": lab, "attention_mask": mask}


def _check_warm_start(prompts, answers, responses, *, steps: int, batch_size: int, lr: float, eps: float) -> None:
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(f"warm start: need equally many prompts and answers (got {len(prompts)} and {len(answers)})")
    if steps < 0 or batch_size < 1 or lr <= 0 or not 0 <= eps < 1:
        raise ValueError(
            f"warm start: steps={steps} (>= 0), batch_size={batch_size} (>= 1), lr={lr} (> 0), "
            f"label_smoothing={eps} (in [0, 1))"
        )
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(f"warm start: {len(responses)} responses for {len(prompts)} prompts")


def _warm_start_record(
    init_dir: Path, digest: str, *, steps: int, batch_size: int, lr: float, seed: int, label_smoothing: float
) -> dict:
    """What names a warm-start pass in its cache (build.json): the init model's record, the data, the knobs."""
    init_record = json.loads((init_dir / "build.json").read_text()) if (init_dir / "build.json").is_file() else {}
    return {
        "stage": "warm",
        "init": init_record,
        "data": digest,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "label_smoothing": label_smoothing,
        "torch_threads": WARM_START_THREADS,
    }


def warm_start(
    init_dir: str | Path,
    out_dir: str | Path,
    *,
    prompts: Sequence[str],
    answers: Sequence[str],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    label_smoothing: float = 0.0,
    cached_only: bool = False,
    responses: Sequence[str] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Path:
    """Supervised pass: `steps` AdamW updates on random batches of (prompt, "Answer: N"), cached
    (cached_only: the cached pass or ValueError, no training). on_step(n): n updates done (progress).

    Returns `<out_dir>/tiny_model/warm`. `label_smoothing` (eps) is the knob that sets the starting
    accuracy, not `steps`: stopping the supervised pass early lands anywhere between 4% and 66%
    (docs/LOG.md: the model learns carrying in a sudden jump whose step moves with the schedule),
    while a converged pass with smoothed targets is calibrated to put 1 - eps on the right token
    and eps spread over the other real tokens. A response of L tokens is then right with
    probability ~(1 - eps)^L at temperature 1: eps = 0.1, L = 11 ("Answer: 85" + EOS) -> 0.31.
    RL's job is to make the model sure of what it knows (and every error it samples is a plain
    token slip, never an unknown id: the padded vocabulary rows get no smoothing mass).
    """
    _check_warm_start(prompts, answers, responses, steps=steps, batch_size=batch_size, lr=lr, eps=label_smoothing)
    init_dir = Path(init_dir)
    path = Path(out_dir) / "tiny_model" / "warm"
    # the targets it trains on name the cache: `Answer: N` (the default, digest as before) or the responses
    digest = _digest(list(prompts), list(answers) if responses is None else list(responses))
    record = _warm_start_record(
        init_dir, digest, steps=steps, batch_size=batch_size, lr=lr, seed=seed, label_smoothing=label_smoothing
    )
    if _cache_ok(path, record, cached_only=cached_only):
        return path
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_START_THREADS)
    try:
        return _warm_start(
            init_dir,
            path,
            record,
            prompts=prompts,
            answers=answers,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            label_smoothing=label_smoothing,
            responses=responses,
            on_step=on_step,
        )
    finally:
        torch.set_num_threads(threads)


def _warm_start_lr(step: int, *, steps: int, lr: float) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine down to 10% of lr."""
    warmup = max(1, steps // 10)
    frac = (
        (step + 1) / warmup
        if step < warmup
        else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    )
    return lr * min(1.0, frac)


def _warm_start(
    init_dir: Path,
    path: Path,
    record: dict,
    *,
    prompts: Sequence[str],
    answers: Sequence[str],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    label_smoothing: float,
    responses: Sequence[str] | None,
    on_step: Callable[[int], None] | None = None,
) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # smoothing mass goes to the tokens a response can hold (bytes and EOS), not to pad / chat tags /
    # the unused rows 261..319 of the padded vocabulary
    smooth_ids = torch.tensor([i for i in range(len(tok)) if i == tok.eos_token_id or i >= len(SPECIAL_TOKENS)])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _warm_start_lr(step, steps=steps, lr=lr)
        idx = [rng.randrange(len(prompts)) for _ in range(batch_size)]
        batch = sft_batch(
            tok,
            [prompts[i] for i in idx],
            [answers[i] for i in idx],
            responses=None if responses is None else [responses[i] for i in idx],
        )
        loss = smoothed_nll(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            batch["labels"],
            eps=label_smoothing,
            smooth_ids=smooth_ids,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if on_step is not None:
            on_step(step + 1)
    model.eval()

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _write_atomically(path, record, save)


def smoothed_nll(logits: torch.Tensor, labels: torch.Tensor, *, eps: float, smooth_ids: torch.Tensor) -> torch.Tensor:
    """Mean over labelled tokens of (1 - eps) * -log p(target) + eps * mean_{j in smooth_ids} -log p(j).

    logits [B, T, V] predict labels shifted by one (labels[:, t + 1]); -100 marks unlabelled tokens.
    The minimiser is p(target) = 1 - eps + eps / |S| and eps / |S| on every other id of S.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = labels[:, 1:]
    keep = target != -100
    nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    uniform = -logp[..., smooth_ids].mean(dim=-1)
    per_token = (1.0 - eps) * nll + eps * uniform
    return per_token[keep].mean()


def _digest(prompts: list[str], answers: list[str]) -> str:
    import hashlib

    h = hashlib.sha256()
    for p, a in zip(prompts, answers):
        h.update(p.encode() + b"\0" + a.encode() + b"\1")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# The embedded default, from a Config


def _moe_spec_fields(tn) -> dict:
    """TinyModelSpec fields of the MoE variant (none for the dense default, so its cache key and
    build.json stay what they were)."""
    if tn.arch != "qwen3_moe":
        return {}
    return dict(
        arch=tn.arch,
        num_experts=tn.num_experts,
        num_experts_per_tok=tn.num_experts_per_tok,
        moe_intermediate_size=tn.moe_intermediate_size,
    )


def prepare_tiny_model(
    tiny, synthetic, *, out_dir: str | Path, seed: int, max_positions: int, on_step: Callable[[int], None] | None = None
) -> str:
    """Build (or reuse) `<tiny.cache_dir or out_dir>/tiny_model/warm` from the config's tiny section and
    the synthetic train set (data.synthetic); max_positions: the longest prompt + response.

    Returns the HF directory to use as model.path (actor, rollout engines and eval all load it);
    launch/prepare.py: tiny_model_dir(cfg) passes a config's sections.
    """
    tn, syn = tiny, synthetic
    if not tn.enabled:
        raise ValueError("prepare_tiny_model: tiny.enabled is false (set model.path instead)")
    spec = TinyModelSpec(
        hidden_size=tn.hidden_size,
        num_layers=tn.num_layers,
        num_heads=tn.num_heads,
        num_kv_heads=tn.num_kv_heads,
        intermediate_size=tn.intermediate_size,
        max_position_embeddings=max(256, max_positions),
        **_moe_spec_fields(tn),
    )
    cache = tn.cache_dir or str(out_dir)
    init = build_tiny_model(cache, seed=seed, spec=spec, cached_only=tn.require_cached)
    train, _ = synthetic_train_eval(
        num_train=syn.num_train, num_eval=syn.num_eval, difficulty=syn.difficulty, seed=syn.seed, style=syn.style
    )
    responses = None
    if syn.difficulty == CHAIN_LEVEL:  # chain sums: worked or direct responses (data/chain_task.py)
        responses = warm_start_responses([r.prompt for r in train], seed=syn.seed)
    warm = warm_start(
        init,
        cache,
        prompts=[r.prompt for r in train],
        answers=[r.ground_truth for r in train],
        steps=tn.warm_start_steps,
        batch_size=tn.warm_start_batch_size,
        lr=tn.warm_start_lr,
        seed=seed,
        label_smoothing=tn.label_smoothing,
        cached_only=tn.require_cached,
        responses=responses,
        on_step=on_step,
    )
    return str(warm)
