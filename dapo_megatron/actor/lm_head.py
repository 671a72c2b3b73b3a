"""Per-token log-probs and entropies on the LM head: the one place that picks the implementation.

    logprob_N, entropy_N = token_logprobs_entropy(hidden_NH, weight_VH, targets_N, temperature=1.0,
                                                  tp_group=tp_group, vocab_size=V, fused=True)

fused=True (actor.fused_logprob) is `dapo_kernels.linear_logprob_entropy` whatever the device: the
[N, V] logits are never materialized. The kernel itself runs compiled on CUDA tensors, or in the
Triton interpreter on CPU tensors when TRITON_INTERPRET=1 was set before dapo_kernels was imported;
`require_fused_kernels` says up front (at Actor construction) when neither holds, instead of a
silent fallback. fused=False is `linear_logprob_entropy_reference` (plain torch, same signature, the
same vocab-parallel reductions). Both return fp32 [N] tensors, differentiable in hidden and weight;
weight is this TP rank's vocab slice (rows [r*V_local, (r+1)*V_local)), targets are global token
ids, and rows at or past vocab_size (Megatron's vocab padding) take no probability.

Also here: how to get those hidden states out of megatron-core's GPTModel without computing the
logits (`return_hidden_states`), back to full sequences under sequence parallelism
(`full_sequence_hidden`), and which weight is the LM head (`output_weight`). The actor and
`check-parity --fused-logprob` both go through these functions.
"""

from __future__ import annotations

import types

import torch


def require_fused_kernels(key: str, *, device_type: str, value: str = "true", instead: str = "false") -> None:
    """ValueError naming the config key (set to `value`; `instead`: the setting that runs without the
    kernels) when the fused Triton kernels cannot run in this process."""
    try:
        from dapo_kernels._runtime import why_not_runnable
    except ImportError as err:  # triton missing
        raise ValueError(
            f"{key}={value} needs dapo_kernels' Triton kernels, which do not import here ({err}); "
            f"install triton or set {key}={instead} (plain torch)"
        ) from None
    reason = why_not_runnable(device_type)
    if reason is not None:
        raise ValueError(f"{key}={value} cannot run here: {reason}. Set {key}={instead} for the plain-torch path.")


def token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    tp_group,
    vocab_size: int | None = None,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob[N], entropy[N]) of softmax(hidden @ weight.T / temperature) at `targets`, fp32.
    fused=True: the Triton kernel (compiled, or interpreted on CPU); fused=False: plain torch."""
    hidden = hidden.to(weight.dtype)  # a Float16Module wrapper would hand the output back as fp32
    if fused:
        from dapo_kernels import linear_logprob_entropy as op
    else:
        from dapo_kernels import linear_logprob_entropy_reference as op
    return op(hidden, weight, targets, temperature=temperature, tp_group=tp_group, vocab_size=vocab_size)


def _return_input(self, input_, weight=None, runtime_gather_output=None):
    return input_, None


def return_hidden_states(gpt_model) -> None:
    """Make a GPTModel on the last pipeline stage return its final hidden states instead of logits.

    GPTModel._postprocess ends with `logits, _ = self.output_layer(hidden, weight=...)` and, without
    labels, returns `logits.transpose(0, 1)`. Replacing this instance's output_layer.forward by an
    identity makes the model return the post-final-norm hidden states [B, S, H] ([B, S/tp, H] with
    sequence parallelism: the layer's all-gather is skipped too). The layer keeps its parameters,
    names and sharded state dict, so checkpoints and the HF weight mapping are unchanged, and the
    LM-head matmul happens once, inside token_logprobs_entropy.
    """
    if getattr(gpt_model, "post_process", False):
        gpt_model.output_layer.forward = types.MethodType(_return_input, gpt_model.output_layer)


def output_weight(gpt_model) -> torch.Tensor:
    """The LM-head weight [V_local, H] of a last-stage chunk: the word embeddings when tied and this
    stage also holds them, megatron's synced copy in output_layer on a later stage, else output_layer."""
    if gpt_model.share_embeddings_and_output_weights:
        return gpt_model.shared_embedding_or_output_weight()
    return gpt_model.output_layer.weight


def full_sequence_hidden(output_BSH: torch.Tensor, *, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """[B, S, H] hidden states of every position from the output of a model patched by
    return_hidden_states: [B, S, H], or [B, S/tp, H] (this rank's sequence slice) under sequence
    parallelism, gathered here (see gather_sequence_parallel for the gradient)."""
    if not sequence_parallel:
        return output_BSH
    return gather_sequence_parallel(output_BSH.transpose(0, 1), tp_group=tp_group).transpose(0, 1)


def gather_sequence_parallel(hidden_SBH: torch.Tensor, *, tp_group) -> torch.Tensor:
    """All-gather sequence-parallel hidden states along the sequence for the vocab-parallel head.

    The backward only splits (tensor_parallel_output_grad=False): the head already all-reduces
    the hidden gradient over TP (every TP rank scores all N tokens against its vocab slice), so a
    reduce-scatter here would count it tp times.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False, group=tp_group)
