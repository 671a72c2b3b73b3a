# ---- trainer launch (shared by train.sbatch and sweep_array.sbatch; inlined by the renderer) ----
# Needs: PYTHON, CONFIG, NNODES, NPROC_PER_NODE, SIGNAL_SECONDS, TRAIN_ENTRY (array), CONTAINER_ARGS
# (array: pyxis --container-image/--container-mounts of the srun steps, or empty), JOB_REF,
# ENGINE_JOB (may be empty), RESUME_REQUESTED (1: submitted with --resume).
#
# Rendezvous: torchrun's c10d store runs on the first node of the allocation; every node starts one
# torchrun (srun --ntasks-per-node=1) that spawns NPROC_PER_NODE ranks. The port is derived from
# the job id so two jobs sharing a node (array tasks, tests) never collide: 20000 + id % 10000.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
export MASTER_ADDR MASTER_PORT

# Network and NCCL (GPU clusters; ignored by gloo on CPU). Override any of them in slurm.setup.
#   NCCL_IB_HCA           which InfiniBand HCAs NCCL uses (unset: all it finds; e.g. mlx5 on H100 pods)
#   NCCL_IB_GID_INDEX     RoCE networks need the GID index of the RoCEv2 address (often 3)
#   NCCL_SOCKET_IFNAME    interface for NCCL's bootstrap / socket transport; GLOO_SOCKET_IFNAME the same
#   GLOO_SOCKET_IFNAME    for gloo. Unset, each rank takes the interface whose address routes to the
#                         other hosts (MASTER_ADDR; dapo_megatron/distributed/addresses.py), never loopback
#                         across hosts; set them only to force a fabric (e.g. NCCL_SOCKET_IFNAME==ib0)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a hung or failed collective aborts the job instead of hanging it
#   CUDA_DEVICE_MAX_CONNECTIONS=1      one hardware queue, so Megatron's TP/SP communication overlaps
#                                      with compute in issue order (required for TP comm overlap);
#                                      trainer only: colocated engines start without it (launch/slurm/colocated.py)
#   NCCL_DEBUG=WARN       INFO when a job hangs in NCCL initialisation
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONUNBUFFERED=1

# One run per directory (dapo_megatron/launch/run_lock.py, launch/slurm/job_start.py): the job holds
# <output_dir>/.run.lock for its whole life, taken here before anything writes. This shell opens the
# file on descriptor 9 and keeps it; job_start takes the flock on that descriptor (an flock belongs to
# the open file description, so it lasts until this shell exits, SIGKILL included) and records the
# job, pid and host. A second job or a local `train` in the same directory is refused, naming the
# holder; this job, refused, exits 2 having written nothing. Every child gets the descriptor closed
# (9>&-): only this shell holds the lock. Under the lock, how the trainer starts: a requeued job
# (SLURM_RESTART_COUNT > 0; it takes over its previous incarnation's lock) or a `slurm submit --resume`
# job continues from the newest complete checkpoint (a requeue before the first checkpoint starts
# from the beginning); a first start that finds a run written after the submission is refused
# instead of mixing with it.
LOCK_FILE=$("$PYTHON" -m dapo_megatron.launch.slurm.job_start lock-file "$CONFIG" 9>&-) || exit 2
exec 9<>"$LOCK_FILE" || { echo "cannot open $LOCK_FILE" >&2; exit 2; }
ACQUIRE=(acquire "$CONFIG" --fd 9 --job "$JOB_REF" --restart "${SLURM_RESTART_COUNT:-0}" --holder-pid "$$")
if [ "$RESUME_REQUESTED" = 1 ]; then ACQUIRE+=(--resume-requested); fi
START_ARGS=$("$PYTHON" -m dapo_megatron.launch.slurm.job_start "${ACQUIRE[@]}")
case $? in
    0) ;;
    3) exit 0 ;;   # a --resume submission of a finished run: nothing to do (said in the log)
    4)             # the directory holds a run this submission did not ask to continue (the log says which);
                   # this job holds the lock, so the engine array is its own and nobody else's
        if [ -n "$ENGINE_JOB" ]; then scancel "$ENGINE_JOB" 9>&- || true; fi
        exit 2 ;;
    *) exit 2 ;;   # refused: another run holds the directory (named in the log); nothing was written
