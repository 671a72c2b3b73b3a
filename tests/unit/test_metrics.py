"""trainer/metrics_log.py: JSONL round trip, console table, resume truncation, wandb offline files, PNG curves."""

import io

import pytest
import torch

from dapo_megatron.trainer.metrics_log import MetricsLogger, build_figure, plot_main, plot_run, read_jsonl


def _steps():
    return [
        {"reward/mean": -0.5, "acc/mean": 0.25, "response_length/mean": 11.5, "actor/grad_norm": torch.tensor(0.75)},
        {
            "reward/mean": 0.0,
            "acc/mean": 0.5,
            "response_length/mean": 11.0,
            "actor/grad_norm": 0.5,
            "eval/avg@k": 0.625,
            "eval/pass@k": 0.875,
        },
        {"reward/mean": 0.5, "acc/mean": 0.75, "response_length/mean": 10.5, "actor/grad_norm": float("nan")},
    ]


def test_jsonl_round_trip_and_console(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=out)
    for step, m in enumerate(_steps(), start=1):
        logger.log(step, m)
    logger.close(plot=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0] == {
        "step": 1,
        "reward/mean": -0.5,
        "acc/mean": 0.25,
        "response_length/mean": 11.5,
        "actor/grad_norm": 0.75,
    }  # the 0-dim tensor became a float
    assert records[1]["eval/avg@k"] == 0.625
    assert records[2]["actor/grad_norm"] == "nan"  # JSON has no NaN: kept visible as a string
    lines = out.getvalue().splitlines()[1:]  # below the legend (tests/unit/test_console.py)
    # one header, then one row per step with the same columns whether or not the step evaluated
    # (the table itself: tests/unit/test_console.py)
    assert len(lines) == 4 and lines[0].split()[:4] == ["step", "reward", "acc", "eval"]
    # groups, mism, mis_kl, tok/s and the three times: not logged by this test (entropy, clip_hi, kl neither)
    dash = ["-"] * 7
    assert lines[1].split() == ["1", "-0.500", "25.0%", "-", "11.5", "-", "-", "-", "0.75"] + dash
    assert lines[2].split() == ["2", "+0.000", "50.0%", "62.5%", "11.0", "-", "-", "-", "0.50"] + dash
    assert lines[3].split() == ["3", "+0.500", "75.0%", "-", "10.5", "-", "-", "-", "nan"] + dash


def test_resume_drops_steps_after_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=None)
    for step in range(1, 5):
        logger.log(step, {"acc/mean": step / 10})
    logger.close(plot=False)
    # the run stopped after writing step 4 but its last checkpoint is step 2
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=None, resume_step=2)
    logger.log(3, {"acc/mean": 0.33})
    logger.close(plot=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["acc/mean"]) for r in records] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    # a fresh (not resumed) run in the same directory starts a new file
    MetricsLogger(tmp_path, wandb_mode="disabled", console=None).close(plot=False)
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_read_jsonl_names_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "acc/mean": 0.5}\n{"step": 2, "acc/mean": \n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_jsonl(path)


def test_resume_drops_a_partial_last_line_and_says_so(tmp_path):
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=None)
    for step in range(1, 4):
        logger.log(step, {"acc/mean": step / 10})
    logger.close(plot=False)
    path = tmp_path / "metrics.jsonl"
    full = path.read_bytes()
    path.write_bytes(full[:-9])  # a process killed in the middle of writing step 3's line
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=out, resume_step=2)
    logger.log(3, {"acc/mean": 0.33})
    logger.close(plot=False)
    assert "metrics.jsonl: dropped line 3, a partial record with no newline" in out.getvalue()
    assert [(r["step"], r["acc/mean"]) for r in read_jsonl(path)] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    # a broken line in the middle is still an error naming it, on resume too
    text = path.read_text().splitlines(keepends=True)
    path.write_text(text[0] + text[1][:-8] + "\n" + text[2])
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        MetricsLogger(tmp_path, wandb_mode="disabled", console=None, resume_step=3)
    # a last line that is complete JSON without its newline is kept
    path.write_text(text[0] + text[1].rstrip("\n"))
    assert [r["step"] for r in read_jsonl(path, drop_partial_last=True)] == [1, 2]


def test_wandb_offline_writes_run_files(tmp_path):
    logger = MetricsLogger(
        tmp_path, wandb_mode="offline", wandb_project="test", config={"trainer": {"lr": 1e-3}}, console=None
    )
    logger.log(1, {"acc/mean": 0.25})
    logger.log(2, {"acc/mean": 0.5})
    logger.close(plot=False)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # under the run directory, ready for `wandb sync`
    (log,) = runs[0].glob("run-*.wandb")  # wandb's record log: history rows hold key and JSON value
    # wandb-core (a separate process) may still be flushing the file when finish() returns on a
    # loaded machine: wait for the rows, bounded, then check their contents
    import time

    deadline = time.monotonic() + 60
    data = log.read_bytes()
    while b"0.5" not in data and time.monotonic() < deadline:
        time.sleep(0.5)
        data = log.read_bytes()
    assert b"acc/mean" in data and b"0.25" in data and b"0.5" in data


def test_wandb_closes_without_repeating_the_summary_on_stderr(tmp_path, capfd):
    """wandb's closing block (history sparklines and summary, ~34 lines) repeated the run's own summary
    on stderr; quiet, the close is one line on the console naming the sync command."""
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, wandb_mode="offline", wandb_project="test", console=out)
    logger.log(1, {"acc/mean": 0.25, "reward/mean": -0.5})
    logger.log(2, {"acc/mean": 0.5, "reward/mean": 0.0})
    logger.close(plot=False)
    captured = capfd.readouterr()
    both = captured.out + captured.err
    assert "Run history" not in both and "Run summary" not in both
    (closing,) = [line for line in out.getvalue().splitlines() if line.startswith("wandb:")]
    assert "wandb sync " in closing and str(tmp_path / "wandb") in closing


def test_png_has_the_logged_series(tmp_path):
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", console=None)
    for step, m in enumerate(_steps(), start=1):
        logger.log(step, m)
    png = logger.close()  # close() writes curves.png
    assert png == tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    fig = build_figure(read_jsonl(tmp_path / "metrics.jsonl"))
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(panels) == {"accuracy", "reward", "response length"}  # panels without data are left out
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in panels["accuracy"].get_lines()}
    assert lines["train acc (kept groups)"] == ([1, 2, 3], [0.25, 0.5, 0.75])
    assert lines["eval avg@k"] == ([2], [0.625])
    assert lines["eval pass@k"] == ([2], [0.875])
    reward = panels["reward"].get_lines()[0]
    assert list(reward.get_ydata()) == [-0.5, 0.0, 0.5]

    out = tmp_path / "other.png"
    assert plot_main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_metrics_raises(tmp_path):
    with pytest.raises(ValueError, match="no metrics file"):
        plot_run(tmp_path)
