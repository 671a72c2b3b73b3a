"""trainer/console.py: the step table (fixed columns, <= 120 characters), start-up phase lines, the warning
filters and the closing summary of a run.

    pytest tests/unit/test_console.py
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

from dapo_megatron.trainer import console
from dapo_megatron.trainer.console import LEGEND, STEP_COLUMNS, TABLE_WIDTH, Phases, StepTable
from dapo_megatron.trainer.metrics_log import run_summary

# every column filled, with values as a 32B run makes them (512 of 1536 groups, 20K tokens)
FULL = {
    "reward/mean": -1.234,
    "acc/mean": 0.5,
    "eval/avg@k": 0.713,
    "response_length/mean": 16384.5,
    "actor/entropy": 1.441,
    "actor/clipfrac_high": 0.0012,
    "actor/approx_kl": 0.00123,
    "actor/grad_norm": 12.5,
    "sampler/groups_kept": 512,
    "sampler/groups_seen": 1536,
    "mismatch/max": 4.9e-05,
    "mismatch/k3": 1.1e-10,
    "throughput/rollout_tok_s": 11234.5,
    "time/gen_s": 812.3,
    "time/train_s": 1204.7,
    "time/sync_s": 21.4,
    "time/step_s": 2047.9,
}


def test_rows_keep_the_same_columns_and_fit_120_characters():
    out = io.StringIO()
    table = StepTable(total_steps=400, out=out)
    table.print_row(0, {"eval/avg@k": 0.245, "eval/pass@k": 0.94})  # the step-0 eval alone
    table.print_row(1, FULL)
    table.print_row(2, {k: v for k, v in FULL.items() if not k.startswith("eval/")})
    legend, header, row0, row1, row2 = out.getvalue().splitlines()
    assert legend == LEGEND and len(LEGEND) <= TABLE_WIDTH  # says what "groups", "mism", "mis_kl", "tok/s" are
    assert header.split() == ["step"] + [h for _, h, _, _ in STEP_COLUMNS]
    assert max(map(len, (header, row0, row1, row2))) <= TABLE_WIDTH
    # every row has a cell under every header: same number of fields, "-" where a value is missing
    assert row0.split() == ["0/400", "-", "-", "24.5%"] + ["-"] * (len(STEP_COLUMNS) - 3)
    assert row1.split() == [
        "1/400",
        "-1.234",
        "50.0%",
        "71.3%",
        "16384.5",
        "1.441",
        "0.001",
        "1.2e-03",
        "12.50",
        "512/1536",
        "5e-05",
        "1e-10",
        "11.2K",  # rollout tokens per second (time/sync_s: in metrics.jsonl, not a column)
        "812.3",
        "1204.7",
        "2047.9",
    ]
    assert row2.split()[3] == "-" and len(row2.split()) == len(row1.split())
    # right-aligned cells end where their header ends
    for name in ("eval", "groups", "tok/s", "step_s"):
        assert row1.index(row1.split()[header.split().index(name)]) + len(
            row1.split()[header.split().index(name)]
        ) == header.index(name) + len(name)


def test_header_repeats_every_20_rows_and_entropy_falls_back_to_the_old_policy_value():
    out = io.StringIO()
    table = StepTable(total_steps=40, out=out)
    for step in range(1, 42):
        table.print_row(step, {"actor/entropy_old": 0.5})
    lines = out.getvalue().splitlines()[1:]  # below the legend
    assert [i for i, line in enumerate(lines) if line.split()[0] == "step"] == [0, 21, 42]
    assert lines[1].split()[5] == "0.500"
    assert table.format_row(3, {"actor/entropy": 0.25, "actor/entropy_old": 0.5}).split()[5] == "0.250"


def test_phase_lines_one_per_phase_and_a_note_only_for_slow_ones():
    out = io.StringIO()
    phases = Phases(out=out)
    with phases.phase("model", slow_note="building", slow_after_s=60) as note:
        note["detail"] = "cached"
    with phases.phase("rollout", slow_note="starting engines", slow_after_s=0.0) as note:
        import time

        time.sleep(0.3)
        note["detail"] = "1 CPU engine"
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[train] model: cached (") and lines[0].endswith(" s)")
    assert lines[1] == "[train] rollout: starting engines ..."
    assert lines[2].startswith("[train] rollout: 1 CPU engine (")
    assert set(phases.seconds) == {"model", "rollout"} and phases.seconds["rollout"] >= 0.3


def test_megatron_fallback_warnings_are_filtered_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_backend_warnings()
        warnings.warn_explicit(
            "Apex is not installed. Falling back to Torch Norm",
            UserWarning,
            "gpt_layer_specs.py",
            70,
            module="megatron.core.models.gpt.gpt_layer_specs",
        )
        warnings.warn_explicit(
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            UserWarning,
            "__init__.py",
            24,
            module="megatron.core.optimizer",
        )
        warnings.warn_explicit(
            "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
            UserWarning,
            "transformer_config.py",
            1705,
            module="megatron.core.transformer.transformer_config",
        )
        warnings.warn_explicit(
            "Apex is not installed. Falling back to Torch Norm", UserWarning, "x.py", 1, module="someone_else"
        )  # the same words from another package still show
        warnings.warn_explicit("something megatron says that matters", UserWarning, "y.py", 2, module="megatron.core")
    assert [str(w.message) for w in caught] == [
        "Apex is not installed. Falling back to Torch Norm",
        "something megatron says that matters",
    ]
    from transformers.utils import logging as hf_logging

    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()


def _run_dir(tmp_path):
    records = [{"step": 0, "eval/avg@k": 0.245, "eval/pass@k": 0.94, "eval/k": 8.0, "time/eval_s": 1.5}]
    for step in range(1, 5):
        records.append(
            {
                "step": step,
                "time/gen_s": 0.25 * step,
                "time/logprob_s": 0.1,
                "time/train_s": 0.2,
                "time/sync_s": 0.05,
                "time/step_s": 0.25 * step + 0.35,
            }
        )
    records[2].update({"eval/avg@k": 0.80, "eval/pass@k": 0.99, "eval/k": 8.0, "time/eval_s": 1.0})
    records[4].update({"eval/avg@k": 0.78, "eval/pass@k": 0.97, "eval/k": 8.0, "time/eval_s": 1.25})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "curves.png").write_bytes(b"png")
    for step in (2, 4):
        path = tmp_path / "checkpoints" / f"step_{step:06d}"
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text("{}")
    return tmp_path


def test_a_summary_whose_last_eval_is_older_than_the_last_step_says_so(tmp_path):
    """A run's final eval is its last step's (trainer/evaluation/evaluator.py); one that is not (a run from
    before that rule, a missed eval) is named as an older step's, the warm start as not trained."""
    run = _run_dir(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("eval/avg@k", "eval/pass@k", "eval/k"):
        del records[4][key]  # step 4 trained, its eval missed: step 2's is the newest
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = run_summary(run).splitlines()
    assert "  final eval:   avg@8 80.0% at step 2, pass@8 99.0% (step 2, not the last trained step 4)" in lines
    for record in records[1:]:
        record.pop("eval/avg@k", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "at step 0, pass@8 " in (line := next(x for x in run_summary(run).splitlines() if "final eval" in x))
    assert line.endswith("(warm start (step 0): not the trained policy)")


def test_summary_says_where_things_are_and_how_the_run_went(tmp_path):
    run = _run_dir(tmp_path)
    text = run_summary(run, phase_seconds={"model": 2.0, "rollout": 5.5}, ranks_wall_s=20.0, wall_s=75.0)
    lines = text.splitlines()
    assert lines[0] == f"[train] done. run directory: {run}"
    assert f"  curves:       {run / 'curves.png'}" in lines
    assert f"  metrics:      {run / 'metrics.jsonl'} (5 records)" in lines
    assert "  final eval:   avg@8 78.0% at step 4, pass@8 97.0%" in lines
    assert "  best eval:    avg@8 80.0% at step 2 (step 0: 24.5%, 3 evals)" in lines
    assert f"  checkpoints:  step_000002, step_000004 in {run / 'checkpoints'}" in lines
    # generate 0.25 * (1+2+3+4) = 2.5 s, log-probs 4 * 0.1, train 4 * 0.2, sync 4 * 0.05, eval 1.5+1+1.25 = 3.75;
    # other = 20 - (2.5 + 0.4 + 0.8 + 0.2 + 3.75) = 12.35
    assert "  time:         start-up: model 2.0 s, rollout 5.5 s" in lines
    assert (
        "                ranks: generate 2.5 s, log-probs 0.4 s, train 0.8 s, weight sync 0.2 s, eval 3.8 s, "
        "other 12.3 s"
    ) in lines
    # the summary's own text fits 120 columns; a line naming a path is as long as the path (under
    # pytest-xdist tmp_path is longer: .../popen-gw0/...)
    assert max(len(line) for line in lines[1:] if str(run) not in line) <= 120
    # step times 0.6, 0.85, 1.1, 1.35: 3.9 s in all, median (upper) 1.1
    assert "  steps:        4 in 3.9 s (median 1.10 s per step); whole command 1 min 15.0 s" in lines


def test_summary_of_a_run_without_evals_or_checkpoints(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time/step_s": 2.0}\n')
    text = run_summary(tmp_path)
    assert "  eval:         none logged (trainer.eval_every=0?)" in text
    assert "  checkpoints:  none" in text and "  curves:       (not written)" in text


def test_megatrons_cuda_device_max_connections_hint_is_filtered_as_megatron_words_it():
    """The exact messages of megatron-core's tensor-parallel layers (read from its source, so a changed
    wording fails here rather than printing again on every rank of `check-parity --tp 2`)."""
    import re

    from megatron.core.tensor_parallel import layers

    source = Path(layers.__file__).read_text()
    messages = [
        "".join(re.findall(r'"([^"]*)"', block))
        for block in re.findall(r"warnings\.warn\(\s*((?:\"[^\"]*\"\s*)+)\)", source)
        if "CUDA_DEVICE_MAX_CONNECTIONS" in block
    ]
    assert len(messages) == 2, messages  # sequence parallelism, async grad allreduce
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_backend_warnings()
        for message in messages:
            warnings.warn_explicit(
                message, UserWarning, "layers.py", 730, module="megatron.core.tensor_parallel.layers"
            )
    assert caught == []


def test_the_actor_line_names_every_parallel_size_in_use():
    from dapo_megatron.config import Config

    cfg = Config()
    cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, cfg.actor.precision = 2, 2, 3, "bf16"
    out = io.StringIO()
    console.actor_ready(cfg, out=out)  # no process group here: one rank, DP 1
    assert out.getvalue().startswith("[train] actor: 1 Megatron rank (TP 2 x PP 2 (VPP 3) x DP 1, bf16, none), ready ")
    cfg.actor.pp, cfg.actor.vpp, cfg.actor.cp = 1, None, 2
    out = io.StringIO()
    console.actor_ready(cfg, out=out)
    assert "(TP 2 x PP 1 x CP 2 x DP 1, bf16, none)" in out.getvalue()
