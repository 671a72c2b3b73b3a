"""The preflight's results: one Check per fact that can fail, the measured links, the table and the
JSON file (its schema: launch/preflight/command.py's docstring). Standard library only: the CLI that gathers
the nodes' results and the node workers share it.

Each node worker prints one line `PREFLIGHT-RESULT {json}` on stdout (srun brings it to the batch
host, so a node whose run directory is not shared still reports); `merge` joins them into the report.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULT_PREFIX = "PREFLIGHT-RESULT "
SCHEMA_VERSION = 1


@dataclass
class Check:
    name: str  # allocation | gpus | imports | shared_fs | run_lock | clock | ports | routes | link
    node: str  # the host it is about ("all": the allocation)
    ok: bool
    detail: str  # what was found, with numbers
    fix: str = ""  # what to do, when not ok

    def as_dict(self) -> dict:
        return asdict(self)


def link_record(
    *, kind: str, path: str, backend: str, nodes: list[str], nbytes: int, seconds: float, bus_factor: float = 1.0
) -> dict:
    """One measured link (preflight.json "links"): Gbit/s = bytes * 8 / seconds / 1e9; bus = x bus_factor
    (the nccl-tests convention: 2(n-1)/n for an all-reduce of n ranks, 1 for a broadcast)."""
    gbit = nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "kind": kind,
        "path": path,
        "backend": backend,
        "nodes": list(nodes),
        "bytes": int(nbytes),
        "seconds": round(seconds, 6),
        "gbit_per_s": round(gbit, 4),
        "bus_gbit_per_s": round(gbit * bus_factor, 4),
    }


def result_line(payload: dict) -> str:
    return RESULT_PREFIX + json.dumps(payload, sort_keys=True)


def parse_results(text: str) -> list[dict]:
    """The nodes' result payloads in a step's stdout (other lines are the workers' own output)."""
    out = []
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                out.append(json.loads(line[len(RESULT_PREFIX) :]))
            except json.JSONDecodeError:
                continue
    return out


def merge(results: list[dict], *, expected: dict[int, tuple[str, str]], meta: dict, extra: list[Check]) -> dict:
    """The report: every node's facts and checks, the links, and a failed check for each expected rank
    (rank -> (host, role)) that printed no result."""
    checks = [c.as_dict() for c in extra]
    nodes, links = [], []
    seen = set()
    intra = None
    for res in sorted(results, key=lambda r: r.get("rank", 0)):
        seen.add(res.get("rank"))
        nodes.append({k: res.get(k) for k in ("rank", "host", "role", "python", "facts")})
        checks += res.get("checks", [])
        links += res.get("links", [])
        intra = intra if intra is not None else res.get("facts", {}).get("intra_node_gbit_per_s")
    for rank, (host, role) in sorted(expected.items()):
        if rank not in seen:
            checks.append(
                Check(
                    "node",
                    host,
                    False,
                    f"the {role} worker of rank {rank} printed no result (it crashed or could not start)",
                    "read the job log (slurm/logs/preflight-<job>.out): its error is there",
                ).as_dict()
            )
    failed = sum(1 for c in checks if not c["ok"])
    return {
        "version": SCHEMA_VERSION,
        **meta,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nodes": nodes,
        "checks": checks,
        "links": links,
        "intra_node_gbit_per_s": intra,
        "summary": {"checks": len(checks), "failed": failed},
    }


def summary_line(report: dict) -> str:
    return f"preflight: {report['summary']['checks']} checks, {report['summary']['failed']} failed"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(report: dict) -> str:
    """The readable table: one row per check, the fix under a failed one, the links, the last line."""
    checks = report["checks"]
    node_w = max([len("node")] + [len(c["node"]) for c in checks])
    name_w = max([len("check")] + [len(c["name"]) for c in checks])
    lines = [f"{'check':<{name_w}}  {'node':<{node_w}}  ok    detail"]
    for c in checks:
        lines.append(f"{c['name']:<{name_w}}  {c['node']:<{node_w}}  {'ok ' if c['ok'] else 'FAIL'}  {c['detail']}")
        if not c["ok"] and c.get("fix"):
            lines.append(f"{'':<{name_w}}  {'':<{node_w}}        fix: {c['fix']}")
    if report["links"]:
        lines.append("")
        lines.append("links (bytes per op; median of the timed repetitions)")
        for link in report["links"]:
            lines.append(
                f"  {link['path']:<12} {link['kind']:<10} {link['backend']:<5} {' <-> '.join(link['nodes'])}: "
                f"{link['bytes'] / 2**20:.0f} MiB in {link['seconds'] * 1e3:.1f} ms = {link['gbit_per_s']:.3f} Gbit/s"
                + (f" (bus {link['bus_gbit_per_s']:.3f})" if link["bus_gbit_per_s"] != link["gbit_per_s"] else "")
            )
    lines.append(summary_line(report))
    return "\n".join(_clip(line, 200) for line in lines)


def write_report(run_dir: Path, report: dict) -> Path:
    """<run_dir>/preflight.json, written whole (a temporary file renamed over it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "preflight.json"
    tmp = path.with_name(f".preflight.json.{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path
