"""Prototype of the tiny run's RL dynamics: plain torch + transformers, no Megatron, no HTTP.

    HF_HUB_OFFLINE=1 python docs/experiments/tiny_rl_prototype.py --out /tmp/proto --steps 40
    python docs/experiments/tiny_rl_prototype.py --recipe grpo ...      # naive-GRPO rung

It exists to choose the embedded default's settings (task difficulty, model size, n, batch sizes,
lr, response length, steps) before the real loop (train.py: Megatron actor + CPU rollout server)
exists, and it uses the same pieces that loop uses: dapo_megatron.tiny (tokenizer, model, warm
start), dapo_megatron.algo (advantages, policy loss, dynamic sampling, overlong shaping, KL),
dapo_megatron.evaluate (avg@k / pass@k) and the synthetic task / math_dapo reward when present.
Results go to docs/LOG.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from dapo_megatron import algo
from dapo_megatron.reward import math_dapo
from dapo_megatron.data.synthetic import make_synthetic_task
from dapo_megatron.evaluate import avg_at_k, pass_at_k
from dapo_megatron.tiny import TinyModelSpec, build_tiny_model, prompt_ids, warm_start

# ------------------------------------------------------------------------------------------------
# Task and reward (the project's own when they exist, else local stand-ins with the same contract)


def make_task(num: int, *, difficulty: int, seed: int) -> list[tuple[str, str]]:
    """(prompt text, integer answer string) pairs of the project's synthetic task, compact style."""
    rows = make_synthetic_task(num, difficulty=difficulty, seed=seed, style="compact")
    return [(r.prompt, r.ground_truth) for r in rows]


def score(text: str, truth: str) -> float:
    return float(math_dapo.score(text, truth).acc)


# ------------------------------------------------------------------------------------------------
# Sampling and log-probs on the HF model


@torch.no_grad()
def sample(model, tok, prompts: list[str], *, n: int, max_new: int, temperature: float, top_p: float, seed: int):
    """n responses per prompt; returns list of (prompt_ids, response_ids incl. EOS, truncated)."""
    torch.manual_seed(seed)
    rows = [prompt_ids(tok, p) for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                         top_p=top_p, top_k=0, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                         pad_token_id=pad)
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
    out = torch.zeros(len(batch), T)
    mask = torch.zeros(len(batch), T)
    lp_rows = []
    for i, (p, r, _) in enumerate(batch):
        lp_rows.append(lp[i, len(p) - 1: len(p) - 1 + len(r)])
        mask[i, : len(r)] = 1
    out = torch.stack([torch.nn.functional.pad(x, (0, T - x.numel())) for x in lp_rows])
    return out, mask


