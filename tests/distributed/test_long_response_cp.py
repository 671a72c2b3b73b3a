"""One 20,480-token response (plus a 16-token prompt) trains on CPU: the torch attention backend holds it
without a [T, T] mask (actor/attention.py). A tiny Qwen2 (hidden 64, 2 layers, fp32) takes one Actor.train
step on it at CP=1 (one rank) and at CP=2 (two ranks, each holding chunks r and 3-r of the sequence and
attending to the all-gathered keys): the loss and every gradient agree.

Tolerances: loss rel 1e-6 and gradients 1e-6 absolute + 1e-5 relative, as test_actor_train.py's CP=2 vs
CP=1 step (the differences are the order of fp32 sums over 20K keys); a wrong CP attention (chunks that
see past their position, K/V gradients without the CP sum) moves the loss or the gradients by far more.
The dense-mask backend this replaces needed a 20,496^2 mask (420M entries, 1.7 GB as the float SDPA keeps,
per layer) for this step.
"""

import json
import random
import time

import pytest
import torch

from dapo_megatron.dataplane.sample import Sample
from test_actor_train import _grads_rank

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
    sample = Sample(prompt_ids=[rng.randrange(5, 300) for _ in range(PROMPT)],
                    response_ids=[rng.randrange(5, 300) for _ in range(RESPONSE)], group_index=0)
    gen = torch.Generator().manual_seed(3)
    sample.old_logprobs = (-5.7 + 0.3 * torch.randn(RESPONSE, generator=gen)).tolist()
    sample.advantage = 1.0
    return sample


def test_20k_token_response_trains_at_cp2_like_cp1(rank_pool, long_tiny_dir):
    samples = [_long_sample()]
    budget = PROMPT + RESPONSE  # one micro-batch; a multiple of 2*cp = 4 already
    start = time.perf_counter()
    (m1, n1, g1), = rank_pool(1).run(_grads_rank, long_tiny_dir, samples, budget, None, 1)
    cp1_s = time.perf_counter() - start
    start = time.perf_counter()
    results = rank_pool(2).run(_grads_rank, long_tiny_dir, samples, budget, None, 2)
    cp2_s = time.perf_counter() - start
    print(f"20,496-token step: cp=1 {cp1_s:.1f} s, cp=2 {cp2_s:.1f} s (incl. model build); "
          f"loss {m1['loss']:.9g} vs {results[0][0]['loss']:.9g}")
    assert n1 == 1 and m1["num_tokens"] == RESPONSE
    worst = 0.0
    for m2, n2, g2 in results:
        assert n2 == 1 and m2["num_tokens"] == RESPONSE
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)
        for name, g in g1.items():
            torch.testing.assert_close(g2[name], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
            worst = max(worst, float((g2[name] - g).abs().max()))
    assert any(float(g.abs().max()) > 1e-3 for g in g1.values())  # the gradients are not all ~0
    print(f"max |grad diff| cp=2 vs cp=1: {worst:.2e}")
