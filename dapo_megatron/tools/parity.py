"""`dapo-megatron check-parity`: do Megatron (this TP x PP x CP layout) and transformers agree on the
per-token log-probs of a HF checkpoint? Run it before a long job on a new model.

It loads the checkpoint into Megatron (weights/load.py), computes the log-prob of every next token
of K random sequences twice (one unpacked [K, L] micro-batch and one packed row of all K sequences
with lengths L, L-2, ...) through the pipeline schedule, and compares them on the driver with
transformers' AutoModelForCausalLM. The last printed line is `max_abs_logprob_diff=<x>`; the exit
status is 1 when x > --tolerance (default 1e-5). Measured on the tiny random Qwen2 of the tests
(4 x 48 tokens, fp32, CPU): 1.9e-6 at TP=1 / PP=2, 5.7e-6 to 1.0e-5 at TP=2 — of which up to 8e-6 is
transformers' own fp32 rounding. So without CUDA (small models) transformers runs in float64 by
default (--reference-dtype auto), and the diff is Megatron's own error; on GPUs it runs in the
dtype of --precision (a float64 copy of a large model would not fit).
Tiny random Qwen3 / Qwen3-MoE (4 x 12 tokens, fp32, CPU; tests/distributed/test_moe_parity.py):
within 1e-5 at TP=1, EP=2, TP=2 and PP=2. With --ep the data-parallel ranks hold different experts
and run the same sequences (the alltoall dispatcher moves each token to its experts' ranks and back).

With --cp > 1 every sequence is padded to a multiple of 2*cp and cut into 2*cp chunks (rank r holds
chunks r and 2*cp-1-r, context_parallel.py), so the check covers the CP split, the RoPE position of
every chunk and attention across CP ranks. Measured (3 sequences of 13/11/9 tokens, all padded,
fp32, CPU): 5.7e-6 at CP=2, CP=2 x PP=2 and CP=4; 4.3e-6 at TP=2 x CP=2.

--fused-logprob scores through the actor's own LM head instead of Megatron's logits: the model
returns hidden states (lm_head.return_hidden_states), sequence-parallel slices are gathered
(lm_head.full_sequence_hidden) and dapo_kernels.linear_logprob_entropy computes the vocab-parallel
log-prob AND entropy, with Megatron's vocab padding excluded (vocab_size). Both are compared with
transformers (entropy too must be within --tolerance), and the fused head with the plain-torch head
on the same hidden states: values within --tolerance, gradients (d/dhidden, d/dweight through
log-prob and entropy; max |diff| relative to the largest entry) within --grad-tolerance. On CPU the
kernels run in the Triton interpreter: this command sets TRITON_INTERPRET=1 itself when triton is
not yet imported.

Against float64 transformers with --precision fp32, the limit is max(--tolerance, 2 x transformers'
own fp32 error on the same tokens), both printed: a model with large activations cannot be computed
to 1e-5 in fp32 by any implementation (a random hidden-128 Qwen2 with vocab 32001: transformers in
fp32 is off its float64 self by 3.3e-5, Megatron by 3.4e-5), while a mapping bug is off by 1e-2+.

`vocab_parallel_logprobs`, `megatron_logprobs` and `head_logprobs` are reusable pieces.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dapo_megatron.actor.context_parallel import merge_from_cp, split_for_cp
from dapo_megatron.actor.lm_head import (
    full_sequence_hidden,
    output_weight,
    return_hidden_states,
    token_logprobs_entropy,
)
from dapo_megatron.actor.model import build_model_chunks, packed_position_ids, packed_seq_params_from_lengths
from dapo_megatron.actor.packing import round_up
from dapo_megatron.actor.parallel import init_distributed, model_parallel
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.tools.parity_args import parse
from dapo_megatron.weights.load import load_hf_into_model

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig, PreTrainedModel


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_rank: int, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over the full vocabulary, from vocab-parallel logits.

    logits [..., V_pad/tp] is TP rank tp_rank's slice of the padded vocabulary; rows >= vocab_size
    are Megatron's padding and are excluded (set to -inf) so they take no probability mass.
    Returns fp32 [...], identical on all TP ranks, differentiable (megatron's
    vocab_parallel_cross_entropy: max and sum-exp all-reduced over TP).
    """
    from megatron.core import tensor_parallel

    logits = logits.float() / temperature  # a new tensor: megatron's CE edits its input in place
    v_local = logits.size(-1)
    start = tp_rank * v_local
    padding = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
    if bool(padding.any()):
        logits = logits.masked_fill(padding, float("-inf"))
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)