def evaluate(model, tok, problems, *, k: int, max_new: int, top_p: float, seed: int) -> dict:
    prompts = [p for p, _ in problems]
    res = sample(model, tok, prompts, n=k, max_new=max_new, temperature=1.0, top_p=top_p, seed=seed)
    correct = torch.tensor([score(tok.decode(r, skip_special_tokens=True), problems[i // k][1])
                            for i, (_, r, _) in enumerate(res)]).view(len(problems), k)
    return {"avg": float(avg_at_k(correct)), "pass": float(pass_at_k(correct, k=k).mean())}


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/tiny_proto")
    ap.add_argument("--recipe", choices=["dapo", "grpo"], default="dapo")
    ap.add_argument("--difficulty", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--smooth", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--mini-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=100)
    ap.add_argument("--eval-k", type=int, default=8)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop RL after this many seconds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dapo = args.recipe == "dapo"

    t0 = time.time()
    train = make_task(args.num_train, difficulty=args.difficulty, seed=1234)
    held = make_task(args.eval_prompts, difficulty=args.difficulty, seed=99991)
    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden)
    init = build_tiny_model(args.out, seed=args.seed, spec=spec)
    warm = warm_start(init, args.out, prompts=[p for p, _ in train], answers=[a for _, a in train],
                      steps=args.sft_steps, batch_size=args.sft_batch, lr=args.sft_lr, seed=args.seed,
                      label_smoothing=args.smooth)
    t_build = time.time() - t0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(warm)
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32) if not dapo else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    ev = lambda s: evaluate(model.eval(), tok, held, k=args.eval_k, max_new=args.max_new, top_p=1.0, seed=7 + s)  # noqa: E731
    curve = []
    e = ev(0)
    print(f"build+warm {t_build:.1f}s  step 0 avg@{args.eval_k}={e['avg']:.3f} pass@{args.eval_k}={e['pass']:.3f}", flush=True)
    curve.append({"step": 0, "t": 0.0, **e})
    rng = random.Random(args.seed)
    order = list(range(len(train)))
    rng.shuffle(order)
    cursor = 0
    t_rl = time.time()
    for step in range(1, args.steps + 1):
        ts = time.time()
        sampler = algo.DynamicSampler(train_batch_size=args.train_batch, enabled=dapo, max_num_gen_batches=10,
                                      on_exhausted="train")
        rounds_gen = 0
        accs = []
        while not sampler.done:
            take = [train[order[(cursor + i) % len(order)]] for i in range(args.gen_batch if dapo else args.train_batch)]
            cursor += len(take)
            res = sample(model.eval(), tok, [p for p, _ in take], n=args.n, max_new=args.max_new,
                         temperature=1.0, top_p=1.0, seed=args.seed * 100003 + step * 101 + rounds_gen)
            rounds_gen += 1
            groups = []
            for g, (_, truth) in enumerate(take):
                grp = []
                for p, r, trunc in res[g * args.n:(g + 1) * args.n]:
                    acc = score(tok.decode(r, skip_special_tokens=True), truth)
                    grp.append({"p": p, "r": r, "trunc": trunc, "acc": acc})
                    accs.append(acc)
                groups.append(grp)
            sampler.add_round([_Group(g) for g in groups])
        batch_groups = sampler.take()
        t_gen = time.time() - ts
        flat = [s for grp in batch_groups for s in grp.samples]
        rewards = torch.tensor([2 * s["acc"] - 1 for s in flat])
        if dapo:
            lengths = torch.tensor([len(s["r"]) for s in flat])
            rewards = rewards + algo.overlong_penalty(lengths, max_length=args.max_new, buffer_length=4, factor=1.0)
        gidx = torch.tensor([gi for gi, grp in enumerate(batch_groups) for _ in grp.samples])
        adv = algo.group_advantages(rewards, gidx)
        batch = [(s["p"], s["r"], s["trunc"]) for s in flat]
        model.eval()
        with torch.no_grad():
            old_lp, mask = token_logprobs(model, batch)
            ref_lp = token_logprobs(ref, batch)[0] if ref is not None else None
        model.train()
        per_mb = args.mini_batch * args.n
        stats = []
        for lo in range(0, len(batch), per_mb):
            sl = slice(lo, lo + per_mb)
            lp, m = token_logprobs(model, batch[sl])
            T = lp.shape[1]
            loss, st = algo.policy_loss(lp, old_lp[sl, :T], adv[sl, None], m, eps_low=0.2,
                                        eps_high=0.28 if dapo else 0.2, clip_ratio_c=10.0,
                                        agg_mode="token-mean" if dapo else "seq-mean-token-mean")
            if ref_lp is not None:
                kl = algo.kl_penalty(lp, ref_lp[sl, :T], "k3")
                loss = loss + 0.001 * ((kl * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats.append({k: float(v) for k, v in st.items()} | {"grad_norm": float(gn)})
        dt = time.time() - ts
        line = {"step": step, "t": time.time() - t_rl, "step_s": dt, "gen_s": t_gen, "rounds": rounds_gen,
                "train_acc": sum(accs) / len(accs), "resp_len": float(mask.sum(1).mean()),
                "clip_high": sum(s["clipfrac_high"] for s in stats) / len(stats),
                "kl": sum(s["approx_kl"] for s in stats) / len(stats)}
        if step % args.eval_every == 0 or step == args.steps:
            line |= ev(step)
            curve.append({"step": step, "t": line["t"], "avg": line["avg"], "pass": line["pass"]})
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
        if time.time() - t_rl > args.budget_s:
            break
    print("CURVE", json.dumps(curve))


class _Group(list):
    """A group as DynamicSampler reads it (a list of accuracies) that keeps its samples."""

    def __init__(self, samples):
        super().__init__(s["acc"] for s in samples)
        self.samples = samples


if __name__ == "__main__":
    main()