esac
RESUME=()
if [ "$START_ARGS" = "--resume" ]; then RESUME=(--resume); fi

# Preemption: `#SBATCH --signal=B:USR1@SIGNAL_SECONDS` sends USR1 to this script (B: = batch shell
# only) before the time limit. The trap creates DAPO_PREEMPT_FILE, next to the config on the shared
# run directory; every rank checks for it at each step boundary, the ranks agree (one all-reduce),
# write a checkpoint and exit (dapo_megatron/trainer/preemption.py). Then this script requeues the job.
# The signal itself is not forwarded: through srun it would reach every process of the step, and
# helpers that do not handle it (Megatron's checkpoint writer processes) would die mid-checkpoint.
# SIGTERM (scancel, `scontrol requeue`, preemption) reaches the ranks directly from Slurm; it is
# not forwarded again, because a second signal would interrupt torchrun's orderly shutdown.
DAPO_PREEMPT_FILE="$(dirname "$CONFIG")/preempt-$JOB_REF"
export DAPO_PREEMPT_FILE
rm -f "$DAPO_PREEMPT_FILE"   # a request of an earlier incarnation of this job
REQUEUE_ASKED=0
on_usr1() {
    echo "[$(date -u +%FT%TZ)] SIGUSR1: the time limit is near; checkpointing, then requeue"
    REQUEUE_ASKED=1
    touch "$DAPO_PREEMPT_FILE"
}
GOT_TERM=0
on_term() {
    GOT_TERM=1
    echo "[$(date -u +%FT%TZ)] SIGTERM: job cancelled or requeued by Slurm; ranks checkpoint and exit"
}
trap on_usr1 USR1
trap on_term TERM

# The embedded tiny model (tiny.enabled, no model.path; CPU runs): built once, or reused from its
# cache under the run directory, before the engines and the ranks load it. Prints "" otherwise.
MODEL_DIR=$("$PYTHON" -m dapo_megatron.launch.prepare "$CONFIG" 9>&-) || { echo "model preparation failed" >&2; exit 1; }
MODEL_ARGS=()
if [ -n "$MODEL_DIR" ]; then MODEL_ARGS=("model.path=$MODEL_DIR" "tiny.enabled=false"); fi

# rollout.quantization=fp8 with colocated engines: the engines' block-FP8 export of the base model, written
# to <output_dir>/rollout_fp8 here, once, before any engine starts (a no-op printing "" otherwise: a
# disaggregated run's export is its fp8_export job; docs/fp8.md).
"$PYTHON" -m dapo_megatron.launch.slurm.fp8_export "$CONFIG" "${MODEL_ARGS[@]}" --colocated-only >/dev/null 9>&- \
    || { echo "FP8 rollout export failed" >&2; exit 1; }

# Colocated rollout engines (rollout.placement=colocated): this node's share of rollout.num_engines,
# started in the trainer's own allocation (srun --overlap: the same nodes and GPUs) and registering
# in <output_dir>/engines/ for the driver's engine pool. A no-op for disaggregated engines (the
# rollout array job) and fixed rollout.engine_urls. Stopped when the trainer exits.
srun --overlap --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 "${CONTAINER_ARGS[@]}" \
    "$PYTHON" -m dapo_megatron.launch.slurm.colocated "$CONFIG" "${MODEL_ARGS[@]}" 9>&- &
ENGINES_STEP=$!

echo "[$(date -u +%FT%TZ)] job $JOB_REF restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NPROC_PER_NODE rank(s)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT, config $CONFIG"
# Step ids start again at 0 in a requeued job, and Slurm signals a step by its id. A node lost mid-step:
# srun --kill-on-bad-exit cancels step J.1 while that node cannot hear it, and the cancel reached the node
# once it was back, 60 s later, where the requeued incarnation's trainer was step J.1 again: cancelled,
# the job FAILED (three-host twin under load, 2026-11-27; slurmd logs: restart 0's J.1 ended 16:44:22,
# restart 1's J.1 "CANCELLED AT 16:45:26" on both nodes, no scancel). So restart N first runs N empty
# steps: the trainer's step id is one that no earlier incarnation of the job had.
for _ in $(seq "${SLURM_RESTART_COUNT:-0}"); do
    srun --overlap --nodes=1 --ntasks=1 true 9>&- || true
