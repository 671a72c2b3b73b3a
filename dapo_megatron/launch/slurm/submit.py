"""Plan and submit the jobs of a run: render the sbatch files, write them into the run directory,
call `sbatch --parsable` (an argv list, never a shell) and record the job ids in jobs.json.

    plan = plan_train(load_config("configs/runs/qwen2.5-32b_dapo.yaml"), engines=0)
    ids = submit(plan)                         # {"train": "1234"}
    submit(plan, dry_run=True)                 # prints the scripts and sbatch commands, writes nothing

Run directory layout (run_dir = trainer.output_dir; a sweep's is its own directory):
  <run_dir>/slurm/config.yaml           the resolved config every job loads (overrides applied)
  <run_dir>/slurm/<role>.sbatch         the rendered scripts
  <run_dir>/slurm/logs/<role>-%j.out    job logs (array tasks: <role>-%A_%a.out)
  <run_dir>/slurm/jobs.json             {"jobs": [{role, job_id, script, argv, submitted_at}, ...]}
  <run_dir>/engines/<host>_<port>.json  rollout engine registrations (disaggregated placement)
  <run_dir>/eval/<checkpoint>.json      eval array results; results.md / results.csv after gather
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dapo_megatron.config import Config, config_from_dict, load_config
from dapo_megatron.launch.slurm import render
from dapo_megatron.memplan.report import check_before_launch
from dapo_megatron.rollout.auth import ensure_secret_file, run_secret_path


@dataclass
class JobSpec:
    role: str  # train | fp8_export | engines | sweep | eval | eval_gather | bench_kernels
    render: Callable[[dict[str, str]], str]  # job ids submitted so far (role -> id) -> sbatch text
    sbatch_args: list[str]  # run-specific options passed to sbatch (job name, log path, array)
    dependency: tuple[str, str] | None = None  # (type, role): e.g. ("afterok", "eval")
    also_after: tuple[tuple[str, str], ...] = ()  # more (type, role) it waits for: ("afterok", "preflight")

    def script(self, job_ids: dict[str, str] | None = None) -> str:
        return self.render(job_ids or {})


def _fixed(text: str) -> Callable[[dict[str, str]], str]:
    return lambda job_ids: text


@dataclass
class Plan:
    run_dir: Path
    jobs: list[JobSpec]
    files: dict[str, str] = field(default_factory=dict)  # path relative to run_dir -> text

    def script_path(self, job: JobSpec) -> Path:
        return self.run_dir / "slurm" / f"{job.role}.sbatch"


def _abs(path: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path)))


def _slurm_path(path: Path) -> str:
    """sbatch expands %j, %A, ... in --output; a literal % in a directory name is written %%."""
    return str(path).replace("%", "%%")


def _log_args(run_dir: Path, role: str, *, array: bool) -> list[str]:
    pattern = f"{role}-%A_%a.out" if array else f"{role}-%j.out"
    return [f"--output={_slurm_path(run_dir)}/slurm/logs/{pattern}", f"--job-name=dapo-{role}"]


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _resolved(cfg: Config) -> Config:
    """A copy with trainer.output_dir made absolute: jobs do not share the submitter's cwd."""
    cfg = copy.deepcopy(cfg)
    cfg.trainer.output_dir = str(_abs(cfg.trainer.output_dir))
    return cfg


# -------------------------------------------------------------------------------- plans


