"""One eval as a file a researcher can check: the summary with its interval, one record per problem,
the metrics logged from it, and the paired comparison of two evals on the same problems.

    report  = eval_report(samples, records, step=120, name="aime24")  # one set (evaluation/sampling.py samples)
    metrics = report_metrics(report, prefix="eval/aime24/")            # what metrics.jsonl logs: the same numbers
    write_eval_file(path, {"aime24": report, "math500": other})        # <run_dir>/evals/step_000120.json
    sets    = load_eval_sets("RUN_DIR or FILE.json")                   # name -> report (a run: its newest eval)
    rows    = compare_evals(sets_a, sets_b)                            # avg@k difference, paired-bootstrap interval

A file holds one set's report at its top level (the default single eval set: `avg@k`, `pass@k`, ...
as `dapo-megatron eval` has always written them), or {"step": N, "sets": {name: report}} for several
sets (data.eval_sets). A report: step, set, k, num_prompts, avg@k, avg@k_ci95 [low, high], maj@k,
pass@j for j = 1, 2, 4, ... < k and pass@k (= pass@<k>), the bootstrap settings, and `problems`:
index, data_source, prompt_hash, ground_truth, n, correct, answers {answer: count}, mean response
tokens, truncated. The maths is algo/eval_stats.py (docs/algorithm.md, "Evaluation").
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeAlias, TypedDict

import torch

from dapo_megatron.algo.eval_stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    CI_LEVEL,
    bootstrap_mean_ci,
    majority_correct,
    paired_bootstrap_diff,
    pass_at_k,
    pass_ks,
)
from dapo_megatron.config import RawJson
from dapo_megatron.data.datasets import DEFAULT_EVAL_SET as DEFAULT_SET
from dapo_megatron.reward.math_dapo import INVALID

__all__ = [
    "eval_report",
    "report_metrics",
    "write_eval_file",
    "read_eval_file",
    "load_eval_sets",
    "compare_evals",
    "eval_file_path",
    "headline_avg",
    "DEFAULT_SET",
]

METHOD = "percentile bootstrap over problems"
SUMMARY_KEYS = ("k", "num_prompts", "avg@k", "avg@k_ci95", "maj@k")  # and every pass@j


class ProblemRecord(TypedDict):
    """One problem of an eval set: what it was, and how its n samples did."""

    index: int
    data_source: str
    prompt_hash: str  # prompt_hash(): two evals compare only on equal problems
    ground_truth: str
    n: int
    correct: int  # of the n samples
    answers: dict[str, int]  # extracted answer -> how many samples gave it, most common first
    mean_response_tokens: float
    truncated: int  # samples cut at rollout.max_response_length


class CompareRow(TypedDict):
    """compare_evals' verdict on one eval set present in both evals."""

    set: str
    num_prompts: int
    k_a: int
    k_b: int
    avg_a: float
    avg_b: float
    diff: float  # avg_b - avg_a
    diff_ci95: list[float]  # [low, high], paired bootstrap over problems
    verdict: str  # algo/eval_stats.py paired_bootstrap_diff: "B better", "B worse", "no clear difference"


# One eval set's report as the file holds it (the module's docstring lists its keys): parsed JSON, since
# its pass@j keys follow from k (a TypedDict names fixed keys only); `problems` holds ProblemRecords.
EvalReport: TypeAlias = RawJson

TIE_RULE = "a tie scores the fraction of the tied answers that are correct; [INVALID] (no answer) does not vote"


