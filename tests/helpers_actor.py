"""Building and checking the Actor in the distributed tests (gloo ranks, tiny Qwen2 / Qwen3-MoE): the
config, random samples, transformers' reference log-probs, the RL fields of a step and the float64
reference step written out per sequence. Functions that run on a rank are module-level so the rank
pool can send them (tests/rank_pool.py)."""

from __future__ import annotations

import contextlib
import random

import torch

from dapo_megatron.dataplane.sample import Sample
from helpers_fp32 import PolicyStep, hf_response_logprobs, policy_step_of


def make_cfg(*, tp=1, pp=1, cp=1, vpp=None, micro_batch_tokens=256, sequence_parallel=False, fused=False, **trainer):
    """fused: the Triton kernels (interpreted on CPU) for the head and the loss; the tests that do not
    compare the two paths use plain torch (fast); test_actor_fused.py compares them."""
    from dapo_megatron.config import ActorConfig, Config

    cfg = Config()
    cfg.actor = ActorConfig(
        tp=tp,
        pp=pp,
        cp=cp,
        vpp=vpp,
        attention_backend="torch",
        precision="fp32",
        micro_batch_tokens=micro_batch_tokens,
        use_distributed_optimizer=True,
        sequence_parallel=sequence_parallel,
        fused_logprob=fused,
        fused_policy_loss=fused,
    )
    cfg.rollout.temperature = 1.0
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def make_samples(n, *, seed=0, vocab=300):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(2, 9))]
        response = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 12))]
        out.append(Sample(prompt_ids=prompt, response_ids=response, group_index=i // 2))
    return out


def hf_logprobs(hf_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    logps, ents = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(s.prompt_ids) - 1 : -1]
            logps.append(logp.gather(1, ids[0, len(s.prompt_ids) :, None])[:, 0].float())
            ents.append(-(logp.exp() * logp).sum(-1).float())
    return logps, ents


# one Adam step of the layout-parity tests: lr 1e-3, Adam eps 1e-4 (see _updated_weights_rank), the
# config's default weight decay 0.1 and grad clip 1.0
STEP = dict(lr=1e-3, eps=1e-4, weight_decay=0.1, grad_clip=1.0)


def fill_rl_fields(samples, hf_logps, *, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for i, (s, lp) in enumerate(zip(samples, hf_logps)):
        s.old_logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=gen)).tolist()
        s.advantage = [1.5, -1.0, 0.5, -1.5][i % 4]
    if len(samples) > 1:
        samples[1].loss_mask = [1] * (len(samples[1].response_ids) - 1) + [0]
    return samples


class GradientCapture:
    """What gradients_before_the_step records: set `actor` once built; `grads` fills at its step."""

    def __init__(self) -> None:
        self.actor = None
        self.grads: dict = {}


@contextlib.contextmanager
def gradients_before_the_step():
    """Inside: the optimizer step of the registered actor first records its gradient by HF name (each
    main_grad copied into its parameter, read through iter_hf_weights, the parameters restored). FP32
    optimizer without sharding: each main_grad holds the full reduced gradient."""
    import dapo_megatron.actor.optimizer as opt_module

    capture, original = GradientCapture(), opt_module.guarded_step

    def step(optimizer, **kw):
        params = [p for m in capture.actor.model for p in m.module.parameters()]
        saved = [p.data.clone() for p in params]
        for p in params:
            p.data.copy_(p.main_grad)
        capture.grads.update({k: v.clone() for k, v in capture.actor.iter_hf_weights()})
        for p, s in zip(params, saved):
            p.data.copy_(s)
        return original(optimizer, **kw)

    opt_module.guarded_step = step
    try:
        yield capture
    finally:
        opt_module.guarded_step = original


def grads_rank(hf_dir, samples, budget, algo=None, cp=1):
    """One train step at TP=1 x DP=2 (or CP=2 x DP=1) without the distributed optimizer (grads
    all-reduced over DP x CP, so every rank holds the full gradient); returns the gradient by HF
    name, read just before the step."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with gradients_before_the_step() as captured, model_parallel(tp=1, cp=cp, seed=7) as layout:
        cfg = make_cfg(cp=cp, micro_batch_tokens=budget, lr=1e-3, warmup_steps=0)
        cfg.actor.use_distributed_optimizer = False
        for key, value in (algo or {}).items():
            setattr(cfg.algorithm, key, value)
        captured.actor = Actor(actor_settings(cfg), hf_dir, layout)
        metrics = captured.actor.train(samples, step=0)
    return metrics, metrics["num_micro_batches"], captured.grads


def hf_seq_mean_step(hf_dir, samples, *, dtype, eps_low, eps_high, clip_ratio_c, tis_cap, kl_coef) -> PolicyStep:
    """The same big-batch step, written out per sequence for seq-mean-token-mean with overlong
    filtering, truncated importance sampling and a k3 KL term (docs/algorithm.md 5 + the GRPO baseline):
        loss = mean over sequences with a trained token of
               sum_t m_t * (min(pi_old/pi_rollout, C) * l_t + kl_coef * k3_t) / sum_t m_t
    with m_t = 0 for every token of a truncated sample; in `dtype` (float64: the truth, float32: its rounding)."""
    model, lp_all = hf_response_logprobs(hf_dir, samples, dtype=dtype)
    per_seq = []
    for s, lp in zip(samples, lp_all.split([len(s.response_ids) for s in samples])):
        old, rollout, ref = (torch.tensor(v, dtype=dtype) for v in (s.old_logprobs, s.rollout_logprobs, s.ref_logprobs))
        mask = torch.tensor(s.response_mask(), dtype=dtype) * (0.0 if s.truncated else 1.0)
        if mask.sum() == 0:
            continue
        adv = s.advantage
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
        if adv < 0:
            loss = torch.minimum(loss, torch.full_like(loss, -adv * clip_ratio_c))
        tis = torch.clamp(torch.exp(old - rollout), max=tis_cap)
        x = torch.clamp(ref - lp, -20, 20)
        k3 = torch.clamp(torch.exp(x) - x - 1, -10, 10)
        per_seq.append((mask * (tis * loss + kl_coef * k3)).sum() / mask.sum())
    loss = torch.stack(per_seq).mean()
    return policy_step_of(model, lp_all, loss)


def moe_cfg(*, tp=1, ep=1, etp=None, micro_batch_tokens=64, **trainer):
    from dapo_megatron.config import ActorConfig, Config

    cfg = Config()
    cfg.actor = ActorConfig(
        tp=tp,
        ep=ep,
        etp=etp,
        attention_backend="torch",
        precision="fp32",
        micro_batch_tokens=micro_batch_tokens,
        use_distributed_optimizer=True,
        world_size=2,
        sequence_parallel=tp > 1,
    )  # megatron's MoELayer trains TP only with SP
    cfg.rollout.temperature = 1.0
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def _storage_bytes(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
    return out


def measure_actor_static(actor) -> dict[str, int]:
    """Bytes held by the live actor objects, by kind (storages counted once)."""
    params = _storage_bytes(p for m in actor.model for p in m.module.parameters())
    grads = _storage_bytes(buf.grad_data for m in actor.model for buf in m.buffers + m.expert_parallel_buffers)
    known = set(params) | set(grads)
    masters, adam = {}, {}
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            masters.update({k: v for k, v in _storage_bytes(group["params"]).items() if k not in known})
        for state in inner.state.values():
            # 'step' is a host scalar on GPUs (torch AdamW, not capturable) or per group (fused Adam)
            adam.update(_storage_bytes(v for k, v in state.items() if k != "step" and torch.is_tensor(v)))
    return {
        "weights": sum(params.values()),
        "grads": sum(grads.values()),
        "main_params": sum(masters.values()),
        "adam": sum(adam.values()),
    }


def memplan_samples(n, *, seed=0, vocab=300):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(4, 10))]
        response = [rng.randrange(5, vocab) for _ in range(rng.randint(10, 30))]
        s = Sample(prompt_ids=prompt, response_ids=response, group_index=i // 2)
        s.old_logprobs = [-5.0] * len(response)
        s.advantage = 1.0 if i % 2 else -1.0
        out.append(s)
    return out
