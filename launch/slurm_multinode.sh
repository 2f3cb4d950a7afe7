#!/usr/bin/env bash
# Multi-node GPU training under SLURM: one process per GPU, all in one jax.distributed job.
#
# Submit from the repository root (the job runs there: sbatch copies this script elsewhere):
#
#   sbatch --nodes=4 launch/slurm_multinode.sh configs/X.py /shared/runs/x [--config.f=v ...]
#
# `--config.distributed=True` makes the trainer call jax.distributed.initialize(), which reads
# SLURM's variables itself: the coordinator is the first node of SLURM_STEP_NODELIST, the process
# count SLURM_NTASKS, the process id SLURM_PROCID, and each process takes the GPU whose index is
# its SLURM_LOCALID. So every task must see all of its node's GPUs: allocate them with --gres
# (or --gpus-per-node) and never with --gpus-per-task or --gpu-bind, which would hide the GPU a
# task is meant to use. Keep --ntasks-per-node equal to the GPUs per node.
#
# WORKDIR must be on a filesystem every node sees (checkpoints are written by all processes,
# results by process 0). config.input.batch_size is the global batch; it must divide by the
# number of processes. Rerunning the same command resumes from WORKDIR's newest checkpoint.
#
#SBATCH --job-name=ood-jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

usage() {
    cat <<EOF
usage: sbatch [--nodes=N] [--ntasks-per-node=G --gres=gpu:G] \\
           launch/slurm_multinode.sh CONFIG[:arg] WORKDIR [--config.FIELD=VALUE ...]

  Run from the repository root. CONFIG must define config.distributed (set True here).
  WORKDIR must be shared by all nodes.
  Environment: VENV (default \$SLURM_SUBMIT_DIR/.venv; activated on every node if it exists).
EOF
}

if [[ $# -ge 1 && ($1 == -h || $1 == --help) ]]; then
    usage
    exit 0
fi
if [[ -z ${SLURM_JOB_ID:-} ]]; then
    echo "error: not inside a SLURM job; submit this script with sbatch" >&2
    usage >&2
    exit 2
fi
if [[ $# -lt 2 ]]; then
    usage >&2
    exit 2
fi
config=$1
workdir=$2
shift 2
for arg in "$@"; do
    if [[ $arg != --config.* ]]; then
        echo "error: unexpected argument '$arg' (overrides look like --config.x=v)" >&2
        exit 2
    fi
done

cd "${SLURM_SUBMIT_DIR:?}"
# sbatch runs a copy of this script from its spool directory: the checkout is the submit dir.
# shellcheck source=launch/env.sh
. launch/env.sh
ood_jax_env "$config"

mkdir -p "$workdir"
echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST), $SLURM_NTASKS processes"
echo "train: $config -> $workdir $*"

# --kill-on-bad-exit: when one process fails, the others stop at once rather than after
# OOD_JAX_LOST_AFTER_S (ood_jax/multihost.py). scancel and preemption send SIGTERM: every process
# saves the same step and exits 143; resubmitting the same command resumes from it.
# --cpu-bind=none: the input pipeline's tf.data threads should use all of the task's cores.
srun --kill-on-bad-exit=1 --cpu-bind=none \
    ood-jax train --config="$config" --workdir="$workdir" --config.distributed=True "$@"
