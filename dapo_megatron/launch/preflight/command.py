"""`dapo-megatron preflight`: check, on the allocation itself, what a run will assume before it runs.

    dapo-megatron slurm submit CONFIG --engines 2 --preflight   # a short job first; the run's jobs wait
                                                               # for it (--dependency=afterok:<id>)
    salloc -N 3 ... ; dapo-megatron preflight CONFIG            # inside any allocation (the batch host)

The first slurm.nodes nodes of the allocation are the trainer's, the next --engine-nodes the engines'
(default: the rest). One worker per node (launch/preflight/node.py; srun, in the role's own python,
setup lines and container) checks, each failed check naming its fix:
  gpus        the GPUs this process sees (torch, else nvidia-smi; "no GPU" on a CPU node, a failure only
              where slurm.gpus_per_node asks for GPUs), their count and memory against
              slurm.gpus_per_node and the plan's slurm.gpu_memory_gb
  imports     the role's python imports what it must, with versions: trainer torch (+ CUDA),
              megatron-core, transformers, TE or not, apex or not; engines torch, transformers, and for
              SGLang sglang, sgl_kernel (flashinfer or not); colocated engines: both lists on trainer nodes
  ports       the run's ports are free on the nodes that will bind them: the trainer's rendezvous port
              (20000 + train job id % 10000, slurm/_trainer_launch.sh) on trainer nodes, the SGLang
              engines' port on engine nodes (slurm/rollout_array.sbatch)
  routes      the address each node picks toward the others (distributed/addresses.py) is not loopback,
              and a TCP connection to it opens from every other node
  shared_fs   a file written on the first node is read on every node and back
  run_lock    the first node's flock on the run lock (launch/run_lock.py) is seen held on every node
  clock       each node's wall clock against the first node's and against its file server's (< 1 s)
  link        measured bandwidth: launch/preflight/links.py
then the table, and its last line `preflight: N checks, M failed`; exit 1 when any failed. It refuses
nothing by itself: the dependency of the run's jobs does.

<run_dir>/preflight.json (schema version 1; launch/preflight/report.py writes it):
  version                 1
  job, run_dir, config    the preflight job id, trainer.output_dir, the config file
  trainer_nodes, engine_nodes, hosts   node counts and the nodes (trainer nodes first)
  bytes, reps             bytes per measured operation, timed repetitions (median reported)
  ports                   [{"port", "what", "role"}] the ports checked
  nodes                   [{"rank", "host", "role": "trainer"|"engine", "python", "facts": {"versions":
                          {module: version or null, "torch.cuda": ...}, "gpus": [[name, GiB], ...],
                          "routes": {peer: {"peer", "address", "interface"}}, "clock": {"offset_s",
                          "round_trip_s", "filesystem_offset_s"}}}]
  checks                  [{"name", "node", "ok", "detail", "fix"}] as in the table
  links                   [{"kind": "all_reduce"|"broadcast"|"copy", "path": "trainer"|"weight_group"|
                          "intra_node", "backend": "gloo"|"nccl"|"cuda", "nodes": [host, ...] (a pair:
                          one link; all trainer nodes: the group), "bytes", "seconds" (median),
                          "gbit_per_s" (bytes * 8 / seconds / 1e9), "bus_gbit_per_s" (x 2(n-1)/n for an
                          all-reduce of n nodes: the rate each link carried)}]
  intra_node_gbit_per_s   GPU 0 -> GPU 1 copy rate on the first node, null where not measured (< 2 GPUs)
  summary                 {"checks": N, "failed": M}
A plan reading it (the weight-sync time model) takes the per-link rate of a trainer pair broadcast and
of each weight_group broadcast: gbit_per_s with its two nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dapo_megatron.config import Config, load_config
from dapo_megatron.launch.preflight.report import Check, merge, parse_results, summary_line, table, write_report
from dapo_megatron.launch.slurm import render


# ------------------------------------------------------------------------------ the run's job ids and ports
def run_job_ids(run_dir: Path, own_job: str, *, wait_s: float) -> dict[str, str]:
    """role -> job id of the jobs submitted with this preflight job (<run_dir>/slurm/jobs.json, written
    once `slurm submit` has submitted them all: waited for up to wait_s)."""
    path = run_dir / "slurm" / "jobs.json"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            jobs = json.loads(path.read_text()).get("jobs", [])
        except (OSError, ValueError):
            jobs = []
        ids = [str(j.get("job_id")) for j in jobs]
        if own_job in ids:
            after = jobs[ids.index(own_job) + 1 :]
            return {j["role"]: str(j["job_id"]) for j in after if j.get("role") in ("train", "engines")}
        if time.monotonic() >= deadline:
            return {}
        time.sleep(1.0)


def sglang_port(engine_job: str) -> int:
    """The port slurm/rollout_array.sbatch gives an SGLang engine of this array job."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    span = min(low - 1024, 10000)
    return low - span + int(engine_job) % span


def run_ports(cfg: Config, jobs: dict[str, str], own_job: str) -> list[dict]:
    train = jobs.get("train", own_job)  # by hand in an allocation: this allocation would run the trainer
    ports = [{"port": 20000 + int(train) % 10000, "what": f"trainer rendezvous of job {train}", "role": "trainer"}]
    if cfg.rollout.engine == "sglang" and "engines" in jobs:
        port = sglang_port(jobs["engines"])
        ports.append({"port": port, "what": f"SGLang engines of job {jobs['engines']}", "role": "engine"})
    return ports


