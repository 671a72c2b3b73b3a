"""Float64 references for the layout-parity tests, and the bounds fp32 rounding allows around them.

Two fp32 layouts of one computation (TP=1 vs TP=2, PP, CP, EP, DP, fused vs plain, micro-batched vs
one batch) differ only in the order of their fp32 sums, and how far apart that puts them depends on
the CPU's kernels (blocking, vector width, FMA): a fixed tolerance between two fp32 results holds on
one CPU and fails on another (TP=2 vs TP=1 loss: 1.1e-6 relative on an Intel Xeon, 2026-11-26, where
rel=1e-6 was asserted). So each layout is compared with the float64 value of the same computation,
within SAFETY times the rounding error that a plain-torch fp32 evaluation of that computation (the
transformers model) shows against the same float64 value on this CPU. The bound moves with the
machine's fp32 error and stays orders of magnitude below a real mistake (a token too many or too
few, a missing reduction, a RoPE position off by one: 1e-3 and up).

Each bound is built from a statistic that does not depend on luck in one number: the largest
per-token log-prob error over every token of the batch, the largest gradient error over a whole
tensor, the norm of the whole gradient error; a scalar (the loss) gets the first-order propagation
of the per-token error, sum_t |dL/dlogp_t| * max_t |dlogp_t|, never its own single measured error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# the layouts' fp32 sums run in other orders than the transformers reference: measured worst ratio of
# a layout's error to its bound 0.36 (AMD EPYC, 2026-11-26), so 4 leaves a factor of 10
SAFETY = 4.0
U32 = 2.0**-24  # fp32 unit roundoff


@dataclass
class PolicyStep:
    """One DAPO loss over a batch on the transformers model: its value, the per-token log-probs
    (all samples concatenated), dL/dlogp per token and the gradient by HF name."""

    loss: float
    logprobs: torch.Tensor
    dloss_dlogprobs: torch.Tensor
    grads: dict[str, torch.Tensor]


def hf_response_logprobs(hf_dir, samples, *, dtype, forward_context=None):
    """The transformers model in `dtype` and the log-probs of every response token, all samples
    concatenated, as a non-leaf that keeps its gradient (dL/dlogp after a backward). forward_context(model,
    sample), if given, is a context manager around each sample's forward (a MoE's forced routing)."""
    from transformers import AutoModelForCausalLM

    # eager experts: transformers' grouped-GEMM MoE path has no float64 kernel (dense models ignore it)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, experts_implementation="eager")
    logps = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with forward_context(model, s) if forward_context else contextlib.nullcontext():
            logp = torch.log_softmax(model(ids).logits[0], -1)[len(s.prompt_ids) - 1 : -1]
        logps.append(logp.gather(1, ids[0, len(s.prompt_ids) :, None])[:, 0])
    logp_all = torch.cat(logps)
    logp_all.retain_grad()
    return model, logp_all


def policy_step_of(model, logp_all: torch.Tensor, loss: torch.Tensor) -> PolicyStep:
    """Backward of `loss` (a function of logp_all) and the step: by public names (a MoE's fused experts as
    per-expert tensors, as checkpoints and the actor name them)."""
    from dapo_megatron.weights.hf_layout import public_expert_views

    loss.backward()
    grads = public_expert_views({name: p.grad.double() for name, p in model.named_parameters()})
    return PolicyStep(float(loss.detach()), logp_all.detach().double(), logp_all.grad.double(), grads)


def hf_policy_step(
    hf_dir, samples, *, dtype, eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, forward_context=None
) -> PolicyStep:
    """d/dtheta of sum_all_tokens(mask * l) / sum(mask) on the transformers model, in one batch, in `dtype`."""
    from dapo_megatron.algo.policy_loss import policy_loss

    model, logp_all = hf_response_logprobs(hf_dir, samples, dtype=dtype, forward_context=forward_context)
    per_token = lambda values: torch.cat([torch.as_tensor(v, dtype=dtype) for v in values])  # noqa: E731
    loss, _ = policy_loss(
        logp_all,
        per_token(s.old_logprobs for s in samples),
        per_token([s.advantage] * len(s.response_ids) for s in samples),
        per_token(s.response_mask() for s in samples),
        eps_low=eps_low,
        eps_high=eps_high,
        clip_ratio_c=clip_ratio_c,
    )
    return policy_step_of(model, logp_all, loss)


@dataclass
class StepBounds:
    """The float64 truth of one train step and how far fp32 rounding may put a layout from it."""

    exact: PolicyStep
    loss_bound: float
    grad_bounds: dict[str, float]  # per tensor
    grad_norm: float
    grad_norm_bound: float

    def check_loss(self, got: float, label: str = "") -> float:
        err = abs(got - self.exact.loss)
        assert err <= self.loss_bound, (
            f"{label} loss {got!r} is {err:.3e} from the float64 value "
            f"{self.exact.loss!r}; fp32 rounding allows {self.loss_bound:.3e}"
        )
        return err / self.loss_bound

    def check_grad_norm(self, got: float, label: str = "") -> float:
        err = abs(got - self.grad_norm)
        assert err <= self.grad_norm_bound, (
            f"{label} grad_norm {got!r} is {err:.3e} from the float64 value "
            f"{self.grad_norm!r}; fp32 rounding allows {self.grad_norm_bound:.3e}"
        )
        return err / self.grad_norm_bound

    def check_grads(self, got: dict[str, torch.Tensor], label: str = "") -> float:
        assert set(got) == set(self.exact.grads)
        worst = 0.0
        for name, g in self.exact.grads.items():
            err = float((got[name].double() - g).abs().max())
            assert err <= self.grad_bounds[name], (
                f"{label} gradient {name} is {err:.3e} from the float64 "
                f"gradient; fp32 rounding allows {self.grad_bounds[name]:.3e}"
            )
            worst = max(worst, err / self.grad_bounds[name])
        return worst


def step_bounds(fp32: PolicyStep, exact: PolicyStep) -> StepBounds:
    logprob_err = float((fp32.logprobs - exact.logprobs).abs().max())
    # first-order propagation of the worst per-token error into the loss, plus the mean's own rounding
    loss_bound = SAFETY * (float(exact.dloss_dlogprobs.abs().sum()) * logprob_err + U32 * abs(exact.loss))
    grad_bounds = {
        name: SAFETY * float((fp32.grads[name] - g).abs().max()) + U32 * float(g.abs().max())
        for name, g in exact.grads.items()
    }
    flat = torch.cat([g.flatten() for g in exact.grads.values()])
    flat32 = torch.cat([fp32.grads[name].flatten() for name in exact.grads])
    norm = float(flat.norm())
    return StepBounds(exact, loss_bound, grad_bounds, norm, SAFETY * float((flat32 - flat).norm()) + U32 * norm)


def reference_step(hf_dir, samples, **step_args) -> StepBounds:
    """The float64 step and the fp32 bounds around it (the transformers model run in both precisions)."""
    return step_bounds(
        hf_policy_step(hf_dir, samples, dtype=torch.float32, **step_args),
        hf_policy_step(hf_dir, samples, dtype=torch.float64, **step_args),
    )


def adam_first_step(
    weights: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    grad_clip: float,
) -> dict[str, torch.Tensor]:
    """Megatron's first update in float64: clip by the global norm, then AdamW step 1 (bias-corrected
    m = g, v = g^2: w <- w (1 - lr wd) - lr g / (|g| + eps)); weight decay only on matrices (megatron
    gives biases and norms wd_mult 0)."""
    norm = float(torch.cat([g.flatten() for g in grads.values()]).norm())
    clip = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
    out = {}
    for name, w in weights.items():
        g = grads[name] * clip
        wd = weight_decay if w.dim() > 1 else 0.0
        out[name] = w.double() * (1 - lr * wd) - lr * g / (g.abs() + eps)
    return out


def adam_weight_bounds(
    bounds: StepBounds, weights: dict[str, torch.Tensor], *, lr: float, eps: float, grad_clip: float
) -> dict[str, torch.Tensor]:
    """Per-entry bound on an fp32 layout's updated weights around adam_first_step's: the gradient's
    bound times the update's slope lr * eps / (|g| + eps)^2 (at most lr / eps), including the clip
    factor's own error, plus the rounding of the update's own fp32 arithmetic (worst case, not measured:
    the observed weight errors, 3e-8 at |w| = 0.28, are these roundings)."""
    clip = min(1.0, grad_clip / (bounds.grad_norm + 1e-6)) if grad_clip > 0 else 1.0
    clip_err = clip * bounds.grad_norm_bound / bounds.grad_norm if clip < 1 else 0.0
    out = {}
    for name, w in weights.items():
        g = bounds.exact.grads[name] * clip
        dg = clip * bounds.grad_bounds[name] + g.abs() * clip_err / max(clip, 1e-30)
        # the fp32 arithmetic of the update itself rounds w, the step and w' (a few roundings each)
        step = lr * g.abs() / (g.abs() + eps)
        out[name] = lr * eps / (g.abs() + eps) ** 2 * dg + 4 * U32 * (w.double().abs() + step)
    return out


def check_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: dict[str, torch.Tensor], label: str = ""
) -> float:
    """Every entry within its bound; returns the worst ratio error / bound."""
    assert set(got) == set(want)
    worst = 0.0
    for name, w in want.items():
        err = (got[name].double() - w).abs()
        ratio = float((err / bound[name]).max())
        assert ratio <= 1.0, (
            f"{label} weight {name} is {float(err.max()):.3e} from the float64 update "
            f"(worst entry {ratio:.2f}x its fp32 bound)"
        )
        worst = max(worst, ratio)
    return worst


def logprob_bound(fp32_logprobs, exact_logprobs) -> float:
    """SAFETY times the worst per-token error of the fp32 transformers log-probs against float64."""
    return SAFETY * max(float((a.double() - b).abs().max()) for a, b in zip(fp32_logprobs, exact_logprobs))


@dataclass
class TokenBounds:
    """Per-token float64 log-probs and entropies of a batch (one tensor per sample) and the fp32 bounds."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor]
    logprob_bound: float
    entropy_bound: float

    def check(self, logprobs, entropies, label: str = "") -> float:
        """Every token within its bound; returns the worst ratio error / bound."""
        lp_err = max(float((a.double() - b).abs().max()) for a, b in zip(logprobs, self.logprobs))
        ent_err = max(float((a.double() - b).abs().max()) for a, b in zip(entropies, self.entropies))
        assert lp_err <= self.logprob_bound, (
            f"{label} log-probs {lp_err:.3e} from float64; fp32 rounding allows {self.logprob_bound:.3e}"
        )
        assert ent_err <= self.entropy_bound, (
            f"{label} entropies {ent_err:.3e} from float64; fp32 rounding allows {self.entropy_bound:.3e}"
        )
        return max(lp_err / self.logprob_bound, ent_err / self.entropy_bound)


