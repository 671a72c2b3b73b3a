"""`dapo-megatron check-parity`: do Megatron (this TP x PP x CP layout) and transformers agree on the
per-token log-probs of a HF checkpoint? Run it before a long job on a new model.

    torchrun --nproc-per-node 2 -m dapo_megatron.cli check-parity --model /ckpt/Qwen2.5-7B --tp 2 --pp 1
    torchrun --nproc-per-node 4 -m dapo_megatron.cli check-parity --model DIR --tp 2 --pp 2 --seqs 4 --seq-len 64
    torchrun --nproc-per-node 4 -m dapo_megatron.cli check-parity --model DIR --tp 2 --cp 2

It loads the checkpoint into Megatron (weights/load.py), computes the log-prob of every next token
of K random sequences twice (one unpacked [K, L] micro-batch and one packed row of all K sequences
with lengths L, L-2, ...) through the pipeline schedule, and compares them on the driver with
transformers' AutoModelForCausalLM. The last printed line is `max_abs_logprob_diff=<x>`; the exit
status is 1 when x > --tolerance (default 1e-5). Measured on the tiny random Qwen2 of the tests
(4 x 48 tokens, fp32, CPU): 1.9e-6 at TP=1 / PP=2, 5.7e-6 to 1.0e-5 at TP=2 — of which up to 8e-6 is
transformers' own fp32 rounding (vs a float64 transformers: --reference-dtype fp64).

With --cp > 1 every sequence is padded to a multiple of 2*cp and cut into 2*cp chunks (rank r holds
chunks r and 2*cp-1-r, context_parallel.py), so the check covers the CP split, the RoPE position of
every chunk and attention across CP ranks. Measured (3 sequences of 13/11/9 tokens, all padded,
fp32, CPU): 5.7e-6 at CP=2, CP=2 x PP=2 and CP=4; 4.3e-6 at TP=2 x CP=2.

`vocab_parallel_logprobs` and `megatron_logprobs` are reusable pieces for the actor.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over the full vocabulary, from vocab-parallel logits.

    logits [..., V_pad/tp] is this TP rank's slice of the padded vocabulary; rows >= vocab_size
    are Megatron's padding and are excluded (set to -inf) so they take no probability mass.
    Returns fp32 [...], identical on all TP ranks, differentiable (megatron's
    vocab_parallel_cross_entropy: max and sum-exp all-reduced over TP).
    """
    from megatron.core import parallel_state, tensor_parallel

    logits = logits.float() / temperature  # a new tensor: megatron's CE edits its input in place
    v_local = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    padding = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
    if bool(padding.any()):
        logits = logits.masked_fill(padding, float("-inf"))
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)