def megatron_logprobs(
    model_chunks: Sequence[GPTModel],
    micro_batches: Sequence[dict],
    *,
    layout: ParallelLayout,
    vocab_size: int,
    temperature: float = 1.0,
) -> list[torch.Tensor] | None:
    """Per-token log-probs of each micro-batch through Megatron's pipeline schedule (forward only).

    Each micro-batch is a dict with input_ids and labels ([B, S], or [1, T] packed), position_ids,
    and optional packed_seq_params (see actor/model.py for the packed interface); labels[b, s] is
    the token whose log-prob is wanted at position s. Returns, on last-pipeline-stage ranks, one
    fp32 tensor shaped like labels per micro-batch; None on the other stages.

    With context parallelism the micro-batches are the FULL ones: each rank takes its chunks of
    every packed segment (of the row for [B, S]; lengths must be multiples of 2*cp) and the
    log-probs are all-gathered back over the CP group only.
    """
    chunks = list(model_chunks)
    batches = list(micro_batches)
    for chunk in chunks:
        chunk.eval()

    def loss_func(labels, output_tensor):
        # output_tensor: logits [B, S, V_pad/tp] (vocab-parallel)
        logprobs = vocab_parallel_logprobs(
            output_tensor, labels, vocab_size=vocab_size, tp_rank=layout.tp_rank, temperature=temperature
        )
        return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}

    results = _forward_only(
        chunks, batches, layout=layout, loss_for=lambda labels, model: functools.partial(loss_func, labels)
    )
    if not layout.is_last_stage:
        return None
    return [_gathered_over_cp(r["logprobs"], batch, layout) for batch, r in zip(batches, results)]


