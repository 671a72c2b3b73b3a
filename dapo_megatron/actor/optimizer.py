"""Megatron optimizer (AdamW, distributed over DP when asked), lr warm-up and decay, and one guarded step.

    optimizer = build_optimizer(model_chunks, lr=1e-6, weight_decay=0.1, ...)
    schedule = build_lr_schedule(optimizer, lr=1e-6, warmup_steps=10)
    set_lr_for_step(schedule, step=3)                 # lr = 1e-6 * (3 + 1) / 10
    schedule = build_lr_schedule(optimizer, lr=1e-6, warmup_steps=10, decay_style="cosine", min_lr=1e-7,
                                 total_steps=400)     # after warm-up: cosine from 1e-6 to 1e-7 at step 400
    updated, grad_norm = guarded_step(optimizer, grad_clip=1.0, loss_is_finite=True)

Warm-up is counted in ROLLOUT steps, as in the DAPO paper ("linear warm-up over 20 rollout
steps"): every mini-batch update of rollout step s (0-based) uses lr * min(1, (s + 1) / W), so the
first step already trains (lr / W) and step W - 1 onwards uses the full lr; W = 0 means constant.
The schedule is megatron's OptimizerParamScheduler with init_lr 0, which also sets each parameter
group's weight decay (biases and norms get none: wd_mult 0). After the warm-up the lr stays constant
(the paper's setting) or, with decay_style linear / cosine, decays to min_lr at the last rollout
step (total_steps - 1): megatron's formula with lr_decay_steps = total_steps, where rollout step s
counts as num_steps = s + 1. A run no longer than its warm-up never decays.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


def build_optimizer(
    model_chunks: list,
    *,
    lr: float,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    grad_clip: float,
    precision: str,
    use_distributed_optimizer: bool,
    adam_eps: float = 1e-8,
):
    """megatron.core.optimizer.get_megatron_optimizer over DDP-wrapped chunks (AdamW, fp32 master
    weights for bf16/fp16 models). Clipping is done by `guarded_step`, which knows the grad norm."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=0.0,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=grad_clip,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision],
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_lr_schedule(
    optimizer,
    *,
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    decay_style: str = "constant",
    min_lr: float = 0.0,
    total_steps: int = 0,
):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if decay_style not in ("constant", "linear", "cosine"):
        raise ValueError(f"trainer.lr_decay_style={decay_style!r} is not allowed; choose constant, linear or cosine")
    if total_steps <= warmup_steps:  # a run that ends within its warm-up (a short test run) has nothing to decay
        decay_style = "constant"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr if decay_style != "constant" else 0.0,
        lr_warmup_steps=warmup_steps,
        # constant: unused, but megatron wants it past the warm-up
        lr_decay_steps=total_steps if decay_style != "constant" else warmup_steps + 1,
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def set_lr_for_step(schedule, *, step: int) -> float:
    """Set every group's lr (and weight decay) for rollout step `step` (0-based); returns the lr."""
    if step < 0:
        raise ValueError(f"rollout step must be >= 0, got {step}")
    schedule.num_steps = step + 1  # megatron's warm-up gives init + (max - init) * num_steps / W
    schedule.step(0)
    return schedule.get_lr({})


def guarded_step(optimizer, *, grad_clip: float, loss_is_finite: bool) -> tuple[bool, float]:
    """Clip and step unless the loss or the gradient norm is NaN/inf; returns (updated, grad_norm).

    Mirrors megatron's ChainedOptimizer.step (prepare grads -> global grad norm -> clip -> step) with
    one difference: a non-finite norm or loss skips the update (megatron only checks with an fp16
    loss scaler). The norm is the same on every rank (reduced over the grad-stats group), and
    `loss_is_finite` must be too (the caller all-reduces it), so all ranks skip together.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not loss_is_finite or not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return False, grad_norm
    if grad_clip > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=grad_clip,
                    total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
    return bool(optimizer.step_with_ready_grads()), grad_norm


def init_empty_optimizer_state(optimizer) -> None:
    """Zero Adam state at step 0 for every parameter that has none yet (before loading a checkpoint).

    megatron's DistributedOptimizer builds even its *loading* sharded state dict from the inner
    optimizer's state and, without apex / Transformer Engine (torch AdamW), asserts that every
    parameter has a 'step'; a fresh torch AdamW has no state until its first step. The values are
    overwritten by the checkpoint.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def adam_step(optimizer) -> int:
    """The inner Adam step counter (the same for every parameter; 0 before the first update)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if "step" in state:
                return int(state["step"])
    return 0


@contextlib.contextmanager
def torch_adam_step_kept(optimizer) -> Iterator[None]:
    """For the body, megatron's DistributedOptimizer sets a parameter's optimizer state from a
    checkpoint's tensors keeping torch AdamW's own 'step' entry.

    megatron 0.16.1's fully_reshardable load (_set_main_param_and_optimizer_states) copies every entry of
    the parameter's state from the loaded tensors, which hold only 'param', 'exp_avg' and 'exp_avg_sq':
    with torch AdamW (no apex / Transformer Engine, whose fused Adam keeps the step in the param groups)
    the state's 'step' entry raised KeyError. The step is restored from actor_state.json afterwards
    (set_adam_step)."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def set_states(model_param, tensors, _opt=opt, _original=original):
            current = _opt._get_main_param_and_optimizer_states(model_param)
            if "step" in current and "step" not in tensors:
                tensors = {**tensors, "step": current["step"]}
            _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # the class's method again


def set_adam_step(optimizer, step: int) -> None:
    """Restore the Adam step counter after loading a checkpoint. megatron 0.16.1's DistributedOptimizer
    (torch AdamW, no apex/TE) restores exp_avg / exp_avg_sq but leaves the per-parameter 'step' at
    its pre-load value, which changes the bias correction of the next update (measured: the resumed
    step's weights differed from an uninterrupted run while its loss was identical)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if "step" in state:
                state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)