def megatron_logprobs(model_chunks: Sequence[Any], micro_batches: Sequence[dict], *, vocab_size: int,
                      temperature: float = 1.0) -> Optional[list[torch.Tensor]]:
    """Per-token log-probs of each micro-batch through Megatron's pipeline schedule (forward only).

    Each micro-batch is a dict with input_ids and labels ([B, S], or [1, T] packed), position_ids,
    and optional packed_seq_params (see actor/model.py for the packed interface); labels[b, s] is
    the token whose log-prob is wanted at position s. Returns, on last-pipeline-stage ranks, one
    fp32 tensor shaped like labels per micro-batch; None on the other stages.

    With context parallelism the micro-batches are the FULL ones: each rank takes its chunks of
    every packed segment (of the row for [B, S]; lengths must be multiples of 2*cp) and the
    log-probs are all-gathered back over the CP group only.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dapo_megatron.actor.context_parallel import merge_from_cp, split_for_cp

    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()

    def local(batch, key):
        return split_for_cp(batch[key], _cp_bounds(batch), cp_size=cp_size, cp_rank=cp_rank, dim=1)

    chunks = list(model_chunks)
    batches = list(micro_batches)
    for chunk in chunks:
        chunk.eval()

    def loss_func(labels, output_tensor):
        # output_tensor: logits [B, S, V_pad/tp] (vocab-parallel)
        logprobs = vocab_parallel_logprobs(output_tensor, labels, vocab_size=vocab_size, temperature=temperature)
        return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(local(batch, "input_ids"), local(batch, "position_ids"), None,
                       packed_seq_params=batch.get("packed_seq_params"))
        return output, functools.partial(loss_func, local(batch, "labels"))

    vpp = len(chunks)
    iterators = [iter(batches) for _ in range(vpp)] if vpp > 1 else iter(batches)
    seq_length = max(b["input_ids"].size(1) for b in batches)
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=chunks if vpp > 1 else chunks[0],
            num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=batches[0]["input_ids"].size(0),
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logprobs = [r["logprobs"] for r in results]
    if cp_size == 1:
        return logprobs
    merged = []
    for batch, mine in zip(batches, logprobs):
        parts = [torch.empty_like(mine) for _ in range(cp_size)]
        dist.all_gather(parts, mine.contiguous(), group=parallel_state.get_context_parallel_group())
        merged.append(merge_from_cp(parts, _cp_bounds(batch), dim=1))
    return merged


def _cp_bounds(batch: dict) -> list[int]:
    """Segment boundaries the CP split cuts by: the packed row's (padded) sequences, or the whole
    row of an unpacked batch (megatron's get_batch_on_this_cp_rank)."""
    packed = batch.get("packed_seq_params")
    if packed is None:
        return [0, int(batch["input_ids"].size(1))]
    bounds = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    return [int(x) for x in bounds]


# --- the CLI --------------------------------------------------------------------------------------

def _parity_batches(*, num_seqs: int, seq_len: int, vocab_size: int, seed: int, device: Any,
                    seq_multiple: int = 1, row_multiple: int = 1) -> tuple[torch.Tensor, list[int], list[dict]]:
    """K random sequences [K, L] (same on every rank), as one unpacked and one packed micro-batch.

    seq_multiple: each packed sequence is padded to a multiple of it (2*cp with context
    parallelism); row_multiple: the unpacked row and the packed total are padded to a multiple of
    it (2*cp, times tp with sequence parallelism). Padding follows the real tokens of its segment
    (the packed total gets a padding segment), so causal attention keeps it out of every real
    token's context; `_comparable` reads only real positions. Both 1: no padding at all."""
    from dapo_megatron.actor.model import packed_position_ids, packed_seq_params_from_lengths
    from dapo_megatron.actor.packing import round_up

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_seqs, seq_len), generator=gen)
    # distinct lengths exercise the mask; steps of 2 keep the packed total even for an even seq_len
    # (sequence parallel at tp=2 splits the packed row in two)
    lengths = [max(2, seq_len - 2 * i) for i in range(num_seqs)]
    labels = torch.roll(tokens, -1, dims=1)
    row = round_up(seq_len, row_multiple)
    pad = row - seq_len
    unpacked = dict(input_ids=F.pad(tokens, (0, pad)).to(device), labels=F.pad(labels, (0, pad)).to(device),
                    position_ids=torch.arange(row).expand(num_seqs, -1).to(device))
    segments = [round_up(n, seq_multiple) for n in lengths]
    tail = round_up(sum(segments), row_multiple) - sum(segments)
    segments += [tail] if tail else []
    ids, targets = [], []
    for i, n in enumerate(lengths):
        ids.append(F.pad(tokens[i, :n], (0, segments[i] - n)))
        targets.append(F.pad(torch.roll(tokens[i, :n], -1), (0, segments[i] - n)))
    ids.append(torch.zeros(tail, dtype=tokens.dtype))
    targets.append(torch.zeros(tail, dtype=tokens.dtype))
    packed = dict(input_ids=torch.cat(ids).unsqueeze(0).to(device), labels=torch.cat(targets).unsqueeze(0).to(device),
                  position_ids=packed_position_ids(segments, device=device),
                  packed_seq_params=packed_seq_params_from_lengths(segments, device=device))
    return tokens, lengths, [unpacked, packed]


