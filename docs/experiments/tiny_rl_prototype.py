"""Prototype of the tiny run's RL dynamics: plain torch + transformers, no Megatron, no HTTP.

    HF_HUB_OFFLINE=1 python docs/experiments/tiny_rl_prototype.py configs/runs/tiny_cpu.yaml \
        trainer.output_dir=/tmp/proto trainer.lr=3e-4            # any config, any dotted overrides
    python docs/experiments/tiny_rl_prototype.py configs/runs/tiny_cpu_grpo.yaml   # naive-GRPO rung

It exists to choose the embedded default's settings (task difficulty, model size, n, batch sizes,
lr, response length, steps) before the real loop (trainer/train.py: Megatron actor + CPU rollout server)
exists, from the same config file, and it uses the same pieces that loop uses: dapo_megatron.data.tiny_model (tokenizer, model, warm
start), dapo_megatron.algo (advantages, policy loss, dynamic sampling, overlong shaping, KL),
dapo_megatron.trainer.evaluation.sampling (avg@k / pass@k), the synthetic task and the math_dapo reward. What it
leaves out: Megatron, the HTTP rollout server, weight sync, checkpoints (trainer/train.py's overheads).
Results go to docs/LOG.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dapo_megatron import algo
from dapo_megatron.reward import math_dapo
from dapo_megatron.trainer.evaluation.sampling import avg_at_k, pass_at_k
from dapo_megatron.config import load_config
from dapo_megatron.data.tiny_model import prompt_ids, synthetic_train_eval
from dapo_megatron.launch.prepare import tiny_model_dir

# ------------------------------------------------------------------------------------------------
# Reward, sampling and log-probs on the HF model


def score(text: str, truth: str) -> float:
    return float(math_dapo.score(text, truth).acc)


@torch.no_grad()
def sample(model, tok, prompts: list[str], *, n: int, max_new: int, temperature: float, top_p: float, seed: int):
    """n responses per prompt; returns list of (prompt_ids, response_ids incl. EOS, truncated)."""
    torch.manual_seed(seed)
    rows = [prompt_ids(tok, p) for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=max_new,
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad,
    )
    res = []
    for r, seq in zip(rows, out[:, width:].tolist()):
        if tok.eos_token_id in seq:
            seq = seq[: seq.index(tok.eos_token_id) + 1]
            res.append((r, seq, False))
        else:
            res.append((r, seq, True))
    return res


def token_logprobs(model, batch):
    """[B, T] log-probs of response tokens (right-padded) and the [B, T] mask."""
    rows = [p + r for p, r, _ in batch]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    T = max(len(r) for _, r, _ in batch)
    mask = torch.zeros(len(batch), T)
    lp_rows = []
    for i, (p, r, _) in enumerate(batch):
        lp_rows.append(lp[i, len(p) - 1 : len(p) - 1 + len(r)])
        mask[i, : len(r)] = 1
    out = torch.stack([torch.nn.functional.pad(x, (0, T - x.numel())) for x in lp_rows])
    return out, mask


def evaluate(model, tok, problems, *, k: int, max_new: int, top_p: float, seed: int) -> dict:
    prompts = [p for p, _ in problems]
    res = sample(model, tok, prompts, n=k, max_new=max_new, temperature=1.0, top_p=top_p, seed=seed)
    correct = torch.tensor(
        [score(tok.decode(r, skip_special_tokens=True), problems[i // k][1]) for i, (_, r, _) in enumerate(res)]
    ).view(len(problems), k)
    return {"avg": float(avg_at_k(correct)), "pass": float(pass_at_k(correct, k=k).mean())}


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="configs/runs/tiny_cpu.yaml")
    ap.add_argument("overrides", nargs="*", help="dotted key=value, as for `dapo-megatron train`")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    r, al, t, syn = cfg.rollout, cfg.algorithm, cfg.trainer, cfg.data.synthetic

    t0 = time.time()
    train_rec, held_rec = synthetic_train_eval(
        num_train=syn.num_train, num_eval=syn.num_eval, difficulty=syn.difficulty, seed=syn.seed, style=syn.style
    )
    train = [(x.prompt, x.ground_truth) for x in train_rec]
    held = [(x.prompt, x.ground_truth) for x in held_rec]
    warm = tiny_model_dir(cfg)
    t_build = time.time() - t0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(warm)
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32) if al.use_kl else None
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2)
    )
    ev = lambda s: evaluate(
        model.eval(),
        tok,
        held,
        k=t.eval_n,
        max_new=r.max_response_length,  # noqa: E731
        top_p=t.eval_top_p,
        seed=7 + s,
    )
    curve = []
    e = ev(0)
    print(
        f"build+warm {t_build:.1f}s  step 0 avg@{t.eval_n}={e['avg']:.3f} pass@{t.eval_n}={e['pass']:.3f}", flush=True
    )
    curve.append({"step": 0, "t": 0.0, **e})
    rng = random.Random(t.seed)
    order = list(range(len(train)))
    rng.shuffle(order)
    cursor = 0
    t_rl = time.time()
    for step in range(1, t.total_steps + 1):
        ts = time.time()
        sampler = algo.DynamicSampler(
            train_batch_size=t.train_batch_size,
            enabled=al.dynamic_sampling,
            max_num_gen_batches=al.max_num_gen_batches,
            on_exhausted=al.on_gen_batches_exhausted,
        )
        rounds_gen = 0
        accs = []
        while not sampler.done:
            take = [train[order[(cursor + i) % len(order)]] for i in range(r.gen_batch_size)]
            cursor += len(take)
            res = sample(
                model.eval(),
                tok,
                [p for p, _ in take],
                n=r.n,
                max_new=r.max_response_length,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=t.seed * 100003 + step * 101 + rounds_gen,
            )
            rounds_gen += 1
            groups = []
            for g, (_, truth) in enumerate(take):
                grp = []
                for p, resp, trunc in res[g * r.n : (g + 1) * r.n]:
                    acc = score(tok.decode(resp, skip_special_tokens=True), truth)
                    grp.append({"p": p, "r": resp, "trunc": trunc, "acc": acc})
                    accs.append(acc)
                groups.append(grp)
            sampler.add_round([_Group(g) for g in groups])
        batch_groups = sampler.take()
        t_gen = time.time() - ts
        flat = [s for grp in batch_groups for s in grp.samples]
        rewards = torch.tensor([2 * s["acc"] - 1 for s in flat])
        if al.overlong_shaping:
            lengths = torch.tensor([len(s["r"]) for s in flat])
            rewards = rewards + algo.overlong_penalty(
                lengths,
                max_length=r.max_response_length,
                buffer_length=al.overlong_buffer_length,
                factor=al.overlong_penalty_factor,
            )
        gidx = torch.tensor([gi for gi, grp in enumerate(batch_groups) for _ in grp.samples])
        adv = algo.group_advantages(rewards, gidx, eps=al.advantage_eps)
        batch = [(s["p"], s["r"], s["trunc"]) for s in flat]
        model.eval()
        with torch.no_grad():
            old_lp, mask = token_logprobs(model, batch)
            ref_lp = token_logprobs(ref, batch)[0] if ref is not None else None
        model.train()
        per_mb = t.mini_batch_size * r.n
        stats = []
        for lo in range(0, len(batch), per_mb):
            sl = slice(lo, lo + per_mb)
            lp, m = token_logprobs(model, batch[sl])
            T = lp.shape[1]
            if al.overlong_filter:
                m = m * algo.overlong_filter_mask([b[2] for b in batch[sl]])[:, None]
            loss, st = algo.policy_loss(
                lp,
                old_lp[sl, :T],
                adv[sl, None],
                m,
                eps_low=al.eps_low,
                eps_high=al.eps_high,
                clip_ratio_c=al.clip_ratio_c,
                agg_mode=al.loss_agg_mode,
            )
            if ref_lp is not None:  # GRPO: per-sequence mean of the per-token k3 estimate
                kl = algo.kl_penalty(lp, ref_lp[sl, :T], al.kl_kind)
                loss = loss + al.kl_coef * ((kl * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
            for g in opt.param_groups:
                g["lr"] = t.lr * min(1.0, step / max(1, t.warmup_steps))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            stats.append({k: float(v) for k, v in st.items()} | {"grad_norm": float(gn)})
        dt = time.time() - ts
        line = {
            "step": step,
            "t": time.time() - t_rl,
            "step_s": dt,
            "gen_s": t_gen,
            "rounds": rounds_gen,
            "train_acc": sum(accs) / len(accs),
            "resp_len": float(mask.sum(1).mean()),
            "clip_high": sum(s["clipfrac_high"] for s in stats) / len(stats),
            "kl": sum(s["approx_kl"] for s in stats) / len(stats),
        }
        if (t.eval_every and step % t.eval_every == 0) or step == t.total_steps:
            te = time.time()
            line |= ev(step)
            line["eval_s"] = time.time() - te
            curve.append({"step": step, "t": line["t"], "avg": line["avg"], "pass": line["pass"]})
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    print(f"RL phase {time.time() - t_rl:.1f}s; build + warm start {t_build:.1f}s")
    print("CURVE", json.dumps(curve))


class _Group(list):
    """A group as DynamicSampler reads it (a list of accuracies) that keeps its samples."""

    def __init__(self, samples):
        super().__init__(s["acc"] for s in samples)
        self.samples = samples


if __name__ == "__main__":
    main()
