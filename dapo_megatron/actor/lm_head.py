"""Per-token log-probs and entropies on the LM head: the one place that picks the implementation.

    logprob_N, entropy_N = token_logprobs_entropy(hidden_NH, weight_VH, targets_N,
                                                  temperature=1.0, tp_group=tp_group)

On CUDA (when dapo_kernels' fused Triton op imports) this is `dapo_kernels.linear_logprob_entropy`:
the [N, V] logits are never materialized. On CPU, or where the fused op is missing, it is
`linear_logprob_entropy_reference` (plain torch, same signature and the same vocab-parallel
all-reduces). Both return fp32 [N] tensors, differentiable in hidden and weight; weight is this TP
rank's vocab slice (rows [r*V_local, (r+1)*V_local)), targets are global token ids.

Also here: how to get those hidden states out of megatron-core's GPTModel without computing the
logits (`return_hidden_states`), and which weight is the LM head (`output_weight`).
"""

from __future__ import annotations

import types

import torch


def _fused_op():
    if not torch.cuda.is_available():
        return None
    try:
        from dapo_kernels import linear_logprob_entropy
    except ImportError:
        return None
    return linear_logprob_entropy


def token_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float, tp_group, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob[N], entropy[N]) of softmax(hidden @ weight.T / temperature) at `targets`, fp32.
    fused=False (actor.fused_logprob=false) forces the plain-torch reference on a GPU too."""
    hidden = hidden.to(weight.dtype)  # a Float16Module wrapper would hand the output back as fp32
    fused = _fused_op() if (fused and hidden.is_cuda) else None
    if fused is not None:
        return fused(hidden, weight, targets, temperature=temperature, tp_group=tp_group)
    from dapo_kernels.reference import linear_logprob_entropy_reference

    return linear_logprob_entropy_reference(hidden, weight, targets, temperature=temperature, tp_group=tp_group)


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


def gather_sequence_parallel(hidden_SBH: torch.Tensor, *, tp_group) -> torch.Tensor:
    """All-gather sequence-parallel hidden states along the sequence for the vocab-parallel head.

    The backward only splits (tensor_parallel_output_grad=False): the head already all-reduces
    the hidden gradient over TP (every TP rank scores all N tokens against its vocab slice), so a
    reduce-scatter here would count it tp times.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False, group=tp_group)
