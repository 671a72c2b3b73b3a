r"""Reward-scoring throughput: math_dapo on 10,000 responses of ~20K tokens (~80K characters) each.

    dapo-megatron bench reward                       # defaults: 10000 responses x 80000 chars, 3 repeats
    dapo-megatron bench reward --num 1000 --chars 8000 --repeats 5 --results-dir /tmp/bench

Responses are slices of one deterministic pseudo-text pool (so only one response is alive at a time)
with an answer tail that varies: correct, wrong, \boxed{}, $1,234$ thousands commas, `x = 5`, none.
Only the score() calls are timed. Prints a table and appends one row per run to
<--results-dir>/reward.csv (default ./results/reward.csv; dapo_megatron/benchmarks/run.py) with the columns
kernel,provider,mode,metric,unit,x,p50,p20,p80,device,date (x = characters per response,
p50/p20/p80 over the repeats of the seconds for all responses).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import time
from pathlib import Path

from dapo_megatron.benchmarks.run import add_output_args, append_rows, results_csv
from dapo_megatron.reward.math_dapo import score

CSV_FIELDS = ["kernel", "provider", "mode", "metric", "unit", "x", "p50", "p20", "p80", "device", "date"]
WORDS = (
    "the",
    "so",
    "we",
    "get",
    "then",
    "therefore",
    "let",
    "x",
    "=",
    "+",
    "-",
    "\\frac{1}{2}",
    "$",
    "sum",
    "of",
    "is",
    "12",
    "7",
    "\\cdot",
    "(",
    ")",
    "\n",
    "Wait,",
    "check:",
    "answer",
    "step",
    "\\boxed{3}",
)
TAILS = (
    ("\nAnswer: {a}", True),
    ("\nAnswer: {b}", False),
    ("\nAnswer: \\boxed{{{a}}}", True),
    ("\nAnswer: ${a:,}$", True),
    ("\nSo x = {a}.\nAnswer: x = {a}", True),
    ("\nI am not sure about the last step.", False),
)


def _pool(num_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_chars:
        word = rng.choice(WORDS)
        parts.append(word + " ")
        size += len(word) + 1
    return "".join(parts)


def _responses(num: int, chars: int, seed: int):
    """Yields (response, ground truth, expected acc) one at a time."""
    pool = _pool(chars + 65_536, seed)
    rng = random.Random(seed + 1)
    for i in range(num):
        answer = rng.randint(1, 10**6)
        tail_fmt, correct = TAILS[i % len(TAILS)]
        tail = tail_fmt.format(a=answer, b=answer + 1)
        start = rng.randrange(0, len(pool) - chars)
        yield pool[start : start + chars - len(tail)] + tail, str(answer), correct


def _device() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def run_once(num: int, chars: int, seed: int) -> tuple[float, int]:
    seconds, wrong_verdicts = 0.0, 0
    for response, truth, correct in _responses(num, chars, seed):
        t0 = time.perf_counter()
        result = score(response, truth)
        seconds += time.perf_counter() - t0
        wrong_verdicts += result.acc != correct
    return seconds, wrong_verdicts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dapo-megatron bench reward", description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=10_000, help="responses per repeat")
    parser.add_argument("--chars", type=int, default=80_000, help="characters per response (~4 per token)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser, name="reward")
    args = parser.parse_args(argv)
    if args.num < 1 or args.chars < 100 or args.repeats < 1:
        raise ValueError(
            "bench reward: need --num >= 1, --chars >= 100, --repeats >= 1 "
            f"(got {args.num}, {args.chars}, {args.repeats})"
        )

    times = []
    for _ in range(args.repeats):
        seconds, wrong = run_once(args.num, args.chars, args.seed)
        if wrong:
            raise RuntimeError(f"bench reward: {wrong} responses got the wrong verdict; the scorer is broken")
        times.append(seconds)
    times.sort()
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    p20, p50, p80 = q[1], statistics.median(times), q[7]
    device, date = _device(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    print(f"{'responses':>10} {'chars':>8} {'seconds p50':>12} {'p20':>8} {'p80':>8} {'responses/s':>12}  device")
    print(f"{args.num:>10} {args.chars:>8} {p50:>12.4f} {p20:>8.4f} {p80:>8.4f} {args.num / p50:>12.0f}  {device}")
    row = [
        "reward_math_dapo",
        "python",
        "score",
        f"seconds_per_{args.num}_responses",
        "s",
        args.chars,
        f"{p50:.6f}",
        f"{p20:.6f}",
        f"{p80:.6f}",
        device,
        date,
    ]
    append_rows(results_csv(args, name="reward"), [dict(zip(CSV_FIELDS, row))], fields=CSV_FIELDS)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
