#!/bin/bash
# megatron-lns training job: megatron_lns-olmo_7b_lns_20b
# Rendered by `megatron-lns submit` from slurm/sbatch.template (docs/cluster.md).
# To run the same job again by hand: sbatch THIS_FILE
#SBATCH --job-name=megatron_lns-olmo_7b_lns_20b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --output=/lustre/runs/olmo_7b_lns_20b/lns/logs/%x-%j.log
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --partition=batch
#SBATCH --time=04:00:00
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --mem=0
#SBATCH --exclusive

# Requeue protocol: SLURM sends USR1 to this shell cluster.preemption_signal_lead_s
# before the time limit (or `scancel --signal=USR1 --full JOB` does, to preempt by hand).
# The shell forwards it to srun, every rank saves a checkpoint at the same step and
# exits 0, the trainer writes "stopped STEP" to run_status, and the shell requeues the
# job (same id; it resumes from that checkpoint). Reaching max_steps, a failure, or a
# TERM (scancel, SLURM's own preemption) ends the job without a self-requeue.
set -uo pipefail

workdir=/home/alice/megatron-lns
log_dir=/lustre/runs/olmo_7b_lns_20b/lns/logs
status_file=/lustre/runs/olmo_7b_lns_20b/lns/run_status
max_requeues=10
restart=${SLURM_RESTART_COUNT:-0}
run_log="$log_dir/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-restart${restart}.log"

cd "$workdir" || exit 1
mkdir -p "$log_dir" || exit 1
# fd 3 stays on the job log (--output, appended across requeues, where SLURM writes its
# own messages); everything else of this run goes to its own file.
exec 3>&1 >>"$run_log" 2>&1
note() {
    local line
    line="$(date -u +%FT%TZ) job $SLURM_JOB_ID restart $restart: $*"
    printf '%s\n' "$line"
    printf '%s\n' "$line" >&3
}
note "starting on ${SLURM_JOB_NODELIST}; output in $run_log"

export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_IB_HCA=mlx5
export NCCL_SOCKET_IFNAME='^lo,docker0'
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG=WARN

warned=0
srun_pid=
on_warning() {
    warned=1
    note "USR1: time limit or preemption ahead; every rank checkpoints and stops"
    if [[ -n $srun_pid ]]; then kill -USR1 "$srun_pid" 2>/dev/null; fi
}
trap on_warning USR1
trap 'note "TERM: the job is cancelled or preempted; ranks save and stop"' TERM

rm -f "$status_file"
# In the background so the traps run at once (bash delays a trap until a foreground
# command returns); wait returns early when one runs, hence the loop.
srun \
    --kill-on-bad-exit=1 \
    --nodes=16 \
    --ntasks-per-node=8 \
    --cpus-per-task=16 \
    --container-image=/lustre/containers/megatron-lns-te.sqsh \
    --container-mounts=/lustre:/lustre \
    python -u -m megatron_lns.launch.task /lustre/runs/olmo_7b_lns_20b/lns/slurm/20260101-000000/config.yaml &
srun_pid=$!
# A warning that came before srun existed: pass it on (if srun is too young to forward
# it, it dies of it with status 138, which is requeued below).
if ((warned)); then kill -USR1 "$srun_pid" 2>/dev/null; fi
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done
wait "$srun_pid"
rc=$?

state=
step=
if [[ -f $status_file ]]; then read -r state step <"$status_file"; fi
if ((rc == 0)) && [[ $state == finished ]]; then
    note "finished at step $step"
    exit 0
fi
# 138 = 128 + USR1: the warning reached the ranks before their handler was installed
# (during start-up); nothing was lost since the newest checkpoint.
if ((warned)) && { { ((rc == 0)) && [[ $state == stopped ]]; } || ((rc == 138)); }; then
    if ((restart >= max_requeues)); then
        note "stopped at step ${step:-?}; not requeued: cluster.max_requeues=$max_requeues" \
            "reached. Submit again to continue from the newest checkpoint"
        exit 1
    fi
    note "stopped at step ${step:-?}; requeueing ($((restart + 1)) of at most $max_requeues)"
    trap - TERM  # the requeue itself ends this shell with a TERM
    scontrol requeue "$SLURM_JOB_ID" || { note "error: scontrol requeue failed"; exit 1; }
    exit 0
fi
if ((rc != 0)); then
    note "failed: srun exited with status $rc; not requeued"
    exit "$rc"
fi
if [[ $state == stopped ]]; then
    note "stopped at step $step without a preemption warning (trainer.exit_interval or" \
        "TERM); not requeued"
    exit 0
fi
note "error: srun exited 0 but the trainer wrote no $status_file"
exit 1
