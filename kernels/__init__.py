"""dapo_kernels: fused Triton kernels for DAPO (installed from the folder kernels/).

    linear_logprob_entropy(hidden[N,H], weight[V_local,H], targets[N], *, temperature=1.0,
                           tp_group=None, return_entropy=True, vocab_size=None,
                           backward="blocked" | "row_chunked", logits="triton" | "cublas" | "tma")
        -> (logprob[N], entropy[N] | None)        (vocab_size: rows past it are padding)
    policy_loss(logprob, old_logprob, advantages, mask, *, eps_low, eps_high, clip_ratio_c,
                loss_denominator, one_pass=True) -> (loss, stats)
    linear_dapo_loss(hidden, weight, targets, old_logprob, advantages, loss_weight, *, eps_low, eps_high,
                     clip_ratio_c, loss_denominator, temperature=1.0, tp_group=None, vocab_size=None,
                     logits="triton" | "tma")
        -> (loss, logprob, entropy, stats)   (head_loss.py: the LM head + DAPO loss in one pass,
                                              the gradients computed by the forward; "tma": the logits
                                              kernel's operands by TMA, head_loss_tma.py)

The fused ops run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this
package was imported (tests). Elsewhere they raise RuntimeError rather than fall back silently;
the *_reference functions (plain torch, same signatures) are the explicit fallback.
"""

if __name__ == "dapo_kernels":
    from ._runtime import INTERPRET
    from .head_loss import linear_dapo_loss
    from .logprob import linear_logprob_entropy
    from .policy_loss import policy_loss
    from .reference import linear_logprob_entropy_reference, policy_loss_reference

    __all__ = [
        "INTERPRET",
        "linear_dapo_loss",
        "linear_logprob_entropy",
        "linear_logprob_entropy_reference",
        "policy_loss",
        "policy_loss_reference",
    ]
else:
    # Imported as `kernels`: the repository root is on sys.path (running from the checkout) and this
    # folder shadows Hugging Face's `kernels` package, which transformers probes for by importing it
    # (utils/import_utils.py, is_kernels_available). Stay empty and version-less, so the probe answers
    # "not available" without importing Triton (absent on some machines: the import would fail).
    # This folder is the package dapo_kernels (pyproject.toml's package-dir).
    __all__ = []
