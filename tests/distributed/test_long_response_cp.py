"""One 20,480-token response (plus a 16-token prompt) trains on CPU: the torch attention backend holds it
without a [T, T] mask (actor/attention.py). A tiny Qwen2 (hidden 64, 2 layers, fp32) takes one Actor.train
step on it at CP=2 (two ranks, each holding chunks r and 3-r of the sequence and attending to the
all-gathered keys): the loss and every gradient are within fp32 rounding of the float64 step on the
transformers model (tests/helpers_fp32.py: the bound is measured from the same model run in fp32). A wrong
CP attention (chunks that see past their position, K/V gradients without the CP sum) moves the loss or the
gradients by far more. (This compared CP=2 with a CP=1 run at rel 1e-6 before: two fp32 results, a bet on
one CPU's reduction order; the float64 step is the truth both approximate, and costs ~60 s here.)
The dense-mask backend this replaces needed a 20,496^2 mask (420M entries, 1.7 GB as the float SDPA keeps,
per layer) for this step.
"""

import json
import random
import time

import pytest
import torch

from dapo_megatron.dataplane.sample import Sample
from helpers_actor import grads_rank
from helpers_fp32 import reference_step

PROMPT, RESPONSE = 16, 20_480


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    path = save_tiny_hf(tmp_path_factory.mktemp("qwen_long"), arch="qwen2", num_layers=2)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 32768  # the tiny helper's 256 would refuse a 20K sequence
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _long_sample():
    rng = random.Random(11)
    sample = Sample(
        prompt_ids=[rng.randrange(5, 300) for _ in range(PROMPT)],
        response_ids=[rng.randrange(5, 300) for _ in range(RESPONSE)],
        group_index=0,
    )
    gen = torch.Generator().manual_seed(3)
    sample.old_logprobs = (-5.7 + 0.3 * torch.randn(RESPONSE, generator=gen)).tolist()
    sample.advantage = 1.0
    return sample


def test_20k_token_response_trains_at_cp2_like_the_float64_step(rank_pool, long_tiny_dir):
    samples = [_long_sample()]
    budget = PROMPT + RESPONSE  # one micro-batch; a multiple of 2*cp = 4 already
    start = time.perf_counter()
    ref = reference_step(long_tiny_dir, samples)  # SDPA's causal CPU kernel: O(T) memory in both precisions
    ref_s = time.perf_counter() - start
    start = time.perf_counter()
    results = rank_pool(2).run(grads_rank, long_tiny_dir, samples, budget, None, 2)
    cp2_s = time.perf_counter() - start
    worst = 0.0
    for m2, n2, g2 in results:
        assert n2 == 1 and m2["num_tokens"] == RESPONSE
        worst = max(worst, ref.check_loss(m2["loss"], "cp=2"), ref.check_grads(g2, "cp=2"))
    assert any(float(g.abs().max()) > 1e-3 for g in ref.exact.grads.values())  # the gradients are not all ~0
    print(
        f"20,496-token step: float64 + fp32 reference {ref_s:.1f} s, cp=2 {cp2_s:.1f} s (incl. model build); "
        f"loss {results[0][0]['loss']:.9g} vs float64 {ref.exact.loss:.9g}; worst error / fp32 bound {worst:.2f}"
    )