def plan_train(
    cfg: Config, *, engines: int = 0, entry: Sequence[str] = render.TRAIN_ENTRY, resume: bool = False
) -> Plan:
    """A training run; with engines=K also a rollout array of K engines that the trainer finds via
    <run_dir>/engines/ (rollout.placement becomes disaggregated, rollout.num_engines K).
    resume: the job's first start continues the run from its newest checkpoint (`slurm submit --resume`)."""
    cfg = _resolved(cfg)
    if engines < 0:
        raise ValueError(f"--engines {engines}: must be >= 0")
    if engines:
        cfg.rollout.placement = "disaggregated"
        cfg.rollout.num_engines = engines
    else:
        _require_engines(cfg, "")
    run_dir = Path(cfg.trainer.output_dir)
    config_file = run_dir / "slurm" / "config.yaml"
    jobs = []
    if engines:
        array = JobSpec(
            "engines",
            _fixed(render.render_rollout_array(cfg, register_dir=str(run_dir / "engines"))),
            [f"--array=0-{engines - 1}", *_log_args(run_dir, "engines", array=True)],
        )
        if cfg.rollout.quantization == "fp8":
            # the engines start from the block-FP8 export of the base model: written by its own job first
            jobs.append(
                JobSpec(
                    "fp8_export",
                    _fixed(render.render_fp8_export(cfg, config_file=str(config_file))),
                    _log_args(run_dir, "fp8_export", array=False),
                )
            )
            array.dependency = ("afterok", "fp8_export")
        jobs.append(array)
    # the trainer cancels its engine array when training ends: the id is known once engines are submitted
    train = JobSpec(
        "train",
        lambda ids: render.render_train(
            cfg,
            config_file=str(config_file),
            entry=entry,
            resume=resume,
            engine_job=ids.get("engines", "<engines job id>") if engines else "",
        ),
        _log_args(run_dir, "train", array=False),
    )
    train.script()  # render once now: a config that cannot launch fails before anything is submitted
    if engines:
        # the trainer starts once the engines have started (no GPU hours spent waiting in the queue
        # for them); the engine job id is only known at submission: see submit()
        train.dependency = ("after", "engines")
    jobs.append(train)
    return Plan(run_dir, jobs, {"slurm/config.yaml": dump_config(cfg)})


def add_preflight(plan: Plan, *, engines: int, nbytes: int = render.PREFLIGHT_BYTES) -> None:
    """`slurm submit --preflight`: the preflight job (launch/preflight/command.py) on the run's partition and node
    count goes first; every job of the run waits for it to succeed (afterok): a failed check starts nothing."""
    (_, cfg), *_ = training_configs(plan)
    text = render.render_preflight(
        cfg,
        config_file=str(plan.run_dir / "slurm" / "config.yaml"),
        engine_node_count=render.engine_nodes(cfg, engines),
        nbytes=nbytes,
    )
    for job in plan.jobs:
        job.also_after = (*job.also_after, ("afterok", "preflight"))
    plan.jobs.insert(0, JobSpec("preflight", _fixed(text), _log_args(plan.run_dir, "preflight", array=False)))


def _require_engines(cfg: Config, where: str) -> None:
    """A trainer job alone starts engines only when they are colocated: a disaggregated run without
    fixed URLs would wait for registrations nobody writes."""
    if cfg.rollout.placement == "disaggregated" and not cfg.rollout.engine_urls:
        raise ValueError(
            f"{where}config key 'rollout.placement': disaggregated engines run as their own array "
            f"job: pass --engines K (or set rollout.engine_urls); rollout.placement=colocated "
            f"starts them inside the trainer's job, on its GPUs"
        )


def plan_sweep(
    sweep_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    entry: Sequence[str] = render.TRAIN_ENTRY,
    resume: bool = False,
) -> Plan:
    """One array task per *.yaml of sweep_dir (sorted by name), throttled to slurm.array_throttle.

    Each run keeps its own trainer.output_dir; an override trainer.output_dir=BASE puts run <stem>
    in BASE/<stem> instead. The sweep's own files go to BASE, or <common parent>/sweep_<dir name>.
    """
    sweep_dir = Path(sweep_dir)
    files = sorted(sweep_dir.glob("*.yaml"))
    if not files:
        raise ValueError(f"--sweep {sweep_dir}: no *.yaml configs in that directory")
    base = None
    rest = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "trainer.output_dir":
            base = _abs(value)
        else:
            rest.append(item)
    configs: list[tuple[Path, Config]] = []
    for path in files:
        extra = [f"trainer.output_dir={base / path.stem}"] if base else []
        configs.append((path, _resolved(load_config(path, [*rest, *extra]))))
    seen: dict[str, Path] = {}
    for path, cfg in configs:
        _require_engines(cfg, f"--sweep {sweep_dir}: {path.name}: ")
        out = cfg.trainer.output_dir
        if out in seen:
            raise ValueError(
                f"--sweep {sweep_dir}: {seen[out].name} and {path.name} both write to trainer.output_dir "
                f"{out}; give each run its own directory (or pass trainer.output_dir=BASE)"
            )
        seen[out] = path
    first_path, first = configs[0]
    for path, cfg in configs[1:]:
        if cfg.slurm != first.slurm:
            diff = [k for k in vars(first.slurm) if getattr(first.slurm, k) != getattr(cfg.slurm, k)]
            raise ValueError(
                f"--sweep {sweep_dir}: one array job needs one slurm section, but {path.name} differs "
                f"from {first_path.name} in {', '.join('slurm.' + k for k in diff)}"
            )
    run_dir = base or _abs(os.path.commonpath([c.trainer.output_dir for _, c in configs])) / f"sweep_{sweep_dir.name}"
    files_out = {f"slurm/configs/{path.stem}.yaml": dump_config(cfg) for path, cfg in configs}
    array = f"--array=0-{len(configs) - 1}%{first.slurm.array_throttle}"
    job = JobSpec(
        "sweep",
        _fixed(
            render.render_sweep_array(first, configs_dir=str(run_dir / "slurm" / "configs"), entry=entry, resume=resume)
        ),
        [array, *_log_args(run_dir, "sweep", array=True)],
    )
    runs = "\n".join(f"{path.stem}\t{cfg.trainer.output_dir}" for path, cfg in configs) + "\n"
    return Plan(run_dir, [job], {**files_out, "slurm/sweep_runs.tsv": runs})


