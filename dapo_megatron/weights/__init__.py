"""HF <-> Megatron weights: name/shape mapping, loading into shards, streaming full tensors out.

from dapo_megatron.weights import load_hf_into_model, iter_hf_weights, bucketize, save_hf_checkpoint
"""

from dapo_megatron.weights.export import bucketize, iter_hf_weights
from dapo_megatron.weights.load import load_hf_into_model
from dapo_megatron.weights.save import save_hf_checkpoint

__all__ = ["bucketize", "iter_hf_weights", "load_hf_into_model", "save_hf_checkpoint"]