def _forward_only(chunks: list[GPTModel], batches: list[dict], *, layout: ParallelLayout, loss_for) -> list:
    """megatron's pipeline schedule, forward only, over the micro-batches: each CP rank feeds its chunks of
    every segment (_cp_bounds); loss_for(labels, model) is one micro-batch's loss function (its local labels).
    Returns the loss functions' outputs, on the last pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def local(batch, key):
        return split_for_cp(batch[key], _cp_bounds(batch), cp_size=layout.cp_size, cp_rank=layout.cp_rank, dim=1)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(
            local(batch, "input_ids"),
            local(batch, "position_ids"),
            None,
            packed_seq_params=batch.get("packed_seq_params"),
        )
        return output, loss_for(local(batch, "labels"), model)

    vpp = len(chunks)
    iterators = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=max(b["input_ids"].size(1) for b in batches),
            micro_batch_size=batches[0]["input_ids"].size(0),
            forward_only=True,
        )


def _gathered_over_cp(mine: torch.Tensor, batch: dict, layout: ParallelLayout) -> torch.Tensor:
    """This CP rank's [B, S/cp] values of a micro-batch -> the whole [B, S] (all-gather over the CP group
    only); identity without CP."""
    if layout.cp_size == 1:
        return mine
    parts = [torch.empty_like(mine) for _ in range(layout.cp_size)]
    coll.all_gather(parts, mine.contiguous(), group=layout.cp_group)
    return merge_from_cp(parts, _cp_bounds(batch), dim=1)


def _cp_bounds(batch: dict) -> list[int]:
    """Segment boundaries the CP split cuts by: the packed row's (padded) sequences, or the whole
    row of an unpacked batch (megatron's get_batch_on_this_cp_rank)."""
    packed = batch.get("packed_seq_params")
    if packed is None:
        return [0, int(batch["input_ids"].size(1))]
    bounds = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    return [int(x) for x in bounds]


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _head_grad_rel_diff(hidden_NH, weight, targets, *, tp_group, vocab_size: int, seed: int):
    """Fused and plain-torch heads on the same (detached) hidden states and LM-head weight, with the
    same random cotangents for log-prob and entropy: (fused logprob, fused entropy, reference
    logprob, reference entropy, max over d/dhidden and d/dweight of max|fused - ref| / max|ref|,
    the max taken over the TP group: every rank holds its own weight shard)."""
    gen = torch.Generator().manual_seed(seed)  # the same cotangents on every TP rank
    g_lp = torch.randn(hidden_NH.shape[0], generator=gen).to(hidden_NH.device)
    g_ent = torch.randn(hidden_NH.shape[0], generator=gen).to(hidden_NH.device)
    runs = []
    for fused in (True, False):
        hidden = hidden_NH.detach().requires_grad_()
        weight_leaf = weight.detach().requires_grad_()  # a new leaf over the same storage: no copy
        with torch.enable_grad():
            logprob, entropy = token_logprobs_entropy(
                hidden, weight_leaf, targets, temperature=1.0, tp_group=tp_group, vocab_size=vocab_size, fused=fused
            )
            ((logprob * g_lp).sum() + (entropy * g_ent).sum()).backward()
        runs.append((logprob.detach(), entropy.detach(), hidden.grad, weight_leaf.grad))
    (lp_f, ent_f, gh_f, gw_f), (lp_r, ent_r, gh_r, gw_r) = runs
    rel = torch.zeros(1, dtype=torch.float64, device=hidden_NH.device)
    for got, want in ((gh_f, gh_r), (gw_f, gw_r)):
        scale = want.double().abs().max().clamp(min=torch.finfo(torch.float32).tiny)
        rel = torch.maximum(rel, (got.double() - want.double()).abs().max() / scale)
    coll.all_reduce(rel, op=dist.ReduceOp.MAX, group=tp_group)
    return lp_f, ent_f, lp_r, ent_r, rel


def head_logprobs(
    model_chunks: Sequence[GPTModel],
    micro_batches: Sequence[dict],
    *,
    layout: ParallelLayout,
    vocab_size: int,
    sequence_parallel: bool,
    seed: int = 0,
) -> list[dict] | None:
    """check-parity --fused-logprob: the actor's LM head (fused Triton op) over the pipeline schedule.

    Patches the chunks to return hidden states (lm_head.return_hidden_states). Returns, on
    last-pipeline-stage ranks, per micro-batch {"logprobs", "entropies"} (fused, shaped like labels),
    {"ref_logprobs", "ref_entropies"} (the plain-torch head on the same hidden states) and
    "grad_rel_diff" (see _head_grad_rel_diff, max over the TP and CP groups); None on the other
    stages. Context parallelism as in megatron_logprobs: each CP rank scores its chunks, merged here.
    """
    chunks = list(model_chunks)
    for chunk in chunks:
        chunk.eval()
        return_hidden_states(_unwrap(chunk))
    tp_group = layout.tp_group
    step = iter(range(len(micro_batches)))

    def loss_func(labels, gpt, output_tensor):
        hidden_BSH = full_sequence_hidden(output_tensor, sequence_parallel=sequence_parallel, tp_group=tp_group)
        b, s, h = hidden_BSH.shape
        lp, ent, lp_ref, ent_ref, rel = _head_grad_rel_diff(
            hidden_BSH.reshape(b * s, h),
            output_weight(gpt),
            labels.reshape(-1),
            tp_group=tp_group,
            vocab_size=vocab_size,
            seed=seed + next(step),
        )
        if layout.cp_size > 1:
            coll.all_reduce(rel, op=dist.ReduceOp.MAX, group=layout.cp_group)
        out = {"logprobs": lp, "entropies": ent, "ref_logprobs": lp_ref, "ref_entropies": ent_ref}
        return lp.sum() * 0.0, {**{k: v.view(b, s) for k, v in out.items()}, "grad_rel_diff": rel}

    batches = list(micro_batches)
    results = _forward_only(
        chunks,
        batches,
        layout=layout,
        loss_for=lambda labels, model: functools.partial(loss_func, labels, _unwrap(model)),
    )
    if not layout.is_last_stage:
        return None
    if layout.cp_size == 1:
        return list(results)
    keys = ("logprobs", "entropies", "ref_logprobs", "ref_entropies")
    return [
        {"grad_rel_diff": mine["grad_rel_diff"], **{k: _gathered_over_cp(mine[k], batch, layout) for k in keys}}
        for batch, mine in zip(batches, results)
    ]


# --- the CLI --------------------------------------------------------------------------------------


def _parity_batches(
    *,
    num_seqs: int,
    seq_len: int,
    vocab_size: int,
    seed: int,
    device: torch.device | str,
    seq_multiple: int = 1,
    row_multiple: int = 1,
) -> tuple[torch.Tensor, list[int], list[dict]]:
    """K random sequences [K, L] (same on every rank), as one unpacked and one packed micro-batch.

    seq_multiple: each packed sequence is padded to a multiple of it (2*cp with context
    parallelism); row_multiple: the unpacked row and the packed total are padded to a multiple of
    it (2*cp, times tp with sequence parallelism). Padding follows the real tokens of its segment
    (the packed total gets a padding segment), so causal attention keeps it out of every real
    token's context; `_comparable` reads only real positions. Both 1: no padding at all."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_seqs, seq_len), generator=gen)
    # distinct lengths exercise the mask; steps of 2 keep the packed total even for an even seq_len
    # (sequence parallel at tp=2 splits the packed row in two)
    lengths = [max(2, seq_len - 2 * i) for i in range(num_seqs)]
    labels = torch.roll(tokens, -1, dims=1)
    row = round_up(seq_len, row_multiple)
    pad = row - seq_len
    unpacked = dict(
        input_ids=F.pad(tokens, (0, pad)).to(device),
        labels=F.pad(labels, (0, pad)).to(device),
        position_ids=torch.arange(row).expand(num_seqs, -1).to(device),
    )
    segments = [round_up(n, seq_multiple) for n in lengths]
    tail = round_up(sum(segments), row_multiple) - sum(segments)
    segments += [tail] if tail else []
    ids, targets = [], []
    for i, n in enumerate(lengths):
        ids.append(F.pad(tokens[i, :n], (0, segments[i] - n)))
        targets.append(F.pad(torch.roll(tokens[i, :n], -1), (0, segments[i] - n)))
    ids.append(torch.zeros(tail, dtype=tokens.dtype))
    targets.append(torch.zeros(tail, dtype=tokens.dtype))
    packed = dict(
        input_ids=torch.cat(ids).unsqueeze(0).to(device),
        labels=torch.cat(targets).unsqueeze(0).to(device),
        position_ids=packed_position_ids(segments, device=device),
        packed_seq_params=packed_seq_params_from_lengths(segments, device=device),
    )
    return tokens, lengths, [unpacked, packed]


def hf_logprobs(hf_model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """[K, L-1] log-probs of tokens[:, 1:] under a transformers causal LM (fp32, or fp64 for an
    fp64 model)."""
    return hf_logprobs_entropies(hf_model, tokens)[0]


def hf_logprobs_entropies(hf_model: PreTrainedModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([K, L-1] log-probs of tokens[:, 1:], [K, L-1] entropies of the predicting distributions)."""
    with torch.no_grad():
        logits = hf_model(input_ids=tokens).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), entropy