def find_checkpoints(run_dir: Path) -> list[Path]:
    """Complete run checkpoints, <run_dir>/checkpoints/step_<N>/ (trainer/checkpoint/files.py), by step."""
    from dapo_megatron.trainer.checkpoint.files import list_checkpoints

    return [path for _, path in list_checkpoints(run_dir)]


def plan_eval(cfg: Config, eval_run_dir: str | Path, *, entry: Sequence[str] = render.EVAL_ENTRY) -> Plan:
    """One eval array task per checkpoint of eval_run_dir, then a gather job (afterok) for the table."""
    run_dir = _abs(str(eval_run_dir))
    checkpoints = find_checkpoints(run_dir)
    if not checkpoints:
        raise ValueError(f"--eval {run_dir}: no complete checkpoints (checkpoints/step_<N>/ with trainer_state.json)")
    cfg = _resolved(cfg)
    results = run_dir / "eval"
    ckpt_file = run_dir / "slurm" / "eval_checkpoints.txt"
    if any("\n" in str(p) for p in checkpoints):
        raise ValueError(f"--eval {run_dir}: a checkpoint path contains a line break")
    eval_job = JobSpec(
        "eval",
        _fixed(
            render.render_eval_array(
                cfg,
                config_file=str(run_dir / "slurm" / "eval_config.yaml"),
                checkpoints_file=str(ckpt_file),
                results_dir=str(results),
                entry=entry,
            )
        ),
        [f"--array=0-{len(checkpoints) - 1}%{cfg.slurm.array_throttle}", *_log_args(run_dir, "eval", array=True)],
    )
    gather = JobSpec(
        "eval_gather",
        _fixed(render.render_eval_gather(cfg, results_dir=str(results))),
        _log_args(run_dir, "eval_gather", array=False),
        dependency=("afterok", "eval"),
    )
    files = {
        "slurm/eval_config.yaml": dump_config(cfg),
        "slurm/eval_checkpoints.txt": "".join(f"{p}\n" for p in checkpoints),
    }
    return Plan(run_dir, [eval_job, gather], files)


def plan_bench_kernels(cfg: Config) -> Plan:
    """`bench kernels` on one GPU; its CSV rows go to <run_dir>/bench/kernels.csv (not the job's cwd)."""
    cfg = _resolved(cfg)
    run_dir = Path(cfg.trainer.output_dir)
    text = render.render_bench_kernels(cfg, bench_args=["--results-dir", str(run_dir / "bench")])
    return Plan(run_dir, [JobSpec("bench_kernels", _fixed(text), _log_args(run_dir, "bench_kernels", array=False))])


def training_configs(plan: Plan) -> list[tuple[str, Config]]:
    """(name, config) of every training run the plan's jobs will load, as they will load it (the written
    resolved copy): ("config", ...) for a run, (stem, ...) per run of a sweep, in array order."""
    return [
        (Path(rel).stem, config_from_dict(yaml.safe_load(text)))
        for rel, text in plan.files.items()
        if rel == "slurm/config.yaml" or rel.startswith("slurm/configs/")
    ]