def hf_token_logprobs(hf_dir, samples, *, dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample log-probs of the response tokens and entropies, the whole computation in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, experts_implementation="eager").eval()
    logps, ents = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids).logits[0], -1)[len(s.prompt_ids) - 1 : -1]
            logps.append(logp.gather(1, ids[0, len(s.prompt_ids) :, None])[:, 0].double())
            ents.append(-(logp.exp() * logp).sum(-1).double())
    return logps, ents


def token_bounds(hf_dir, samples) -> TokenBounds:
    lp32, ent32 = hf_token_logprobs(hf_dir, samples, dtype=torch.float32)
    lp64, ent64 = hf_token_logprobs(hf_dir, samples, dtype=torch.float64)
    return TokenBounds(lp64, ent64, logprob_bound(lp32, lp64), logprob_bound(ent32, ent64))


def min_distance_to_clip_edges(exact: PolicyStep, samples, *, eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0) -> float:
    """How far (relative) the float64 ratios of the batch are from the edges where a token changes clip
    branch: when every ratio is further than fp32 rounding can move it, the clip counts of every fp32
    layout are exact on every CPU."""
    old = torch.cat([torch.tensor(s.old_logprobs, dtype=torch.float64) for s in samples])
    ratio = torch.exp(exact.logprobs - old)
    edges = torch.tensor([1 - eps_low, 1 + eps_high, clip_ratio_c], dtype=torch.float64)
    return float(((ratio[:, None] - edges) / edges).abs().min())
