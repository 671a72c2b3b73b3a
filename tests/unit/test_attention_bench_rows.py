"""The attention rows of the actor benchmark (issue 41): the DAPO-like packing and the FLOPs it is judged by."""

from dapo_megatron.benchmarks.actor import DAPO_PACKING_24K, dapo_packing, flops_per_step, make_mini_batch


def test_dapo_packing_is_14_mixed_sequences_filling_the_micro_batch():
    assert dapo_packing(24576) == list(DAPO_PACKING_24K)
    assert sum(DAPO_PACKING_24K) == 24576 and len(DAPO_PACKING_24K) == 14
    assert min(DAPO_PACKING_24K) == 256 and max(DAPO_PACKING_24K) == 8192
    small = dapo_packing(1024)  # scaled: 8192 * 1024 / 24576 = 341.3 -> 341, ...; the last takes the rest
    assert sum(small) == 1024 and len(small) == 14 and small[0] == 341


def test_dapo_micro_batch_samples_and_attention_flops_by_hand():
    samples = make_mini_batch(tokens_per_mb=24576, seqs_per_mb=1, num_mb=1, dp=1, vocab=100, seed=0,
                              lengths=dapo_packing(24576))  # fmt: skip
    assert [s.num_tokens for s in samples] == list(DAPO_PACKING_24K)
    assert all(len(s.prompt_ids) == min(256, s.num_tokens // 2) for s in samples)
    # attention term 6 * layers * hidden * sum L^2: sum L^2 = 100,532,224 for this packing (vs 603,979,776 for
    # one 24,576-token document: 6.0x fewer attention FLOPs); with no parameters only that term is left
    assert sum(n * n for n in DAPO_PACKING_24K) == 100_532_224
    assert flops_per_step(samples, num_params=0, hidden=1536, layers=28) == 6.0 * 28 * 1536 * 100_532_224
