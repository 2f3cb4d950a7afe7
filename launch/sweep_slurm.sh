#!/usr/bin/env bash
# A model-selection sweep on a SLURM cluster: one array task per job of `ood-jax sweep` (one per
# seed, and per seed and left-out training domain with leave_one_domain_out), then a job that
# aggregates their evaluations once every task has succeeded.
#
# Run it on the login node from the repository root (it calls sbatch; it is not submitted
# itself):
#
#   launch/sweep_slurm.sh configs/X.py /shared/sweeps/x --seeds=3 [--protocols=...] \
#       [--leave-out=D,...] [--config.f=v ...]
#
# `ood-jax sweep ... --list-jobs` writes SWEEP_DIR/sweep.json and names the jobs; array task i
# runs `ood-jax sweep ... --job=i` in SWEEP_DIR/<job> (an ordinary workdir: resubmitting the same
# command resumes unfinished tasks and keeps finished ones), and the last job runs `ood-jax sweep
# --workdir=SWEEP_DIR --aggregate-only` (results.json, results.md). SWEEP_DIR must be on a
# filesystem the compute nodes share.
set -euo pipefail

usage() {
    cat <<EOF
usage: launch/sweep_slurm.sh CONFIG[:arg] SWEEP_DIR [--seeds=N] [--protocols=P,...]
           [--leave-out=D,...] [--config.FIELD=VALUE ...]

  Run from the repository root on a machine with sbatch. Each array task is one process on
  one node (single-host runs; multi-node jobs are launch/slurm_multinode.sh).
  Environment: SBATCH_OPTIONS, given to both sbatch calls (e.g. "--account=A --partition=P");
  TASK_OPTIONS, to the array's only (default "--gres=gpu:1 --cpus-per-task=8 --time=24:00:00");
  VENV (default \$PWD/.venv, activated in each task if it exists); DRY_RUN=1 prints the sbatch
  commands instead of submitting them.

example:
  launch/sweep_slurm.sh configs/synthetic_detr.py /shared/sweeps/detr --seeds=3 \\
      --config.eval_every=500
EOF
}

if [[ $# -ge 1 && ($1 == -h || $1 == --help) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 2 ]]; then
    usage >&2
    exit 2
fi
config=$1
sweep_dir=$2
shift 2
for arg in "$@"; do
    case $arg in
        --seeds=* | --protocols=* | --leave-out=* | --config.*) ;;
        *)
            echo "error: unexpected argument '$arg' (see --help)" >&2
            exit 2
            ;;
    esac
done
# shellcheck source=launch/env.sh
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ood_jax_env "$config"
if [[ -z ${DRY_RUN:-} ]] && ! command -v sbatch >/dev/null; then
    echo "error: no sbatch here; run this on a SLURM login node (DRY_RUN=1 shows the commands)" >&2
    exit 1
fi

sweep=(ood-jax sweep --config="$config" --workdir="$sweep_dir" "$@")
mapfile -t jobs < <("${sweep[@]}" --list-jobs)
if [[ ${#jobs[@]} -eq 0 ]]; then
    echo "error: the sweep has no jobs" >&2
    exit 1
fi
echo "sweep: ${#jobs[@]} jobs (${jobs[*]}) -> $sweep_dir"

# Each task activates the same virtualenv and runs from this directory (--wrap runs /bin/sh).
activate=$(printf %q "$venv/bin/activate")
prelude="cd $(printf %q "$PWD") && { [ ! -f $activate ] || . $activate; }"
task="$prelude && $(printf '%q ' "${sweep[@]}")--job=\$SLURM_ARRAY_TASK_ID"
aggregate="$prelude && $(printf '%q ' ood-jax sweep --workdir="$sweep_dir" --aggregate-only)"
read -r -a options <<<"${SBATCH_OPTIONS:-}"
read -r -a task_options <<<"${TASK_OPTIONS:---gres=gpu:1 --cpus-per-task=8 --time=24:00:00}"
logs=$sweep_dir/slurm
mkdir -p "$logs"

submit() {
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '%q ' sbatch "$@" >&2
        echo >&2
        echo "DRY_RUN"
    else
        sbatch --parsable "$@"
    fi
}

array=$(submit ${options[@]+"${options[@]}"} "${task_options[@]}" --job-name=ood-jax-sweep \
    --array="0-$((${#jobs[@]} - 1))" --output="$logs/%A_%a.out" --wrap="$task")
echo "submitted array job $array: task i runs job i of the list above"
final=$(submit ${options[@]+"${options[@]}"} --job-name=ood-jax-sweep-results \
    --dependency="afterok:$array" --cpus-per-task=2 --time=1:00:00 \
    --output="$logs/%j-results.out" --wrap="$aggregate")
echo "submitted job $final: aggregates into $sweep_dir/results.md once every task succeeded"
echo "by hand: ood-jax sweep --workdir=$sweep_dir --aggregate-only"
