"""Model provider: a megatron-core GPTModel built from a Hugging Face config (Qwen2/Qwen2.5, Llama,
Qwen3, Qwen3-MoE).

    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.actor.model import build_model_chunks
    with model_parallel(tp=2, pp=2, seed=42):
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")

Two attention backends, both selected through ModuleSpecs (no layer is edited):
  te     Transformer Engine layer spec: THD packed sequences, context parallelism (clusters only).
  torch  megatron-core's local spec with the core attention replaced by `TorchSDPAttention`
         (actor/attention.py: per-document causal SDPA, or FlexAttention on CUDA, O(T) memory,
         actor.attention_kernel) and RMSNorm by `TorchRMSNorm` (allows sequence
         parallel). Runs on CPU (gloo, fp32) and on GPUs without TE (bf16), context parallelism
         included (K/V all-gathered over the CP group: context_parallel.py).

Packed-sequence interface (the SAME call for both backends)
-----------------------------------------------------------
Several sequences of lengths L_0..L_{n-1} are concatenated into one row of T = sum(L_i) tokens
(T must equal sum(L_i): megatron's THD RoPE splits the row by these lengths; to pad a row, append
the padding as one more "sequence" and ignore its outputs):

    packed = packed_seq_params_from_lengths([L_0, ..., L_{n-1}])     # qkv_format="thd"
    logits = model(input_ids_1T, position_ids_1T, attention_mask=None, packed_seq_params=packed)
    # logits: [1, T, V_padded / tp] vocab-parallel (last pipeline stage; earlier stages return
    # hidden states [T, 1, H])

- input_ids [1, T] int64; position_ids [1, T] are per-sequence positions (0..L_i-1 for each
  sequence; `packed_position_ids(lengths)` makes them). With RoPE megatron does not read
  position_ids: RoPE restarts per sequence from cu_seqlens (rope_utils._apply_rotary_pos_emb_thd),
  which is exactly what per-sequence position ids mean. Pass them anyway (TE and future learned
  position embeddings use them).
- Attention: token t of sequence i attends to tokens s of the same sequence with s <= t: one causal
  attention block per sequence from cu_seqlens (torch backend, no [T, T] mask: actor/attention.py) or
  TE's THD kernels.
- Unpacked batches [B, S] work too: attention_mask=None and packed_seq_params=None give plain
  causal attention per row (rows must then have no left padding).
- Outputs are in the vocab-parallel layout: each TP rank holds logits for its V_padded/tp slice of
  the padded vocabulary (rows >= hf vocab_size are padding; their logits come from zero rows of
  the loaded embedding/output weights, so mask them before any softmax over the vocabulary:
  `tools/parity.py: vocab_parallel_logprobs` does).
- Context parallelism (cp > 1), both backends: the sequence split is the caller's
  (context_parallel.split_for_cp: every padded segment cut into 2*cp chunks, rank r holding chunks
  r and 2*cp-1-r); pass the GLOBAL boundaries as cu_seqlens_q_padded (or cu_seqlens_q) and the
  GLOBAL max_seqlen. megatron's THD RoPE (rope_utils._apply_rotary_pos_emb_thd with
  _get_thd_freqs_on_this_cp_rank) then gives each local token the rotary angle of its true position
  in its sequence, and attention sees the whole sequence. Unpacked [B, S] batches are split the same
  way along S (megatron's get_batch_on_this_cp_rank; RoPE slices with get_pos_emb_on_this_cp_rank).

Qwen3 adds QK-norm (an RMSNorm over each head's query and key, before RoPE: megatron's
qk_layernorm), no QKV bias and a head_dim that need not be hidden / heads. Qwen3-MoE replaces the
MLP of its sparse layers by a router and per-expert SwiGLU MLPs (actor/moe.py: which layers, the
router's softmax/top-k, expert parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from dapo_megatron.actor.attention import TorchSDPAttention, check_attention_kernel
from dapo_megatron.actor.moe import moe_layer_pattern, moe_transformer_kwargs
from dapo_megatron.distributed.collectives import compute_device

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.types import Device
    from transformers import PretrainedConfig

Precision = Literal["bf16", "fp16", "fp32"]
AttentionBackend = Literal["torch", "te"]

# what a checkpoint's config.json says about its shapes: weights/hf_config.py (the weight mapping reads it too)
from dapo_megatron.weights.hf_config import (  # noqa: E402,F401 (re-exported)
    SUPPORTED_MODEL_TYPES,
    VOCAB_DIVISIBLE_BY,
    has_qk_norm,
    has_qkv_bias,
    head_dim_of,
    model_type_of,
    padded_vocab_size,
)

# --- HF config -> TransformerConfig ----------------------------------------------------------------

# Megatron's RoPE scaling is HF's "llama3" type with these constants hard-coded
# (rotary_pos_embedding.py _apply_scaling); only the factor is a parameter.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_settings_of(hf_config: PretrainedConfig) -> tuple[float, float | None]:
    """(rope theta, llama3 scaling factor or None) from transformers <5 (`rope_theta`,
    `rope_scaling`) or >=5 (`rope_parameters`) configs. Other RoPE types raise ValueError."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params = {**(getattr(hf_config, "rope_scaling", None) or {}), **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        for key, value in _MEGATRON_LLAMA3_ROPE.items():
            if float(params.get(key, -1)) != value:
                raise ValueError(
                    f"config.json llama3 RoPE {key}={params.get(key)!r}: megatron-core supports only {value}"
                )
        return float(theta), float(params["factor"])
    raise ValueError(f"config.json rope_type {rope_type!r} is not supported (default and llama3 are)")