def _comparable(megatron_out: list[torch.Tensor], lengths: list[int], *, seq_multiple: int = 1) -> torch.Tensor:
    """Stack the unpacked [K, L-1] and the packed per-sequence log-probs into one [2, K, L-1]
    tensor (positions past a packed sequence's end are NaN and skipped; L = lengths[0], padding
    of _parity_batches dropped)."""
    unpacked, packed = megatron_out
    k, length = unpacked.size(0), lengths[0]
    out = torch.full((2, k, length - 1), float("nan"), dtype=torch.float32, device=unpacked.device)
    out[0] = unpacked[:, : length - 1]
    start = 0
    for i, n in enumerate(lengths):
        out[1, i, : n - 1] = packed[0, start : start + n - 1]
        start += round_up(n, seq_multiple)
    return out


def _check_model_fits_layout(hf_config: PretrainedConfig, *, tp: int, model: str) -> None:
    """Megatron shards attention heads and KV groups over TP: say so before megatron asserts."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if value % tp:
            raise ValueError(
                f"{model}/config.json {name}={value} is not divisible by --tp {tp} "
                "(Megatron splits heads and KV groups over tensor-parallel ranks)"
            )


def _use_triton_interpreter_on_cpu(args: argparse.Namespace) -> None:
    """--fused-logprob on a machine without CUDA: the kernels run in the Triton interpreter, which is
    chosen when triton is imported (its own jit helpers are decorated then), so set it first."""
    if not args.fused_logprob or torch.cuda.is_available():
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    if "triton" in sys.modules:
        raise ValueError(
            "--fused-logprob without CUDA runs the Triton interpreter, but triton was imported before "
            "TRITON_INTERPRET=1 could be set: export TRITON_INTERPRET=1 before starting"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    print(
        "check-parity: no CUDA: --fused-logprob runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)",
        flush=True,
    )


def _compared(lengths: list[int], seq_len: int) -> torch.Tensor:
    """[2, K, L-1] bool: the positions _comparable fills (every unpacked one; n-1 per packed sequence)."""
    mask = torch.zeros(2, len(lengths), seq_len - 1, dtype=torch.bool)
    mask[0] = True
    for i, n in enumerate(lengths):
        mask[1, i, : n - 1] = True
    return mask


def _max_abs(diff: torch.Tensor, compared: torch.Tensor) -> float:
    """max |diff| over the compared positions [2, K, L-1] (or one half of them); NaN if any is NaN."""
    values = diff[compared.to(diff.device)]
    if torch.isnan(values).any():
        return float("nan")
    return float(values.max()) if values.numel() else 0.0


NUMBER_KEYS = (
    "logprob",
    "entropy",
    "grad_rel",
    "fused_vs_torch_logprob",
    "fused_vs_torch_entropy",
    "max_abs_logprob",
    "fp32_floor_logprob",
    "fp32_floor_entropy",
)
# Megatron in fp32 may be off the exact (float64) function by up to this many times transformers'
# own fp32 forward: the two implement the same fp32 arithmetic in different orders.
FP32_FLOOR_FACTOR = 2.0


def _fill_megatron_results(
    args: argparse.Namespace,
    chunks: Sequence[GPTModel],
    batches: Sequence[dict],
    *,
    layout: ParallelLayout,
    vocab: int,
    comparable: Callable[[list[torch.Tensor]], torch.Tensor],
    compared: torch.Tensor,
    result: torch.Tensor,
    extra: torch.Tensor,
) -> None:
    """Megatron's side on this rank (the last pipeline stage holds it): its log-probs into result[0]; with
    --fused-logprob the fused head's log-probs and entropies, and extra = (grad_rel, fused-vs-torch
    log-prob and entropy differences)."""
    if args.fused_logprob:
        out = head_logprobs(
            chunks,
            batches,
            layout=layout,
            vocab_size=vocab,
            sequence_parallel=args.sequence_parallel,
            seed=args.seed,
        )
        if out is not None:
            for kind, key in enumerate(("logprobs", "entropies")):
                result[kind] = comparable([o[key] for o in out])
                ref = comparable([o[f"ref_{key}"] for o in out])
                extra[1 + kind] = _max_abs((result[kind].double() - ref.double()).abs(), compared)
            extra[0] = torch.cat([o["grad_rel_diff"] for o in out]).max()  # NaN propagates
    else:
        logprobs = megatron_logprobs(chunks, batches, layout=layout, vocab_size=vocab)
        if logprobs is not None:
            result[0] = comparable(logprobs)


def _verdict(
    args: argparse.Namespace,
    tokens: torch.Tensor,
    result: torch.Tensor,
    extra: torch.Tensor,
    *,
    compared: torch.Tensor,
    layout: ParallelLayout,
    device: torch.device,
) -> torch.Tensor:
    """NUMBER_KEYS's numbers on every rank: megatron's results brought from the last pipeline stage to
    global rank 0, compared there with transformers, the numbers broadcast back."""
    if args.pp > 1:  # last stage -> driver (global rank 0 is PP stage 0 of its own PP group)
        pp_group = layout.pp_group
        last = dist.get_process_group_ranks(pp_group)[-1]
        coll.broadcast(result, src=last, group=pp_group)
        coll.broadcast(extra, src=last, group=pp_group)
    verdict = torch.zeros(len(NUMBER_KEYS), dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        numbers = _compare_with_transformers(args, tokens.to(device), result, extra, compared=compared)
        verdict[:] = torch.tensor([numbers[k] for k in NUMBER_KEYS], dtype=torch.float64)
    coll.broadcast(verdict, src=0)
    return verdict


def run_check(argv: Sequence[str]) -> dict[str, float]:
    """The check itself, on every rank of an initialized process group (main() sets that up; tests
    call this on their rank pool). Returns the same numbers on every rank, keyed NUMBER_KEYS:
    logprob (max |diff| vs transformers); with --fused-logprob entropy (vs transformers), grad_rel
    (head gradients, fused vs torch) and fused_vs_torch_logprob / _entropy (same hidden states);
    max_abs_logprob (the scale); fp32_floor_* (transformers fp32 vs float64, when the reference is
    float64 and --precision fp32; else 0). failures() turns them into the verdict."""
    from transformers import AutoConfig

    args = parse(argv)
    hf_config = AutoConfig.from_pretrained(args.model)
    _check_model_fits_layout(hf_config, tp=args.tp, model=args.model)
    vocab = hf_config.vocab_size
    device = coll.compute_device()
    kinds = 2 if args.fused_logprob else 1  # log-prob (+ entropy)
    # CP: every sequence padded to a multiple of 2*cp; SP: rows (and the packed total) to a multiple of tp too
    seq_multiple = 2 * args.cp if args.cp > 1 else 1
    row_multiple = seq_multiple * (args.tp if args.sequence_parallel else 1)
    with model_parallel(
        tp=args.tp, pp=args.pp, cp=args.cp, vpp=args.vpp, ep=args.ep, etp=args.etp, seed=args.seed
    ) as layout:
        chunks = build_model_chunks(
            hf_config,
            attention_backend=args.attention_backend,
            precision=args.precision,
            sequence_parallel=args.sequence_parallel,
            vocab_divisible_by=args.vocab_divisible_by,
        )
        load_hf_into_model(chunks, args.model, layout=layout, hf_config=hf_config)
        tokens, lengths, batches = _parity_batches(
            num_seqs=args.seqs,
            seq_len=args.seq_len,
            vocab_size=vocab,
            seed=args.seed,
            device=device,
            seq_multiple=seq_multiple,
            row_multiple=row_multiple,
        )
        comparable = functools.partial(_comparable, lengths=lengths, seq_multiple=seq_multiple)
        compared = _compared(lengths, args.seq_len)
        result = torch.full((kinds, 2, args.seqs, args.seq_len - 1), float("nan"), dtype=torch.float32, device=device)
        extra = torch.zeros(3, dtype=torch.float64, device=device)  # grad_rel, fused-vs-torch logprob, entropy
        _fill_megatron_results(
            args,
            chunks,
            batches,
            layout=layout,
            vocab=vocab,
            comparable=comparable,
            compared=compared,
            result=result,
            extra=extra,
        )
        verdict = _verdict(args, tokens, result, extra, compared=compared, layout=layout, device=device)
    return dict(zip(NUMBER_KEYS, verdict.tolist()))


def _compare_with_transformers(
    args: argparse.Namespace, tokens: torch.Tensor, result: torch.Tensor, extra: torch.Tensor, *, compared: torch.Tensor
) -> dict[str, float]:
    """Driver side: transformers' log-probs (and entropies) of the same tokens; prints the table."""
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    if args.reference_dtype == "fp64" or (args.reference_dtype == "auto" and not torch.cuda.is_available()):
        dtype = torch.float64

    def transformers_values(model_dtype):
        # MoE experts: transformers' default grouped_mm kernel refuses float64; the eager loop is exact
        kwargs = {"experts_implementation": "eager"} if model_dtype == torch.float64 else {}
        hf_model = (
            AutoModelForCausalLM.from_pretrained(args.model, dtype=model_dtype, **kwargs).to(tokens.device).eval()
        )
        return torch.stack(hf_logprobs_entropies(hf_model, tokens)).double()  # [2, K, L-1]

    reference = transformers_values(dtype)
    diff = (result.double() - reference[: result.shape[0], None]).abs()  # [kinds, 2, K, L-1]
    layout = (
        f"tp={args.tp} pp={args.pp} cp={args.cp} vpp={args.vpp} ep={args.ep} etp={args.etp} "
        f"sp={args.sequence_parallel} precision={args.precision} "
        f"head={'fused' if args.fused_logprob else 'megatron-logits'} seqs={args.seqs} seq_len={args.seq_len} "
        f"reference={str(dtype).replace('torch.', '')}"
    )
    print(f"check-parity: {args.model} {layout}", flush=True)
    for kind, name in enumerate(("logprob", "entropy")[: result.shape[0]]):
        print(
            f"  {name:8s} max |diff| vs transformers: unpacked {_max_abs(diff[kind, 0], compared[0]):.3e}, "
            f"packed {_max_abs(diff[kind, 1], compared[1]):.3e}",
            flush=True,
        )
    floor = torch.zeros(2, dtype=torch.float64)
    if dtype == torch.float64 and args.precision == "fp32":
        # the fp32 noise floor of THIS model: a model with large activations cannot be computed to
        # 1e-5 in fp32 by anyone (a random hidden-128 Qwen2: transformers fp32 is off by 3.3e-5)
        own = (transformers_values(torch.float32) - reference).abs()
        floor = torch.tensor([_max_abs(own[kind], compared[0]) for kind in range(2)], dtype=torch.float64)
        print(
            f"  transformers' own fp32 rounding (fp32 vs float64): logprob {floor[0]:.3e}, entropy {floor[1]:.3e}; "
            f"limits max(--tolerance, {FP32_FLOOR_FACTOR:g} x that)",
            flush=True,
        )
    if args.fused_logprob:
        print(
            f"  fused vs plain-torch head (same hidden states): logprob {extra[1]:.3e}, entropy {extra[2]:.3e}, "
            f"max relative gradient diff {extra[0]:.3e}",
            flush=True,
        )
    return {
        "logprob": _max_abs(diff[0], compared),
        "entropy": _max_abs(diff[1], compared) if args.fused_logprob else 0.0,
        "grad_rel": float(extra[0]),
        "fused_vs_torch_logprob": float(extra[1]),
        "fused_vs_torch_entropy": float(extra[2]),
        "max_abs_logprob": _max_abs(reference[0, None].expand(2, -1, -1).abs(), compared),
        "fp32_floor_logprob": float(floor[0]),
        "fp32_floor_entropy": float(floor[1]),
    }


