"""`dapo-megatron bench dataplane` end to end on a small step (2 gloo ranks at TP=2, 8 responses):
the rank that receives the batch gets its share and a header only, the TP peer that only sends
shards to the exporter materialises no full tensor, the exporter holds under two buckets, and the
table, the CSV rows and the closing line are written.

    pytest tests/integration/test_bench_dataplane.py
"""

from __future__ import annotations

import csv
import re

from dapo_megatron.benchmarks import run as bench


def test_bench_dataplane_small_step_meets_its_byte_and_export_targets(tmp_path, capsys):
    assert (
        bench.main(
            [
                "dataplane",
                "--layouts",
                "2:tp2",
                "--prompts",
                "2",
                "--n",
                "4",
                "--bucket-mb",
                "8",
                "--results-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    with (tmp_path / "dataplane.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["rank"], r["role"], r["layout"]) for r in rows] == [("0", "driver", "2:tp2"), ("1", "rank", "2:tp2")]
    driver, peer = rows
    assert int(driver["batch_recv_bytes"]) == 0  # the driver holds the batch
    # the TP peer receives the driver's share (the same one: one DP replica) plus a header under 1 KB
    assert int(peer["share_bytes"]) == int(driver["share_bytes"]) > 0
    assert 0 < int(peer["batch_recv_bytes"]) - int(peer["share_bytes"]) < 1024
    assert float(peer["largest_tensor_mb"]) == 0.0  # it sent its shards; the exporter merged them
    # the exporter's largest tensor is the 19,008 x 640 bf16 embedding (23.2 MiB), alone in its bucket
    assert abs(float(driver["largest_tensor_mb"]) - 19008 * 640 * 2 / 2**20) < 1e-9
    line = out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"dataplane: batch_bytes_over_share=([\d.]+) python_objects_per_token=([\d.]+) "
        r"export_peak_over_bucket=([\d.]+)",
        line,
    )
    assert match, line
    x, _, z = (float(v) for v in match.groups())
    assert x <= 1.1 and z <= 2.0
    assert "largest tensor a non-sending rank materialised in the export: 0.0 MB" in out