def rope_theta_of(hf_config: PretrainedConfig) -> float:
    return rope_settings_of(hf_config)[0]


def _check_supported_architecture(hf_config: PretrainedConfig) -> None:
    """A model type this actor builds, with SwiGLU, no MLP bias and full attention: ValueError otherwise."""
    model_type_of(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf_config.hidden_act!r}: only silu (SwiGLU) is supported")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported (full attention only)")


def _parallel_sizes(hf_config: PretrainedConfig, *, sequence_parallel: bool) -> tuple[int, int, int, int | None]:
    """(tp, pp, cp, vpp) of the current parallel_state, checked against the model's layers and sequence_parallel."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if sequence_parallel and tp == 1:
        raise ValueError("actor.sequence_parallel needs actor.tp > 1")
    if hf_config.num_hidden_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by pp*vpp = {pp}*{vpp or 1}"
        )
    return tp, pp, cp, vpp


def _recompute_kwargs(recompute: str) -> dict[str, str | int]:
    """TransformerConfig's activation recomputation fields for actor.recompute (none, selective, full)."""
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute != "none":
        raise ValueError(f"actor.recompute={recompute!r}: allowed none, selective, full")
    return {}


def _pipeline_p2p_kwargs(vpp: int | None, *, uniform_lengths: bool) -> dict[str, bool]:
    """How pipeline stages exchange activations and gradients (megatron's p2p_communication.py).

    - The shapes are exchanged before the tensors (variable_seq_lengths) unless the caller's
      micro-batches of one schedule call share one length: the actor's do under PP
      (PackSettings.uniform_length; it passes that length as seq_length), so it skips the exchange.
      The exchange batches the sends to the previous and to the next stage, which at PP=2 are one peer
      (harmless only while the two shapes are equal).
    - The interleaved schedule (VPP) sends an activation forward and a gradient backward in one call;
      at PP=2 both go to one peer, and batched (batch_isend_irecv) they are matched in posting order:
      the activation arrived as the gradient (measured on gloo: loss 1.444 instead of 0.285, ratio_max
      47). Megatron-LM's setting for that schedule: unbatched, overlapped p2p, whose _p2p_ops orders the
      messages by even / odd rank and puts the second direction on another group at PP=2."""
    return dict(variable_seq_lengths=not uniform_lengths, batch_p2p_comm=vpp is None, overlap_p2p_comm=vpp is not None)