def check_memory(plan: Plan, *, out: Callable[[str], None] = print) -> None:
    """The memory plan (`dapo-megatron plan`) of every training config the plan's jobs will load: one
    line each when it fits, else the full plan and a ValueError naming the config, phase and component."""
    for label, cfg in training_configs(plan):
        rel = "slurm/config.yaml" if label == "config" else f"slurm/configs/{label}.yaml"
        try:
            check_before_launch(cfg, out=out, label=label)
        except ValueError as err:
            raise ValueError(f"{plan.run_dir / rel}: {err}") from None


# -------------------------------------------------------------------------------- submission


def sbatch_argv(plan: Plan, job: JobSpec, job_ids: dict[str, str]) -> list[str]:
    argv = ["sbatch", "--parsable", *job.sbatch_args]
    waits = ([job.dependency] if job.dependency else []) + list(job.also_after)
    if waits:  # a comma: every one of them must hold
        argv.append(
            "--dependency=" + ",".join(f"{kind}:{job_ids.get(role, '<' + role + ' job id>')}" for kind, role in waits)
        )
    return [*argv, str(plan.script_path(job))]


def parse_job_id(stdout: str) -> str:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    job_id = stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch --parsable printed {stdout.strip()!r}, not a job id")
    return job_id


def submit(
    plan: Plan, *, dry_run: bool = False, out: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Write the plan's files and scripts, sbatch each job in order, record jobs.json; role -> job id.

    dry_run: print the sbatch command lines, the scripts, then the other files (the resolved config,
    last: it is the longest and the least surprising); writes nothing, submits nothing.
    """
    if dry_run:
        out("# dry run: nothing is written or submitted. `slurm submit` without --dry-run would run, in order:")
        for job in plan.jobs:
            out(f"#   {shlex.join(sbatch_argv(plan, job, {}))}")
        out("")
        for job in plan.jobs:
            out(f"# ---- {plan.script_path(job)}\n{job.script()}")
        for rel, text in plan.files.items():
            out(f"# ---- {plan.run_dir / rel} (written at submission)\n{text}")
        out("# dry run: nothing written, nothing submitted")
        return {}
    (plan.run_dir / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
    # the run's engine key, before any engine or trainer job can start (a requeue or resubmission reuses it)

    ensure_secret_file(run_secret_path(plan.run_dir))
    for rel, text in plan.files.items():
        path = plan.run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    job_ids: dict[str, str] = {}
    records: list[dict] = []
    for job in plan.jobs:
        script_path = plan.script_path(job)
        script_path.write_text(job.script(job_ids))
        script_path.chmod(0o755)
        argv = sbatch_argv(plan, job, job_ids)
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        if result.returncode != 0:
            _record(plan.run_dir, records)
            raise RuntimeError(
                f"sbatch failed for {job.role} (rc {result.returncode}): {result.stderr.strip()}"
                + (f"; already submitted: {job_ids}" if job_ids else "")
            )
        job_ids[job.role] = parse_job_id(result.stdout)
        records.append(
            {
                "role": job.role,
                "job_id": job_ids[job.role],
                "script": str(script_path),
                "argv": argv,
                "submitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
        )
        out(f"{job.role}: {job_ids[job.role]}")
    _record(plan.run_dir, records)
    if job_ids.get("sweep"):  # each run's own directory records its array task too: `slurm status RUN`
        for task, (_, cfg) in enumerate(training_configs(plan)):  # shows it, and `slurm submit` into
            run_dir = Path(cfg.trainer.output_dir)  # that directory sees it pending
            (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
            _record(run_dir, [{**records[-1], "job_id": f"{job_ids['sweep']}_{task}"}])
    return job_ids


def _record(run_dir: Path, records: list[dict]) -> None:
    """Append to <run_dir>/slurm/jobs.json (a run submitted twice keeps both submissions)."""
    path = run_dir / "slurm" / "jobs.json"
    old = json.loads(path.read_text()).get("jobs", []) if path.exists() else []
    path.write_text(json.dumps({"run_dir": str(run_dir), "jobs": old + records}, indent=2) + "\n")