done
# torchrun waits SHUTDOWN_S after forwarding a signal (SIGTERM from Slurm) before it kills the
# ranks: the time they have to finish the step and write the checkpoint.
SHUTDOWN_S=$(( SIGNAL_SECONDS > 30 ? SIGNAL_SECONDS : 30 ))
srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 "${CONTAINER_ARGS[@]}" \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
        --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout="$SHUTDOWN_S" \
        "${TRAIN_ENTRY[@]}" "$CONFIG" "${MODEL_ARGS[@]}" "${RESUME[@]}" 9>&- &
STEP_PID=$!
# `wait` returns early whenever a trapped signal arrives: wait again until the step has really ended.
while :; do
    wait "$STEP_PID"
    rc=$?
    kill -0 "$STEP_PID" 2>/dev/null || break
done

kill -TERM "$ENGINES_STEP" 2>/dev/null && wait "$ENGINES_STEP"
rm -f "$DAPO_PREEMPT_FILE"

# A run that reached trainer.total_steps before the request took effect is finished, not requeued
# (launch/slurm/progress.py reads the latest complete checkpoint); one that stopped early is.
if [ "$REQUEUE_ASKED" = 1 ]; then
    if PROGRESS=$("$PYTHON" -m dapo_megatron.launch.slurm.progress "$CONFIG" "${MODEL_ARGS[@]}" 9>&-); then
        echo "[$(date -u +%FT%TZ)] trainer exited with $rc; the run is complete ($PROGRESS steps): no requeue"
    else
        echo "[$(date -u +%FT%TZ)] trainer exited with $rc at checkpoint $PROGRESS; requeueing $JOB_REF"
        # the lock stays recorded: the requeued incarnation takes it over as its own
        scontrol requeue "$JOB_REF" 9>&-
        exit 0
    fi
fi
echo "[$(date -u +%FT%TZ)] trainer exited with $rc"
# A node of this job lost (srun: "Node failure on X"): Slurm marks it DOWN and requeues this job
# (--requeue), but its verdict can trail the step's end: srun returned, the node not yet shown down
# and the requeue's SIGTERM arriving a moment after this line (seen on the three-host twin under load,
# 2026-11-27: the engines were cancelled and the requeued job waited for them). So a failed step waits
# up to VERDICT_S for Slurm's word on its nodes (down, draining, failed or not responding); the
# requeued job needs its engines, so they stay (as after any SIGTERM).
NODE_LOST=0
VERDICT_S=15
node_lost() { sinfo -h -N -n "$SLURM_JOB_NODELIST" -o %t 9>&- | grep -qE '^(down|drain|fail)|[*]$'; }
if [ "$rc" != 0 ]; then
    for _ in $(seq $((VERDICT_S * 2))); do
        if node_lost; then
            NODE_LOST=1
            echo "[$(date -u +%FT%TZ)] a node of this job failed ($(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %t' \
                 9>&- | tr '\n' ' ')): Slurm requeues the job (--requeue); it resumes from the newest checkpoint"
            break
        fi
        sleep 0.5
    done
fi
# Done for good (finished or failed): the engine array would otherwise hold its GPUs until its time
# limit. Not after a SIGTERM or a lost node: Slurm may be requeueing this job, which then needs its
# engines again (after `scancel` of the trainer, cancel the engines too: `slurm status` lists both).
if [ -n "$ENGINE_JOB" ] && [ "$GOT_TERM" = 0 ] && [ "$NODE_LOST" = 0 ]; then
    echo "training ended: cancelling the rollout engines (job $ENGINE_JOB)"
    scancel "$ENGINE_JOB" 9>&- || true
fi
# the normal end (finished or failed): the record is emptied, the flock ends with this shell
"$PYTHON" -m dapo_megatron.launch.slurm.job_start release "$LOCK_FILE" --fd 9 || true
exit "$rc"