def failures(numbers: dict[str, float], *, tolerance: float, grad_tolerance: float) -> list[str]:
    """What exceeds its limit (empty: the check passed); a NaN fails too. Against transformers the
    limit is max(tolerance, FP32_FLOOR_FACTOR x transformers' own fp32 error) when that was measured
    (fp32_floor_*); the two heads on the same hidden states must agree within tolerance; entropy
    and the head numbers are 0 without --fused-logprob."""
    limits = (
        ("logprob", max(tolerance, FP32_FLOOR_FACTOR * numbers.get("fp32_floor_logprob", 0.0))),
        ("entropy", max(tolerance, FP32_FLOOR_FACTOR * numbers.get("fp32_floor_entropy", 0.0))),
        ("fused_vs_torch_logprob", tolerance),
        ("fused_vs_torch_entropy", tolerance),
        ("grad_rel", grad_tolerance),
    )
    return [f"{key} {numbers[key]:.3e} > {limit:.3g}" for key, limit in limits if not numbers.get(key, 0.0) <= limit]


def main(argv: Sequence[str]) -> int:
    """Entry point of `dapo-megatron check-parity` (see the module docstring)."""
    args = parse(argv)
    _use_triton_interpreter_on_cpu(args)
    init_distributed()
    rank = dist.get_rank()
    try:
        numbers = run_check(argv)
    finally:
        dist.destroy_process_group()
    failed = failures(numbers, tolerance=args.tolerance, grad_tolerance=args.grad_tolerance)
    if rank == 0:
        if args.fused_logprob:
            print(f"max_abs_entropy_diff={numbers['entropy']:.3e} max_rel_head_grad_diff={numbers['grad_rel']:.3e}")
        print(f"check-parity: FAILED: {', '.join(failed)}" if failed else "check-parity: passed", flush=True)
        print(f"max_abs_logprob_diff={numbers['logprob']:.3e}", flush=True)
    return 1 if failed else 0