# ------------------------------------------------------------------------------ the steps
def _hosts() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.split():
        raise ValueError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def step_argv(cfg: Config, role: str, *, first: int, count: int, common: list[str], ports: list[dict]) -> list[str]:
    """One srun step of `count` nodes from node `first` of the allocation, in the role's python/container."""
    python_role = "engines" if role == "engine" else "trainer"
    python = render.python_of(cfg, python_role)
    node_args = ["--role", role, "--rank-offset", str(first), f"--python={python}"]
    node_args += [f"--check-port={p['port']}:{p['what']}" for p in ports if p["role"] == role]
    argv = [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--relative={first}",
        "--kill-on-bad-exit=0",
        *render.container_args(cfg, python_role),
        python,
        "-m",
        "dapo_megatron.launch.preflight.node",
        *node_args,
        *common,
    ]
    engine_setup = cfg.slurm.engine_setup
    if role == "engine" and engine_setup:  # the engines' own environment: their setup lines, then the step
        return ["bash", "-c", "\n".join(engine_setup) + '\nexec "$@"', "preflight-engines", *argv]
    return argv


def run_steps(steps: list[list[str]], *, timeout_s: float) -> tuple[str, list[str]]:
    """Run the srun steps side by side; (their stdout together, one line per step that failed)."""
    with tempfile.TemporaryDirectory(prefix="dapo-preflight-") as tmp:
        procs = []
        for i, argv in enumerate(steps):
            out = open(Path(tmp) / f"step{i}.out", "wb")  # noqa: SIM115 - closed once its step ends
            procs.append((argv, subprocess.Popen(argv, stdout=out, stdin=subprocess.DEVNULL), out))
        problems = []
        deadline = time.monotonic() + timeout_s
        for argv, proc, out in procs:
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                problems.append(f"timed out after {timeout_s:.0f} s: {shlex.join(argv[:8])} ...")
            out.close()
            if rc != 0:
                problems.append(f"exit {rc}: {shlex.join(argv[:8])} ...")
        text = "".join((Path(tmp) / f"step{i}.out").read_text(errors="replace") for i in range(len(steps)))
    return text, problems


# ------------------------------------------------------------------------------ the command
def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="dapo-megatron preflight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--engine-nodes", type=int, default=-1, help="engine nodes after the trainer's (default: the rest)")
    ap.add_argument(
        "--bytes", type=int, default=render.PREFLIGHT_BYTES, help="bytes per measured collective (default 64 MiB)"
    )
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound of every wait between the nodes")
    ap.add_argument("--wait-for-jobs", type=float, default=0.0, metavar="S", help="wait for jobs.json (slurm submit)")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    cfg = load_config(args.config, args.overrides)
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job or not os.environ.get("SLURM_JOB_NODELIST"):
        raise ValueError(
            "preflight runs inside a Slurm allocation (salloc / sbatch): `dapo-megatron slurm submit CONFIG "
            "--preflight` submits it as a job"
        )
    run_dir = Path(os.path.abspath(cfg.trainer.output_dir))
    hosts = _hosts()
    trainers = cfg.slurm.nodes
    engines = args.engine_nodes if args.engine_nodes >= 0 else max(len(hosts) - trainers, 0)
    need = trainers + engines
    alloc = Check(
        "allocation",
        "all",
        len(hosts) >= need,
        f"{len(hosts)} node(s) {','.join(hosts)}; the run takes {trainers} trainer + {engines} engine node(s)",
        "" if len(hosts) >= need else f"allocate {need} nodes (salloc -N {need}), or set slurm.nodes / --engine-nodes",
    )
    jobs = run_job_ids(run_dir, job, wait_s=args.wait_for_jobs)
    ports = run_ports(cfg, jobs, job)
    meta = {
        "job": job,
        "run_dir": str(run_dir),
        "config": str(args.config),
        "trainer_nodes": trainers,
        "engine_nodes": engines,
        "hosts": hosts[:need],
        "bytes": args.bytes,
        "reps": args.reps,
        "ports": ports,
    }
    expected: dict[int, tuple[str, str]] = {}
    results: list[dict] = []
    extra = [alloc]
    if alloc.ok:
        expected = {r: (hosts[r], "trainer" if r < trainers else "engine") for r in range(need)}
        results, problems = _run_workers(cfg, args, hosts[:need], trainers, engines, ports, run_dir, job)
        extra += [Check("node", "all", False, p, "read the job log above this table") for p in problems]
    report = merge(results, expected=expected, meta=meta, extra=extra)
    path = write_report(run_dir, report)
    print(table(report).rsplit("\n", 1)[0])
    print(f"written: {path}")
    print(summary_line(report), flush=True)
    return 1 if report["summary"]["failed"] else 0


def _run_workers(cfg, args, hosts, trainers, engines, ports, run_dir, job) -> tuple[list[dict], list[str]]:
    common = [
        f"--hosts={','.join(hosts)}",
        f"--trainer-nodes={trainers}",
        f"--store-port={20000 + int(job) % 10000}",
        f"--run-dir={run_dir}",
        f"--job={job}",
        f"--engine-kind={cfg.rollout.engine}",
        f"--gpus={cfg.slurm.gpus_per_node}",
        f"--gpu-memory-gb={cfg.slurm.gpu_memory_gb}",
        f"--bytes={args.bytes}",
        f"--reps={args.reps}",
        f"--timeout-s={args.timeout_s}",
    ]
    trainer_common = [*common, "--engine-imports"] if cfg.rollout.placement == "colocated" else common
    steps = [step_argv(cfg, "trainer", first=0, count=trainers, common=trainer_common, ports=ports)]
    if engines:
        steps.append(step_argv(cfg, "engine", first=trainers, count=engines, common=common, ports=ports))
    print(f"[preflight] job {job}: {len(hosts)} node(s), {trainers} trainer + {engines} engine", file=sys.stderr)
    text, problems = run_steps(steps, timeout_s=args.timeout_s * 4 + 300)
    return parse_results(text), problems
