"""Activation memory of the actor: what one packed micro-batch keeps for the backward pass.

    act = ActivationModel(dims, tp=8, sequence_parallel=True, cp=1, backend="te", recompute="full",
                          precision="bf16", fused_logprob=True)
    act.saved_per_layer(tokens=24576)          # bytes one transformer layer keeps until its backward
    act.saved(tokens=24576, response_tokens=20480, layers=32, first=True, last=False)   # -> {component: bytes}

Notation (per TP rank; tokens are this CP rank's tokens T/cp): h hidden, F ffn, q_w = heads*d,
kv_w = kv_heads*d, t = TP, s = t with sequence parallelism else 1, a = bytes of one activation
(2 for bf16, 4 for fp32). Per layer and token:

  torch backend (local spec, CPU-measured, exact on CPU: tests/distributed/test_memplan_activations.py)
    2 RMSNorms     2 * ((8 + a) h + 4) / s     torch's RMSNorm keeps an fp32 copy of x and of x/rms
                                               (+ rsqrt), the next linear keeps its input (a h)
    RoPE           4 d a                       cos and sin of q and of k, per layer
    attention      a (2 q_w + kv_w + (q_w + 2 kv_w)) / t     per-document causal SDPA (actor/attention.py)
                   + 4 heads / t                              keeps q and k after RoPE, out, the fp32
                                                              logsumexp, and v: a view of the QKV output,
                                                              which it keeps whole. No mask, no repeated K/V
                                                              (GQA by enable_gqa): O(T), measured exactly
                                                              (tests/distributed/test_attention_memory.py)
                   cp > 1: a (2 q_w) / t + a T_kv 2 kv_w / t  the all-gathered K and V (new tensors) instead
                                                              of k and the QKV output (GPU path: flash with
                                                              causal_lower_right; the CPU/fp32 path pads the
                                                              queries of a chunk inside its document to its
                                                              key length: more, not counted here)
                     + a q_w / t with several documents        linear_proj's input: the per-document outputs
                                                              concatenated (one document: a view, no copy)
  SwiGLU MLP     5 F a / t                   fc1 out (2F), x_linear + 0 (F), silu (F), product (F)
  te backend (TE spec, bias_activation_fusion and fused RoPE: read from TE / megatron source, not
  measurable on CPU)
    2 norms        2 * (2 a h + 4) / s         LayerNormLinear keeps its input and ln_out (+ rsigma)
    attention      a (3 q_w + 3 kv_w) / t + 4 heads / t   RoPE'd q and k, the fused QKV output (kept
                                                           alive by v, a view of it), out, softmax lse
    SwiGLU MLP     3 F a / t                   the fused swiglu keeps fc1's output, fc2 its input
  recompute=selective: the core attention is checkpointed: its inputs (q, k, v -> the QKV output) and
    out stay, its internals (lse) go.
  recompute=full (uniform, 1 layer per checkpoint): each layer keeps only its input, a h / s.
Qwen3 QK-norm (q_layernorm / k_layernorm, RMSNorm over each head's d values), per layer and token:
  torch backend (measured)  (8 q_w + 4 heads + 8 kv_w + 4 kv_heads) / t in bf16: each norm keeps its fp32
                            input copy, the 1/rms per head and x/rms. In fp32 there is no cast copy: the
                            inputs are views of the fused QKV output, kept whole (4 (q_w + 2 kv_w) / t,
                            unless something already keeps it), plus 4 q_w / t where megatron's split
                            copied q (more than one local KV group of several query heads)
  te backend (read, not measured)  a (q_w + kv_w) / t + 4 (heads + kv_heads) / t   TE's RMSNorm: input, rsigma
Mixture-of-experts layers (Qwen3-MoE: megatron's MoELayer, alltoall dispatcher, no capacity factor:
no token is dropped), replacing the SwiGLU MLP term; n = tokens reaching the layer on this rank (T / s),
k = top-k, E = experts, F_e = expert width, r = token-expert pairs this rank's experts receive
(balanced routing: r = n k ETP; the measured r in the test, `expert_load` x that in the plan):
  router (transformer/moe/router.py, moe_utils.py topk_routing_with_score_function and permute)
                 n (8k + 4k + E + a E + 8k)   top-k expert ids (int64), top-k fp32 softmax, the bool
                                              routing map and the probs [E, n], the int64 sort order of
                                              the n k permuted rows (measured)
  experts, torch backend (SequentialMLP, experts.py:820-900; measured)
                 r (a h + a + 6 a F_e / ETP)  the dispatched tokens [r, h] (token_dispatcher.py
                                              dispatch_postprocess), their probs, and per expert fc1's
                                              output (2F_e), SwiGLU's three F_e tensors and the
                                              prob-weighted activation (F_e, activation_func_with_probs:
                                              experts.py:112-117) that fc2 keeps
  experts, te backend (TEGroupedMLP: grouped GEMM + fused weighted SwiGLU; read, not measured)
                 r (a h + 4 + 3 a F_e / ETP)  fc1's input, its output (2F_e) and fc2's input (F_e)
  The all-to-all buffers (n k rows before the exchange, r after) are transients of the forward and of
  the backward: they are in the working set, not in what a micro-batch keeps.
  recompute=selective recomputes only the core attention (recompute_modules default ["core_attn"],
  transformer_config.py:1193): the MoE terms stay; recompute=full keeps only each layer's input.
Outside the layers: the first stage keeps the token ids (8 bytes per token), the last stage the final
norm's saved tensors, the LM-head input gathered from the sequence-parallel region (a h per response
token) and the logits path:
  fused kernel (dapo_kernels.linear_logprob_entropy): hidden + 20 bytes per response token, no logits;
  unfused (actor.fused_logprob=false or no CUDA): three fp32 [N, V/t] tensors, 12 V / t bytes per
  response token (logits, exp and log-softmax; at TP > 1 logits, exp and shifted logits), measured.
plus the DAPO loss's per-token fp32 terms (LOSS_BYTES_PER_TOKEN, measured).
actor.head_loss=one_pass (kernels/head_loss.py one_pass_bytes) keeps instead only the op's gradients,
grad_hidden (a h per response token) and grad_weight (a V h / t per micro-batch), and the int64 response
positions (ONE_PASS_BYTES_PER_TOKEN): no logits, no loss terms (measured exactly on CPU); its forward's
workspace (one chunk's fp32 logits + dlogits, <= 512 MiB, the fp32 grad_weight accumulator when N spans
several chunks, the fp32 TP partial of grad_hidden) is in the working set.

Context parallelism divides every per-token term by cp except the keys and values, which each CP
rank gathers for the whole sequence (the torch backend's all-gather; TE's ring keeps them too):
that part is an estimate, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.memplan.arch import ModelDims

ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# DAPO loss terms per response token (old/advantage/mask gathers, ratio, clip masks, k3 KL, metrics),
# fp32; measured with the real Actor on CPU (test_memplan_activations.py prints it).
LOSS_BYTES_PER_TOKEN = 60
# actor.head_loss=one_pass: what a micro-batch keeps per response token beside the op's gradients
# (measured likewise: the int64 response positions the hidden-state gather keeps for its backward)
ONE_PASS_BYTES_PER_TOKEN = 8
# megatron-core's RotaryEmbedding.forward is functools.lru_cache(maxsize=32) (models/common/embeddings/
# rotary_pos_embedding.py:177): one fp32 [S, 1, 1, d] table per distinct packed max length, shared by
# every model chunk of the process (the cache belongs to the function), and not freed by offloading
ROPE_CACHE_ENTRIES = 32


@dataclass(frozen=True)
class ActivationModel:
    dims: ModelDims
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    backend: str = "te"
    recompute: str = "none"
    precision: str = "bf16"
    fused_logprob: bool = True
    # actor.head_loss: "one_pass" keeps the one-pass op's gradients instead of the head's and the loss's tensors
    head_loss: str = "separate"
    ep: int = 1
    etp: int = 1
    # token-expert pairs the experts of this rank receive, as a multiple of the balanced n * k * ETP: routing
    # is data-dependent (no capacity factor, no dropping), so the plan states an allowance (plan.py)
    expert_load: float = 1.0
    # actor.quantization_aware (actor/fake_quant.py): the Linears multiply fake-quantized copies
    quantization_aware: bool = False

    def __post_init__(self):
        if self.backend not in ("te", "torch"):
            raise ValueError(f"actor.attention_backend={self.backend!r}: allowed te, torch")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"actor.recompute={self.recompute!r}: allowed none, selective, full")
        if self.head_loss not in ("separate", "one_pass"):
            raise ValueError(f"actor.head_loss={self.head_loss!r}: allowed separate, one_pass")

    @property
    def a(self) -> int:
        return ACT_BYTES[self.precision]

    @property
    def s(self) -> int:
        return self.tp if self.sequence_parallel else 1

    def local_tokens(self, tokens: int) -> int:
        return -(-tokens // self.cp)

    # --- one transformer layer -----------------------------------------------------------------------

    def layer_parts(
        self, *, tokens: int, recompute: str | None = None, sparse: bool = False, single_document: bool = False
    ) -> dict[str, float]:
        """Bytes one layer keeps for a micro-batch of `tokens` tokens (before the CP split); sparse: a
        mixture-of-experts layer (router + experts in place of the dense MLP); single_document: the
        micro-batch is one sequence (the torch backend's attention output is then not concatenated)."""
        d, a, t, s = self.dims, self.a, self.tp, self.s
        recompute = self.recompute if recompute is None else recompute
        n = self.local_tokens(tokens)
        n_kv = tokens if self.cp > 1 else n  # keys/values gathered over the CP group
        if recompute == "full":
            return {"layer input (full recompute)": n * a * d.hidden / s}
        if self.backend == "torch":
            parts = {"norms": n * 2 * ((8 + a) * d.hidden + 4) / s, "rope cos/sin": n * 4 * d.head_dim * a}
            # something else keeps the QKV output: the checkpoint, or v (a view of it) in the core attention
            qkv_kept = recompute == "selective" or self.cp == 1
            if recompute == "selective":
                parts["attention"] = n * a * (3 * d.q_width + 3 * d.kv_width) / t
            else:
                if self.cp == 1:  # the RoPE'd k, and v keeps the whole QKV output alive (it is a view)
                    keys_values = n * a * (d.q_width + 3 * d.kv_width) / t
                else:  # the K and V all-gathered over the CP group (context_parallel.gather_for_cp)
                    keys_values = n_kv * a * 2 * d.kv_width / t
                parts["attention"] = n * a * 2 * d.q_width / t + keys_values + n * 4 * d.heads / t
                if not single_document and not self.quantization_aware:
                    # one SDPA output per document, each kept by its backward; linear_proj keeps their
                    # concatenation (with quantization_aware it keeps the fake-quantized copy instead,
                    # counted there). One document: linear_proj's input is a view of the one output
                    parts["attention output (documents concatenated)"] = n * a * d.q_width / t
            if d.qk_norm:
                if a == 4:  # fp32: no cast copy; the norms keep views of the QKV output (kept whole) ...
                    qkv = 0 if qkv_kept else 4 * (d.q_width + 2 * d.kv_width)
                    # ... except q when megatron's split had to copy it: several local KV groups of several
                    # query heads each (attention.py get_query_key_value_tensors reshapes a strided view)
                    q_copied = d.kv_heads // t > 1 and d.heads > d.kv_heads
                    inputs = qkv + (4 * d.q_width if q_copied else 0)
                else:  # bf16/fp16: x.float() copies of q and k
                    inputs = 4 * (d.q_width + d.kv_width)
                parts["qk norms"] = n * (inputs + 4 * (d.heads + d.kv_heads) + 4 * (d.q_width + d.kv_width)) / t
        else:
            parts = {
                "norms": n * 2 * (2 * a * d.hidden + 4) / s,
                "attention": n * a * (3 * d.q_width + 3 * d.kv_width) / t,
            }
            if self.cp > 1:
                parts["attention"] += n_kv * a * 2 * d.kv_width / t
            if recompute != "selective":
                parts["attention"] += n * 4 * d.heads / t
            if d.qk_norm:
                parts["qk norms"] = n * (a * (d.q_width + d.kv_width) + 4 * (d.heads + d.kv_heads)) / t
        if sparse:
            parts.update(self.moe_parts(tokens=tokens))
        else:
            parts["mlp"] = n * (5 if self.backend == "torch" else 3) * d.ffn * a / t
        if self.quantization_aware:
            parts.update(self.quantization_aware_parts(tokens=tokens, recompute=recompute, sparse=sparse))
        return parts

    def quantization_aware_parts(self, *, tokens: int, recompute: str, sparse: bool) -> dict[str, float]:
        """What actor.quantization_aware adds to a layer's saved bytes (measured on CPU, torch backend; the te
        backend is refused with it). Each FP8 Linear's matmul keeps the fake-quantized weight it multiplied
        (a new tensor of the weight's dtype, per micro-batch) instead of the Parameter; linear_proj keeps the
        fake-quantized attention output while SDPA still keeps the original (without selective recompute);
        a trainer not in bf16 (the engines' dtype) keeps its norms' bf16-rounded weight copies. The Linears'
        fake-quantized inputs replace tensors nobody else keeps: no extra. Full recompute keeps only the
        layer input."""
        d, a, t = self.dims, self.a, self.tp
        n = self.local_tokens(tokens)
        # linear_qkv + linear_proj
        linear_numel = d.hidden * (d.q_width + 2 * d.kv_width) // t + d.q_width // t * d.hidden
        if not sparse:  # MoE experts are not fake-quantized (refused), dense fc1 + fc2 are
            linear_numel += 3 * d.ffn // t * d.hidden
        parts: dict[str, float] = {"fake-quantized FP8 weights (quantization-aware)": linear_numel * a}
        if recompute == "none":
            parts["attention output kept twice (quantization-aware)"] = n * a * d.q_width / t
        if self.precision != "bf16":  # every norm weight rounded to bf16 in its forward, kept by its backward
            norms = 2 * d.hidden + (2 * d.head_dim if d.qk_norm else 0)
            parts["bf16-rounded norm weights (quantization-aware)"] = a * norms
        return parts

    def routed_pairs(self, *, tokens: int) -> float:
        """Token-expert pairs this rank's experts receive: the n / s tokens of each of the EP ranks send k
        rows each, spread over EP ranks (balanced: n k / s), gathered over ETP (dispatch_postprocess)."""
        return self.local_tokens(tokens) / self.s * self.dims.topk * self.etp * self.expert_load

    def moe_parts(self, *, tokens: int, routed: float | None = None) -> dict[str, float]:
        """A mixture-of-experts MLP's saved bytes (see the module docstring); routed: the measured r."""
        d, a = self.dims, self.a
        n = self.local_tokens(tokens) / self.s
        r = self.routed_pairs(tokens=tokens) if routed is None else routed
        k, e, width = d.topk, d.num_experts, d.moe_ffn / self.etp
        parts = {"moe router": n * (20 * k + e * (1 + a))}
        if self.backend == "torch":
            parts["moe experts"] = r * (a * d.hidden + a + 6 * a * width)
        else:
            parts["moe experts"] = r * (a * d.hidden + 4 + 3 * a * width)
        return parts

    def saved_per_layer(self, *, tokens: int, sparse: bool = False) -> float:
        return sum(self.layer_parts(tokens=tokens, sparse=sparse).values())

    # --- one micro-batch on one pipeline stage ---------------------------------------------------------

    def head_parts(self, *, response_tokens: int) -> dict[str, float]:
        d, a = self.dims, self.a
        n = self.local_tokens(response_tokens)
        if self.head_loss == "one_pass":
            return {
                "logits path (head + loss in one pass: grad_hidden + grad_weight kept)": self._one_pass(n)["saved"]
                + n * ONE_PASS_BYTES_PER_TOKEN
            }
        if self.fused_logprob:
            return {"logits path (fused kernel)": n * (a * d.hidden + 20)}
        # three fp32 [N, V/t] tensors (logits, exp, log-softmax or shifted logits) + small per-token terms
        small = 13 if self.tp == 1 else 25
        return {
            f"logits path (unfused, 3 x fp32 [N, V/{self.tp}])": n * (a * d.hidden + 12 * d.vocab / self.tp + small)
        }

    def final_norm(self, *, tokens: int) -> float:
        n = self.local_tokens(tokens)
        per = 8 * self.dims.hidden + 4 if self.backend == "torch" else self.a * self.dims.hidden + 4
        return n * per / self.s

    def saved(
        self,
        *,
        tokens: int,
        response_tokens: int,
        layers: int,
        first: bool,
        last: bool,
        max_sequence: int | None = None,
        sparse_layers: int = 0,
    ) -> dict[str, float]:
        """Bytes kept for the backward by one micro-batch on a stage with `layers` layers of which
        `sparse_layers` are mixture-of-experts layers (max_sequence: the longest packed sequence, which
        sizes the RoPE table that full recompute keeps; when it fills the micro-batch, the micro-batch is one
        document)."""
        parts: dict[str, float] = {}
        single = max_sequence is not None and max_sequence >= tokens  # the longest sequence fills the micro-batch
        for sparse, count in ((False, layers - sparse_layers), (True, sparse_layers)):
            for name, value in self.layer_parts(tokens=tokens, sparse=sparse, single_document=single).items():
                parts[name] = parts.get(name, 0.0) + value * count
        if self.recompute == "full" and layers:
            parts["rope table (full recompute)"] = min(max_sequence or tokens, tokens) * self.dims.head_dim * 4
        if first:
            parts["token ids"] = self.local_tokens(tokens) * 8
        if last:
            parts["final norm"] = self.final_norm(tokens=tokens)
            parts.update(self.head_parts(response_tokens=response_tokens))
            if self.head_loss == "separate":  # one_pass: the op keeps only its gradients (head_parts)
                parts["loss terms"] = self.local_tokens(response_tokens) * LOSS_BYTES_PER_TOKEN
            if self.quantization_aware and self.precision != "bf16":  # LM head + final norm rounded to bf16
                parts["bf16-rounded LM head + final norm (quantization-aware)"] = self.a * (
                    -(-self.dims.vocab // self.tp) * self.dims.hidden + self.dims.hidden
                )
        return parts

    # --- transients ----------------------------------------------------------------------------------

    def backward_working_set(
        self, *, tokens: int, response_tokens: int, last: bool, largest_param_numel: int
    ) -> dict[str, float]:
        """Estimates of what exists on top of the saved activations while a micro-batch runs: one layer's
        full activations (recomputed under full recompute; gradients in flight otherwise), the largest
        parameter's gradient before DDP adds it to main_grad, and the unfused head's two fp32 [N, V/t]
        gradient buffers. (The torch backend has no [T, T] mask: actor/attention.py.)"""
        parts = {
            "one layer in backward": self._one_layer(tokens=tokens),
            "largest parameter gradient": largest_param_numel * self.a,
        }
        if last and self.head_loss == "one_pass":
            # the one-pass forward's chunk of fp32 logits + dlogits (<= 512 MiB), its fp32 grad_weight
            # accumulator with several chunks, the TP partial of grad_hidden (kernels/head_loss.py one_pass_bytes)
            parts["one-pass head + loss workspace"] = self._one_pass(self.local_tokens(response_tokens))["workspace"]
            return parts
        if last and not self.fused_logprob:
            parts["logits gradient"] = self.local_tokens(response_tokens) * 8 * self.dims.vocab / self.tp
        if last and self.fused_logprob:
            # the fused head's backward scratch (dL/dlogits block + fp32 grad_hidden rows): the kernel's own
            # formula, <= min(256 MiB, 3 N H bytes) whatever N is (kernels/logprob.py, blocked schedule).
            # Imported here: that module loads torch and triton (~1 s), which the plan (arithmetic,
            # run by the launcher and `dapo-megatron plan` before anything starts) needs nowhere else.
            from dapo_kernels.logprob import blocked_workspace_bytes

            parts["fused head backward workspace"] = blocked_workspace_bytes(
                self.local_tokens(response_tokens),
                self.dims.hidden,
                -(-self.dims.vocab // self.tp),
                int(self.a),
                tp=self.tp > 1,
            )
        return parts

    def _one_pass(self, n: int) -> dict[str, int]:
        """kernels/head_loss.py one_pass_bytes for n response tokens on this rank, the GPU's chunks (weight in the
        activation dtype: the trainer's parameters; imported here for the reason of blocked_workspace_bytes)."""
        from dapo_kernels.head_loss import COMPILED_CHUNK_ROW_ALIGN, one_pass_bytes

        v_local = -(-self.dims.vocab // self.tp)
        return one_pass_bytes(
            n, self.dims.hidden, v_local, int(self.a), tp=self.tp > 1, row_align=COMPILED_CHUNK_ROW_ALIGN
        )

    def forward_only_working_set(self, *, tokens: int, response_tokens: int, last: bool) -> dict[str, float]:
        """Log-prob pass (no_grad): nothing is saved; one layer's intermediates and the head's live at once."""
        parts = {"one layer forward": self._one_layer(tokens=tokens)}
        if last:
            r = self.local_tokens(response_tokens)
            vocab_local = self.dims.vocab / self.tp
            head: float = r * self.a * self.dims.hidden
            if not self.fused_logprob:
                head += r * 3 * 4 * vocab_local  # fp32 logits, exp, exp * shifted
            parts["logits path"] = head
        return parts

    def _one_layer(self, *, tokens: int) -> float:
        """The heaviest layer's full activations, plus for a MoE layer its all-to-all buffers: the n k
        permuted rows before the exchange and the r received ones (token_dispatcher.py token_dispatch)."""
        dense = sum(self.layer_parts(tokens=tokens, recompute="none").values())
        if not self.dims.is_moe:
            return dense
        exchange = (
            (self.local_tokens(tokens) / self.s * self.dims.topk + self.routed_pairs(tokens=tokens))
            * self.a
            * self.dims.hidden
        )
        sparse = sum(self.layer_parts(tokens=tokens, recompute="none", sparse=True).values()) + exchange
        return max(dense, sparse) if self.dims.num_sparse_layers < self.dims.layers else sparse

    def rope_cache(self, *, max_sequence: int) -> float:
        """Upper bound of megatron's RoPE table cache: 32 fp32 [S, d] tables of at most max_sequence rows."""
        return ROPE_CACHE_ENTRIES * max_sequence * self.dims.head_dim * 4