def transformer_config_from_hf(
    hf_config: PretrainedConfig,
    *,
    precision: Precision = "bf16",
    sequence_parallel: bool = False,
    recompute: Literal["none", "selective", "full"] = "none",
    attention_backend: AttentionBackend = "torch",
    uniform_lengths: bool = False,
):
    """TransformerConfig for the current parallel_state layout (call inside model_parallel()); uniform_lengths:
    one length for every micro-batch of a pipeline schedule call (_pipeline_p2p_kwargs)."""
    from megatron.core.transformer import TransformerConfig

    _check_supported_architecture(hf_config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    tp, pp, cp, vpp = _parallel_sizes(hf_config, sequence_parallel=sequence_parallel)
    on_gpu = torch.cuda.is_available()
    fuse = on_gpu and attention_backend == "te"  # fused kernels need TE / CUDA
    recompute_kwargs = _recompute_kwargs(recompute)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        **_pipeline_p2p_kwargs(vpp, uniform_lengths=uniform_lengths),
        # alltoall: the expert-parallel dispatcher the MoE tests and the memory plan were written
        # against (also set for dense models, whose config validation checks it all the same)
        moe_token_dispatcher_type="alltoall",
        **moe_transformer_kwargs(hf_config, attention_backend=attention_backend),
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=fuse,
        masked_softmax_fusion=fuse,
        bias_dropout_fusion=fuse,
        apply_rope_fusion=fuse,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **recompute_kwargs,
    )