def prompt_hash(record) -> str:
    """12 hex digits naming a problem by its chat and ground truth: two evals compare only on equal problems."""
    chat = (
        record.chat() if hasattr(record, "chat") else [{"role": "user", "content": str(getattr(record, "prompt", ""))}]
    )
    text = json.dumps({"chat": chat, "ground_truth": str(getattr(record, "ground_truth", ""))}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def eval_report(
    samples,
    records: Sequence,
    *,
    step: int,
    name: str = DEFAULT_SET,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> EvalReport:
    """The report of one eval set from its EvalSamples (row i = records[i])."""
    correct = samples.correct
    num_problems, n = correct.shape
    if num_problems != len(records):
        raise ValueError(f"eval report: {num_problems} rows of samples for {len(records)} problems")
    per_problem = correct.mean(dim=1)
    low, high = bootstrap_mean_ci(per_problem, resamples=resamples, seed=seed)
    report: EvalReport = {
        "step": int(step),
        "set": name,
        "k": int(n),
        "num_prompts": int(num_problems),
        "avg@k": float(per_problem.mean()),
        "avg@k_ci95": [low, high],
    }
    report["maj@k"] = (
        sum(majority_correct(a, c, abstain=INVALID) for a, c in zip(samples.answers, correct.tolist())) / num_problems
    )
    for j in pass_ks(n):
        report[f"pass@{j}"] = float(pass_at_k(correct, k=j).mean())
    report["pass@k"] = report[f"pass@{n}"]
    report["interval"] = {"method": METHOD, "resamples": int(resamples), "seed": int(seed), "level": CI_LEVEL}
    report["maj_tie_rule"] = TIE_RULE
    tokens = samples.response_tokens.to(torch.float64)
    report["problems"] = [
        ProblemRecord(
            index=i,
            data_source=str(getattr(r, "data_source", "")),
            prompt_hash=prompt_hash(r),
            ground_truth=str(getattr(r, "ground_truth", "")),
            n=int(n),
            correct=int(round(float(correct[i].sum()))),
            answers=dict(Counter(samples.answers[i]).most_common()),
            mean_response_tokens=float(tokens[i].mean()),
            truncated=int(samples.truncated[i].sum()),
        )
        for i, r in enumerate(records)
    ]
    return report


def report_metrics(report: EvalReport, *, prefix: str = "eval/") -> dict[str, float]:
    """Every scalar of the report's summary under `prefix` (eval/avg@k, eval/pass@k, eval/maj@k, ...),
    the interval as <prefix>avg@k_ci95_low / _high: metrics.jsonl and the file carry the same numbers."""
    out = {}
    for key, value in report.items():
        if key not in SUMMARY_KEYS and not key.startswith("pass@"):
            continue  # step, set, the settings, problems; a single-set file's extras (checkpoint, temperature)
        if key == "avg@k_ci95":
            out[f"{prefix}avg@k_ci95_low"], out[f"{prefix}avg@k_ci95_high"] = float(value[0]), float(value[1])
        else:
            out[f"{prefix}{key}"] = float(value)
    return out


def metric_prefix(name: str, *, num_sets: int) -> str:
    """eval/ for a run's only set (today's names), eval/<name>/ with several."""
    return "eval/" if num_sets == 1 else f"eval/{name}/"


def headline_avg(metrics: Mapping[str, float], set_names: Sequence[str] = ()) -> float | None:
    """The one avg@k that picks the best checkpoint: eval/avg@k, else the first set's eval/<name>/avg@k."""
    if "eval/avg@k" in metrics:
        return metrics["eval/avg@k"]
    for name in set_names:
        if f"eval/{name}/avg@k" in metrics:
            return metrics[f"eval/{name}/avg@k"]
    return None


def eval_file_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "evals" / f"step_{step:06d}.json"


def write_eval_file(path: str | Path, reports: dict[str, EvalReport], extra: RawJson | None = None) -> Path:
    """Write one eval's reports atomically (a half-written file never looks finished); extra fields
    (checkpoint, sampling settings) go at the top level."""
    path = Path(path)
    if len(reports) == 1:
        (report,) = reports.values()
        data = {**(extra or {}), **report}
    else:
        data = {**(extra or {}), "step": next(iter(reports.values()))["step"], "sets": reports}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def read_eval_file(path: str | Path) -> dict[str, EvalReport]:
    """name -> report of an eval file (either layout)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"eval file {path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"eval file {path}: expected a JSON object")
    sets = data["sets"] if isinstance(data.get("sets"), dict) else {str(data.get("set", DEFAULT_SET)): data}
    for name, report in sets.items():
        if not isinstance(report.get("problems"), list):
            raise ValueError(
                f"eval file {path}: set {name!r} has no per-problem records ('problems'); it was written "
                "before evals kept them: evaluate the checkpoint again with `dapo-megatron eval`"
            )
    return sets


def load_eval_sets(where: str | Path) -> tuple[Path, dict[str, EvalReport]]:
    """(file, name -> report) of an eval file, or of a run directory's newest evals/step_N.json."""
    path = Path(where)
    if path.is_dir():
        files = sorted((path / "evals").glob("step_*.json"))
        if not files:
            raise ValueError(
                f"{path}: a directory without eval files ({path / 'evals'}/step_N.json); "
                "name an eval JSON file or a run directory whose run evaluated"
            )
        path = files[-1]
    elif not path.is_file():
        raise ValueError(f"{path}: neither an eval JSON file nor a run directory")
    return path, read_eval_file(path)


def compare_evals(
    a: dict[str, EvalReport], b: dict[str, EvalReport], *, where_a: str = "A", where_b: str = "B"
) -> list[CompareRow]:
    """Per eval set present in both: avg@k of A and of B, B - A with its paired-bootstrap interval and
    verdict. Refuses (ValueError) when a set's problems differ (count, order or content)."""
    common = [name for name in a if name in b]
    if not common:
        raise ValueError(f"{where_a} has eval sets {sorted(a)} and {where_b} has {sorted(b)}: none in common")
    rows = []
    for name in common:
        pa, pb = a[name]["problems"], b[name]["problems"]
        ha, hb = [p.get("prompt_hash") for p in pa], [p.get("prompt_hash") for p in pb]
        if ha != hb:
            if len(ha) != len(hb):
                why = f"{len(ha)} problems in {where_a}, {len(hb)} in {where_b}"
            else:
                first = next(i for i, (x, y) in enumerate(zip(ha, hb)) if x != y)
                why = f"problem {first} differs (prompt_hash {ha[first]} vs {hb[first]})"
            raise ValueError(
                f"eval set {name!r}: {where_a} and {where_b} were not evaluated on the same problems "
                f"({why}); a paired comparison needs the same problems in the same order"
            )
        acc_a = [p["correct"] / p["n"] for p in pa]
        acc_b = [p["correct"] / p["n"] for p in pb]
        diff = paired_bootstrap_diff(acc_a, acc_b)
        rows.append(
            CompareRow(
                set=name,
                num_prompts=len(pa),
                k_a=a[name]["k"],
                k_b=b[name]["k"],
                avg_a=sum(acc_a) / len(acc_a),
                avg_b=sum(acc_b) / len(acc_b),
                diff=float(diff["diff"]),  # paired_bootstrap_diff's numbers are floats, its verdict a str
                diff_ci95=[float(diff["low"]), float(diff["high"])],
                verdict=str(diff["verdict"]),
            )
        )
    return rows
