"""Actor.save / Actor.load on gloo ranks: save after step 0, a fresh actor loads it, and its step-1
loss and weights are bit-identical to an uninterrupted run; an interrupted save leaves the previous
checkpoint in place."""

import pytest
import torch

from helpers_actor import fill_rl_fields, hf_logprobs, make_cfg, make_samples


def _resume_rank(hf_dir, batches, ckpt_dir):
    import multiprocessing

    import dapo_megatron.actor.checkpoint as ckpt_module

    # dist_checkpointing's writer starts a multiprocessing Manager (one helper process per rank);
    # the test pool's ranks are daemonic processes, which multiprocessing forbids to have children.
    # torchrun / srun ranks are not daemonic: lift the flag for this rank.
    multiprocessing.current_process()._config["daemon"] = False
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    def weights(actor):
        return {k: v.clone() for k, v in actor.iter_hf_weights()}

    cfg = make_cfg(micro_batch_tokens=40, lr=1e-3, warmup_steps=3)
    with model_parallel(tp=1, seed=7) as layout:  # DP=2, distributed optimizer
        first = Actor(actor_settings(cfg), hf_dir, layout)
        first.train(batches[0], step=0)
        first.save(ckpt_dir)
        saved = weights(first)
        uninterrupted = first.train(batches[1], step=1)
        after = weights(first)
        # an interrupted save: rank 0 dies between writing <dir>.tmp and publishing it
        real_publish = ckpt_module._publish
        ckpt_module._publish = lambda tmp, final: (_ for _ in ()).throw(OSError("killed before rename"))
        try:
            first.save(ckpt_dir)
            interrupted = "no error"
        except (OSError, RuntimeError) as err:
            interrupted = str(err)
        finally:
            ckpt_module._publish = real_publish
        del first
    with model_parallel(tp=1, seed=99) as layout:  # a different seed: RNG state must come from the checkpoint
        second = Actor(actor_settings(cfg), hf_dir, layout)
        meta = second.load(ckpt_dir)
        loaded = weights(second)
        resumed = second.train(batches[1], step=1)
        after_resume = weights(second)
    return dict(
        saved=saved,
        loaded=loaded,
        after=after,
        after_resume=after_resume,
        meta=meta,
        uninterrupted=uninterrupted,
        resumed=resumed,
        interrupted=interrupted,
    )


def test_resume_gives_a_bit_identical_next_step_and_an_interrupted_save_keeps_the_old_checkpoint(rank_pool, tmp_path):
    from helpers_tiny import save_tiny_hf

    hf_dir = str(save_tiny_hf(tmp_path / "qwen", arch="qwen2"))
    batches = []
    for seed in (11, 12):
        samples = make_samples(8, seed=seed)
        logps, _ = hf_logprobs(hf_dir, samples)
        batches.append(fill_rl_fields(samples, logps, seed=seed))
    ckpt = str(tmp_path / "ckpt" / "step_0")
    results = rank_pool(2).run(_resume_rank, hf_dir, batches, ckpt)
    for r in results:
        assert r["meta"]["num_updates"] == 1 and r["meta"]["last_step"] == 0
        assert r["interrupted"] == "killed before rename" or "failed to publish" in r["interrupted"]
        # the interrupted save did not replace step 0's checkpoint: it loads the step-0 weights
        for name, w in r["saved"].items():
            assert torch.equal(r["loaded"][name], w), name
        for key in ("loss", "pg_loss", "grad_norm", "lr", "clipfrac_low", "clipfrac_high", "entropy"):
            assert r["resumed"][key] == r["uninterrupted"][key], key
        assert r["resumed"]["lr"] == pytest.approx(1e-3 * 2 / 3)  # warm-up step 1 of 3
        for name, w in r["after"].items():
            assert torch.equal(r["after_resume"][name], w), name
        assert any(not torch.equal(r["after"][n], r["saved"][n]) for n in r["saved"])
    assert (tmp_path / "ckpt" / "step_0" / "actor_state.json").is_file()
    assert (tmp_path / "ckpt" / "step_0.tmp").is_dir()  # the interrupted save's leftovers, never loaded