# --- the torch attention backend ---------------------------------------------------------------------
# the core attention (TorchSDPAttention: packed and context-parallel causal attention in O(T) memory)
# is actor/attention.py


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm constructor; unlike WrappedTorchNorm it allows sequence
    parallel: its weight is marked `sequence_parallel` so Megatron all-reduces its gradient over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        for param in self.parameters():
            # megatron reads this flag off the Parameter (its grad is all-reduced over TP); not a torch attribute
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def torch_layer_spec(*, qk_layernorm: bool = False, num_experts: int | None = None, attention_kernel: str = "sdpa"):
    """Local layer spec with TorchSDPAttention as core attention and TorchRMSNorm norms (the QK-norms
    too when qk_layernorm). num_experts: the MoE layer spec (router + SequentialMLP of local experts).
    attention_kernel: actor.attention_kernel (sdpa, or flex on CUDA: actor/attention.py)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=qk_layernorm, num_experts=num_experts, moe_grouped_gemm=False
    )
    attention = spec.submodules.self_attention
    replaced = dict(core_attention=ModuleSpec(module=TorchSDPAttention, params={"kernel": attention_kernel}))
    if qk_layernorm:
        replaced.update(q_layernorm=ModuleSpec(module=TorchRMSNorm), k_layernorm=ModuleSpec(module=TorchRMSNorm))
    attention_submodules = dataclasses.replace(attention.submodules, **replaced)
    layer_submodules = dataclasses.replace(
        spec.submodules,
        input_layernorm=ModuleSpec(module=TorchRMSNorm),
        pre_mlp_layernorm=ModuleSpec(module=TorchRMSNorm),
        self_attention=ModuleSpec(module=attention.module, params=attention.params, submodules=attention_submodules),
    )
    return ModuleSpec(module=spec.module, params=spec.params, submodules=layer_submodules)


def te_layer_spec(*, qk_layernorm: bool = False):
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    except (ImportError, RuntimeError, AssertionError) as err:
        raise ValueError(
            "actor.attention_backend=te needs Transformer Engine (pip install "
            "'transformer-engine[pytorch]' on a CUDA machine, or an NGC container); "
            f"use actor.attention_backend=torch without it ({type(err).__name__}: {err})"
        ) from err


def _block_spec(
    config, hf_config, vp_stage: int | None, attention_backend: AttentionBackend, attention_kernel: str = "sdpa"
):
    """The decoder block of this (virtual) pipeline stage: one layer spec per layer, MoE or dense as
    the HF config says (actor/moe.py moe_layer_pattern), with our final norm for the torch backend
    (megatron's default would be WrappedTorchNorm, which refuses sequence parallel). The TE
    backend uses megatron's own block spec (TE grouped-GEMM experts, TE norms), which reads the same
    layer pattern from config.moe_layer_freq."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    qk_norm = has_qk_norm(hf_config)
    pattern = moe_layer_pattern(hf_config)
    if attention_backend == "te":
        if not any(pattern):
            return te_layer_spec(qk_layernorm=qk_norm)
        te_layer_spec(qk_layernorm=qk_norm)  # the clear error when TE is missing
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    dense = torch_layer_spec(qk_layernorm=qk_norm, attention_kernel=attention_kernel)
    sparse = (
        torch_layer_spec(qk_layernorm=qk_norm, num_experts=config.num_moe_experts, attention_kernel=attention_kernel)
        if any(pattern)
        else None
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer_specs = [sparse if pattern[offset + i] else dense for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=ModuleSpec(module=TorchRMSNorm))


# --- the provider ---------------------------------------------------------------------------------


def build_gpt_model(
    hf_config: PretrainedConfig,
    *,
    attention_backend: AttentionBackend = "torch",
    precision: Precision = "bf16",
    sequence_parallel: bool = False,
    recompute: Literal["none", "selective", "full"] = "none",
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    attention_kernel: str = "sdpa",
    uniform_lengths: bool = False,
) -> GPTModel:
    """One GPTModel chunk for this rank's pipeline stage (and virtual stage `vp_stage`), inside `model_parallel(...)`.
    pre/post_process default to "first/last (virtual) stage". The vocabulary is padded to
    `padded_vocab_size(vocab, tp=tp)`; parallel_output=True (logits stay vocab-parallel). Parameters are on the
    GPU when CUDA is available, else on the CPU. NOT wrapped (no Float16Module / DDP): the trainer's choice."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if attention_backend not in ("torch", "te"):
        raise ValueError(f"actor.attention_backend={attention_backend!r}: allowed torch, te")
    if attention_backend == "torch":
        check_attention_kernel(attention_kernel)  # flex: CUDA only, refused here rather than in backward
    config = transformer_config_from_hf(
        hf_config,
        precision=precision,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        attention_backend=attention_backend,
        uniform_lengths=uniform_lengths,
    )
    if config.virtual_pipeline_model_parallel_size is not None and vp_stage is None:
        raise ValueError("virtual pipeline parallelism: pass vp_stage (or use build_model_chunks)")
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rope_theta, rope_factor = rope_settings_of(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(config, hf_config, vp_stage, attention_backend, attention_kernel),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp=tp, divisible_by=vocab_divisible_by),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta,
        rope_scaling=rope_factor is not None,
        rope_scaling_factor=rope_factor or 8.0,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(hf_config: PretrainedConfig, **kwargs) -> list[GPTModel]:
    """All model chunks of this rank: one per virtual pipeline stage (a single chunk without VPP).
    Keyword arguments are those of build_gpt_model (except vp_stage / pre_process / post_process)."""
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt_model(hf_config, **kwargs)]
    return [build_gpt_model(hf_config, vp_stage=stage, **kwargs) for stage in range(vpp)]


# --- packed input helpers -------------------------------------------------------------------------


def packed_seq_params_from_lengths(lengths: Sequence[int], *, device: Device = None) -> PackedSeqParams:
    """PackedSeqParams (qkv_format="thd") for sequences of these lengths packed into one row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not lengths or min(lengths) <= 0:
        raise ValueError(f"packed sequence lengths must be positive, got {list(lengths)}")
    if device is None:
        device = compute_device()
    lengths_t = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(lengths_t, 0)
    max_len = int(max(lengths))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )


def packed_position_ids(lengths: Sequence[int], *, device: Device = None) -> torch.Tensor:
    """[1, T] positions restarting at 0 for each sequence: [3, 2] -> [[0, 1, 2, 0, 1]]."""
    return torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