def hf_logprobs(hf_model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """[K, L-1] log-probs of tokens[:, 1:] under a transformers causal LM (fp32, or fp64 for an
    fp64 model)."""
    with torch.no_grad():
        logits = hf_model(input_ids=tokens).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _comparable(megatron_out: list[torch.Tensor], lengths: list[int], *, seq_multiple: int = 1) -> torch.Tensor:
    """Stack the unpacked [K, L-1] and the packed per-sequence log-probs into one [2, K, L-1]
    tensor (positions past a packed sequence's end are NaN and skipped; L = lengths[0], padding
    of _parity_batches dropped)."""
    from dapo_megatron.actor.packing import round_up

    unpacked, packed = megatron_out
    k, length = unpacked.size(0), lengths[0]
    out = torch.full((2, k, length - 1), float("nan"), dtype=torch.float32, device=unpacked.device)
    out[0] = unpacked[:, :length - 1]
    start = 0
    for i, n in enumerate(lengths):
        out[1, i, : n - 1] = packed[0, start:start + n - 1]
        start += round_up(n, seq_multiple)
    return out


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dapo-megatron check-parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (sequences padded to 2*cp)")
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--seqs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--attention-backend", choices=["torch", "te"], default="torch")
    parser.add_argument("--reference-dtype", choices=["same", "fp64"], default="same",
                        help="transformers' dtype: that of --precision, or float64 (then the diff is "
                             "Megatron's own rounding, without transformers' fp32 rounding on top)")
    args = parser.parse_args(list(argv))
    if args.seq_len < 2 or args.seqs < 1:
        raise ValueError(f"--seq-len must be >= 2 and --seqs >= 1 (got {args.seq_len}, {args.seqs})")
    for name in ("tp", "pp", "cp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    return args


def main(argv: Sequence[str]) -> int:
    """Entry point of `dapo-megatron check-parity` (see the module docstring)."""
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import init_distributed, model_parallel
    from dapo_megatron.weights.load import load_hf_into_model

    args = _parse(argv)
    init_distributed()
    hf_config = AutoConfig.from_pretrained(args.model)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    seq_multiple = 2 * args.cp if args.cp > 1 else 1
    with model_parallel(tp=args.tp, pp=args.pp, cp=args.cp, vpp=args.vpp, seed=args.seed):
        chunks = build_model_chunks(hf_config, attention_backend=args.attention_backend, precision=args.precision)
        load_hf_into_model(chunks, args.model, hf_config=hf_config)
        tokens, lengths, batches = _parity_batches(num_seqs=args.seqs, seq_len=args.seq_len,
                                                   vocab_size=hf_config.vocab_size, seed=args.seed, device=device,
                                                   seq_multiple=seq_multiple, row_multiple=seq_multiple)
        out = megatron_logprobs(chunks, batches, vocab_size=hf_config.vocab_size)
        # last stage -> driver (global rank 0 is PP stage 0 of its own PP group)
        result = _comparable(out, lengths, seq_multiple=seq_multiple) if out is not None else torch.empty(
            2, args.seqs, args.seq_len - 1, dtype=torch.float32, device=device)
        if args.pp > 1:
            pp_group = parallel_state.get_pipeline_model_parallel_group()
            last = dist.get_process_group_ranks(pp_group)[-1]
            dist.broadcast(result, src=last, group=pp_group)
        verdict = torch.zeros(1, dtype=torch.float64, device=device)
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
            if args.reference_dtype == "fp64":
                dtype = torch.float64
            hf_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
            reference = hf_logprobs(hf_model, tokens.to(device)).double()
            diff = (result.double() - reference.unsqueeze(0)).abs()
            verdict[0] = diff[~torch.isnan(diff)].max()
            print(f"check-parity: {args.model} tp={args.tp} pp={args.pp} cp={args.cp} vpp={args.vpp} "
                  f"precision={args.precision} "
                  f"seqs={args.seqs} seq_len={args.seq_len}: unpacked max |diff| {diff[0].max().item():.3e}, "
                  f"packed max |diff| {diff[1][~torch.isnan(diff[1])].max().item():.3e}")
        dist.broadcast(verdict, src=0)
    max_diff = verdict.item()
    if dist.get_rank() == 0:
        print(f"max_abs_logprob_diff={max_diff:.3e}", flush=True)
    dist.destroy_process_group()
    return 0 if max_diff <= args.tolerance else 1
