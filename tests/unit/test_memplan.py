"""The memory plan on the shipped presets, hand-computed numbers, Megatron-LM's formula, and the
launch hooks (`dapo-megatron plan`, `train`, `slurm submit` and their --skip-plan)."""

import re
import warnings
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.memplan.arch import dims_from_hf_config, model_dims_for
from dapo_megatron.memplan.engine import GIB, engine_memory
from dapo_megatron.memplan.plan import build_plan
from dapo_megatron.memplan.report import check_before_launch, format_plan
from dapo_megatron.memplan.static import Layout, total_params

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "configs" / "runs").glob("*.yaml")) + sorted((REPO / "configs" / "ablations").glob("*.yaml"))
LAST_LINE = re.compile(r"^peak_gb_per_gpu=(\d+\.\d\d) limit_gb=(\S+) fits=(yes|no)$")
Q32 = str(REPO / "configs" / "runs" / "qwen2.5-32b_dapo.yaml")
Q7 = str(REPO / "configs" / "runs" / "qwen2.5-7b_dapo.yaml")
TINY = str(REPO / "configs" / "runs" / "tiny_cpu.yaml")


def _load(path, overrides=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sequence parallel turned off at tp=1
        return load_config(path, list(overrides))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_fits(path, capsys):
    from dapo_megatron.memplan.report import main

    assert main([str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match and match.group(3) == "yes" and float(match.group(1)) <= float(match.group(2)), last


def test_32b_at_tp1_pp1_does_not_fit_and_names_what(capsys):
    from dapo_megatron.memplan.report import main

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main([Q32, "actor.tp=1", "actor.pp=1"])
    assert any("sequence_parallel" in str(w.message) for w in caught)  # the preset's SP is turned off, loudly
    out = capsys.readouterr().out
    assert rc == 1
    assert LAST_LINE.match(out.strip().splitlines()[-1]).group(3) == "no"
    problems = out.split("does not fit:")[1]
    # the fp32 gradient buffer of all 32.76B parameters on every GPU is the largest item of the train phase
    assert "colocated / train" in problems and "actor gradients (fp32 main_grad buffer) 122.05" in problems
    # hand numbers: DP=128, every tensor a multiple of 64 elements and the total a multiple of 128 -> no padding
    plan = build_plan(_load(Q32, ["actor.tp=1", "actor.pp=1"]))
    rows = plan.tables["colocated"][0].rows
    assert total_params(model_dims_for(_load(Q32))) == 32_763_876_352
    assert rows["actor weights (bf16)"]["train"] == 2 * 32_763_876_352
    assert rows["actor gradients (fp32 main_grad buffer)"]["train"] == 4 * 32_763_876_352
    # distributed optimizer over 128 ranks: rank r owns 255,967,784 elements (no padding at this DP size)
    assert rows["actor Adam exp_avg + exp_avg_sq (fp32)"]["train"] == 8 * 32_763_876_352 // 128
    assert rows["actor fp32 master params"]["train"] == 4 * 32_763_876_352 // 128


def test_hand_computed_32b_preset_numbers():
    """Qwen2.5-32B, TP=8 x PP=2, DP=8, bf16, distributed optimizer, full recompute, SP, 24576 tokens."""
    plan = build_plan(_load(Q32))
    table = plan.tables["disaggregated"][0]
    # stage 0: embedding 152064*5120/8 + 32 layers of (2*5120 + 5120*5120/8 + (5120+2*1024)*5120/8 + 7168/8
    #          + 2*27648*5120/8 + 5120*27648/8) = 97,320,960 + 32 * 60,959,616 = 2,047,028,672 elements (all multiples
    #          of 64, the total of lcm(8,128) = 128): weights 2 B, gradients 4 B each
    stage0 = 97_320_960 + 32 * 60_959_616
    assert table.stages["train"] == 0
    assert table.rows["actor weights (bf16)"]["train"] == 2 * stage0
    assert table.rows["actor gradients (fp32 main_grad buffer)"]["train"] == 4 * stage0
    # activations, full recompute: each layer keeps its input [T/tp, h] in bf16; stage 0 holds pp = 2
    # micro-batches of 32 layers, plus the RoPE table [22528, 128] fp32 per micro-batch and the token ids
    per_mb = 32 * 24576 * 5120 * 2 / 8 + 22528 * 128 * 4
    saved = table.rows["activations saved for backward"]["train"]
    assert saved == pytest.approx(2 * per_mb + 2 * 24576 * 8)
    # engine: 32.76B params of which 129 norms of 5120 replicated over engine TP 4, bf16
    e = engine_memory(model_dims_for(_load(Q32)), engine_tp=4, mem_fraction_static=0.7, gpu_bytes=80 * GIB)
    assert e.weights == int(((32_763_876_352 - 129 * 5120) / 4 + 129 * 5120) * 2)
    # KV per token per TP rank: K and V of 64 layers x 2 KV heads x 128 x 2 bytes
    assert e.kv_bytes_per_token == 2 * 64 * 2 * 128 * 2
    assert e.kv_tokens == (int(0.7 * 80 * GIB) - e.weights) // e.kv_bytes_per_token


def test_te_selective_layer_bytes_by_hand():
    """7B preset layer (TE, selective, SP, TP=4), per token: norms 2*(2*2*3584+4)/4 = 7170, attention
    2*(3*3584 + 3*512)/4 = 6144 (RoPE'd q, k, the QKV output kept by v, out), SwiGLU 3*18944*2/4 = 28416."""
    from dapo_megatron.memplan.activations import ActivationModel

    dims = model_dims_for(_load(Q7))
    act = ActivationModel(dims, tp=4, sequence_parallel=True, backend="te", recompute="selective", precision="bf16")
    assert act.layer_parts(tokens=1000) == {"norms": 7_170_000, "attention": 6_144_000, "mlp": 28_416_000}
    none = ActivationModel(dims, tp=4, sequence_parallel=True, backend="te", recompute="none", precision="bf16")
    assert none.saved_per_layer(tokens=1000) == 41_730_000 + 1000 * 4 * 28 / 4  # + fp32 softmax lse per head
    # the unfused logits path keeps three fp32 [N, V/4] tensors; the fused kernel none
    unfused = ActivationModel(dims, tp=4, fused_logprob=False)
    assert unfused.head_parts(response_tokens=10) == {
        "logits path (unfused, 3 x fp32 [N, V/4])": 10 * (2 * 3584 + 12 * 152064 / 4 + 25)
    }


def test_one_pass_head_bytes_by_hand():
    """actor.head_loss=one_pass at the 7B preset's shape (H 3584, V 152,064), bf16, TP=4 (V/4 = 38,016 rows):
    a micro-batch keeps grad_hidden (2 H per response token) + grad_weight (2 V/4 H) + the 8-byte positions, no
    loss terms; the forward's workspace is one chunk's fp32 logits + bf16 dlogits (6 V/4 per row), the TP
    partial of grad_hidden (4 H per row) and, once N exceeds a chunk (512 MiB / (6 x 38,016) = 2353 rows,
    aligned down to 2304), the fp32 grad_weight accumulator (4 V/4 H)."""
    from dapo_megatron.memplan.activations import ActivationModel

    dims = model_dims_for(_load(Q7))
    act = ActivationModel(dims, tp=4, precision="bf16", head_loss="one_pass")
    saved = act.saved(tokens=20, response_tokens=10, layers=0, first=False, last=True)
    assert saved["logits path (head + loss in one pass: grad_hidden + grad_weight kept)"] == (
        10 * (2 * 3584 + 8) + 2 * 38016 * 3584
    )
    assert "loss terms" not in saved
    work = act.backward_working_set(tokens=20, response_tokens=10, last=True, largest_param_numel=1)
    assert work["one-pass head + loss workspace"] == 10 * 38016 * 6 + 10 * 3584 * 4
    assert "fused head backward workspace" not in work
    big = act.backward_working_set(tokens=8192, response_tokens=8192, last=True, largest_param_numel=1)
    assert big["one-pass head + loss workspace"] == 2304 * 38016 * 6 + 2304 * 3584 * 4 + 38016 * 3584 * 4
    with pytest.raises(ValueError, match="actor.head_loss='fused'"):
        ActivationModel(dims, head_loss="fused")


def test_interleaved_first_stage_holds_megatrons_layer_count():
    """Megatron's interleaving penalty: the first stage holds L (1 + (pp-1)/(pp vpp)) layers' activations."""
    from dapo_megatron.memplan.plan import _in_flight

    for pp, vpp in ((2, 2), (4, 2), (4, 4), (8, 3)):
        layers_per_chunk = 1 / (pp * vpp)  # of L
        assert _in_flight(Layout(pp=pp, vpp=vpp), 0) * layers_per_chunk == pytest.approx(1 + (pp - 1) / (pp * vpp))
        assert _in_flight(Layout(pp=pp, vpp=vpp), pp - 1) == (vpp - 1) * pp + 1
    assert [_in_flight(Layout(pp=4), s) for s in range(4)] == [4, 3, 2, 1]  # 1F1B: pp - stage


@pytest.mark.parametrize("path", [Q32, Q7, PRESETS[0]], ids=lambda p: Path(p).name)
def test_static_agrees_with_megatrons_formula(path):
    """Megatron-LM's bytes per parameter (6 + 12/DP with the distributed optimizer, 18 without) on its
    most loaded shard; the plan's exact count differs only by padding and the QKV biases (< 0.1%)."""
    from dapo_megatron.memplan.megatron_reference import comparison_row

    for distributed in ("true", "false"):
        row = comparison_row(_load(path, [f"actor.use_distributed_optimizer={distributed}"]))
        assert row["plan static"] == pytest.approx(row["megatron static"], rel=1e-3)


def test_7b_selective_activations_near_megatrons_formula():
    """Where Megatron's activation formula applies (sequence parallel + selective), the plan is within
    5% on the 7B preset (GQA saves, SwiGLU's wider fc1 output costs: docs/memory.md)."""
    from dapo_megatron.memplan.megatron_reference import comparison_row

    row = comparison_row(_load(Q7))
    assert row["plan activations"] == pytest.approx(row["megatron activations"], rel=0.05)


def test_engine_problems_are_named():
    plan = build_plan(_load(Q32, ["rollout.mem_fraction_static=0.2"]))  # 16 GiB pool, 15.26 GiB of weights
    assert not plan.fits and any("engine KV cache" in p and "less than one sequence" in p for p in plan.problems)
    plan = build_plan(_load(Q32, ["rollout.mem_fraction_static=0.15"]))
    assert any("do not fit in the static pool" in p for p in plan.problems)
    # an A100 40GB: the engine's pool shrinks with the GPU (28 GiB + SGLang's 7.25 GiB reserve: fits), but the
    # 7B preset's 26.8 GiB of selective-recompute activations on top of 13.3 GiB of actor state does not
    plan = build_plan(_load(Q7, ["slurm.gpu_memory_gb=40"]))
    assert not plan.fits and [p.split(" (")[0] for p in plan.problems] == ["colocated / train"]
    assert "largest: activations saved for backward 26.79" in plan.problems[0]
    assert build_plan(_load(Q7, ["slurm.gpu_memory_gb=40", "actor.recompute=full"])).fits


def test_gpu_memory_key_is_validated():
    with pytest.raises(ValueError, match="slurm.gpu_memory_gb"):
        _load(Q7, ["slurm.gpu_memory_gb=0"])
    assert build_plan(_load(Q7, ["slurm.gpu_memory_gb=141"])).limit == 141 * GIB


def test_architecture_sources(tmp_path):
    cfg = _load(Q32)
    assert "committed copy Qwen2.5-32B.json" in model_dims_for(cfg).source
    # a real checkpoint directory wins over the committed copy
    (tmp_path / "Qwen2.5-32B").mkdir()
    (tmp_path / "Qwen2.5-32B" / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,'
        ' "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}'
    )
    cfg.model.path = str(tmp_path / "Qwen2.5-32B")
    assert model_dims_for(cfg).hidden == 64
    cfg.model.path = str(tmp_path / "Unknown-7B")
    with pytest.raises(ValueError, match="Unknown-7B.*not one of the committed architectures"):
        model_dims_for(cfg)
    tiny = model_dims_for(_load(TINY))
    assert (tiny.hidden, tiny.layers, tiny.vocab, tiny.dtype_bytes) == (128, 2, 320, 4)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not modelled"):
        dims_from_hf_config({"model_type": "gpt2"}, name="x", source="x.json")


def test_check_before_launch_one_line_or_the_table():
    lines = []
    check_before_launch(_load(TINY), out=lines.append)
    assert len(lines) == 1 and "fits" in lines[0]
    lines = []
    with pytest.raises(ValueError, match="does not fit: disaggregated / .*--skip-plan"):
        check_before_launch(_load(TINY, ["slurm.gpu_memory_gb=1"]), out=lines.append)
    assert "fits=no" in lines[0] and "trainer runtime" in lines[0]


def test_check_before_launch_skips_an_unmodelled_architecture_and_names_other_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64}')
    cfg = _load(Q7)
    cfg.model.path = str(tmp_path)
    lines = []
    assert check_before_launch(cfg, out=lines.append) is None
    assert lines == [
        f"[plan] not checked: {tmp_path / 'config.json'}: model_type 'deepseek_v3' is not modelled by "
        "the memory plan (supported: qwen2, llama, qwen3, qwen3_moe)"
    ]
    cfg.model.path = str(tmp_path / "Missing-7B")
    with pytest.raises(ValueError, match="memory plan cannot run: model.path: .*Missing-7B.*--skip-plan"):
        check_before_launch(cfg, out=lines.append)


def test_train_runs_the_plan_first_and_skip_plan_skips_it(tmp_path, monkeypatch):
    """`dapo-megatron train` stops before building anything when the plan does not fit."""
    import dapo_megatron.launch.local.launcher as local
    from dapo_megatron.cli import main

    out = tmp_path / "run"
    assert main(["train", TINY, "slurm.gpu_memory_gb=1", f"trainer.output_dir={out}"]) == 2
    # nothing prepared, nothing started: the run directory holds only the console's log (logs/train.log,
    # which keeps the refusal for `dapo-megatron status`) and the launcher's lock file
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".run.lock", "logs", "logs/train.log"]
    assert "the memory plan does not fit" in (out / "logs" / "train.log").read_text().splitlines()[-1]
    started = []
    monkeypatch.setattr(local, "tiny_model_dir", lambda cfg: started.append(cfg) or str(tmp_path))
    monkeypatch.setattr(local.LocalProcesses, "run_foreground", lambda self, name, argv, env=None: 0)
    monkeypatch.setattr(local, "check_prompt_data", lambda cfg, model_dir: "data check stubbed (no tokenizer here)")
    assert (
        main(
            [
                "train",
                TINY,
                "slurm.gpu_memory_gb=1",
                f"trainer.output_dir={out}",
                "rollout.engine_urls=['http://127.0.0.1:1']",
                "--skip-plan",
            ]
        )
        == 0
    )
    assert started  # with --skip-plan the launcher went on (model preparation is stubbed here)


def test_slurm_submit_runs_the_plan_first(tmp_path, capsys):
    from dapo_megatron.cli import main

    out = str(tmp_path / "run")
    cpu = [
        "slurm.gpus_per_node=0",
        "slurm.cpus_per_task=1",
        "slurm.gpu_memory_gb=1",
        f"trainer.output_dir={out}",
        "rollout.placement=colocated",
    ]  # tiny_cpu.yaml is disaggregated: its engine would need --engines
    assert main(["slurm", "submit", TINY, *cpu, "--dry-run"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["slurm", "submit", TINY, *cpu, "--dry-run", "--skip-plan"]) == 0
    # the presets' prompt files (/shared/data) are not on this machine: --skip-data-check
    assert main(["slurm", "submit", Q7, f"trainer.output_dir={out}", "--dry-run", "--skip-data-check"]) == 0
    assert "[plan] config: colocated: peak" in capsys.readouterr().out
    # a sweep checks every rung
    assert (
        main(
            [
                "slurm",
                "submit",
                "--sweep",
                str(REPO / "configs" / "ablations"),
                f"trainer.output_dir={out}",
                "--dry-run",
                "--skip-data-check",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert all(f"[plan] {p.stem}: colocated" in printed for p in (REPO / "configs" / "ablations").glob("*.yaml"))


def test_format_lists_every_phase_and_placement():
    text = format_plan(build_plan(_load(Q32)))
    header = next(line for line in text.splitlines() if line.startswith("  GiB per GPU"))
    assert all(p in header for p in ("rollout", "log-prob", "train", "optimizer step", "transfer"))
    assert (
        "colocated: one GPU" in text and "disaggregated: trainer GPUs" in text and "disaggregated: engine GPUs" in text
    )
    assert LAST_LINE.match(text.splitlines()[-1])
