#!/usr/bin/env bash
# Trains a config on this machine, then evaluates it in-domain and on the held-out domains.
#
# `ood-jax train` ends with the evaluation (results.json, results.md and per_domain_ap.png in
# WORKDIR) and resumes from WORKDIR's newest checkpoint by itself, so rerunning this script
# after an interruption continues the run. `--eval-only` re-evaluates the newest checkpoint.
# `--processes N` runs it as N processes of one jax.distributed job (`ood-jax launch`), as a
# SLURM or TPU-pod job would: the way to try a multi-host run on one machine.
set -euo pipefail

usage() {
    cat <<EOF
usage: launch/local.sh CONFIG[:arg] WORKDIR [--eval-only] [--processes N [--cpu-devices D]]
                       [--config.FIELD=VALUE ...]

  CONFIG      an ml_collections config file, e.g. configs/synthetic_detr.py or
              configs/synthetic_detr.py:smoke
  WORKDIR     run directory: checkpoints, TensorBoard metrics, results (resumed if it has any)
  --eval-only evaluate WORKDIR's newest checkpoint instead of training
  --processes N    run as N processes of one jax.distributed job (GPUs shared out equally)
  --cpu-devices D  with --processes: D simulated CPU devices per process
  --config.*  overrides passed through to ood-jax, e.g. --config.total_steps=100

  Environment: OOD_JAX (the ood-jax executable; default .venv/bin/ood-jax, else the one on PATH);
  OOD_JAX_MALLOC=system keeps glibc's default malloc (see ood_jax/malloc.py).

examples:
  launch/local.sh configs/synthetic_detr.py:smoke /tmp/smoke --config.total_steps=20
  launch/local.sh configs/synthetic_detr.py:smoke /tmp/smoke2 --processes 2 --cpu-devices 2
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
workdir=$2
shift 2

command=train
overrides=()
launch=()
while [[ $# -gt 0 ]]; do
    arg=$1
    shift
    case $arg in
        --eval-only) command=evaluate ;;
        --processes | --cpu-devices)
            if [[ $# -eq 0 || ! $1 =~ ^[0-9]+$ ]]; then
                echo "error: $arg needs a number" >&2
                exit 2
            fi
            launch+=("$arg" "$1")
            shift
            ;;
        --config.*) overrides+=("$arg") ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            # Caught here rather than by absl, whose message would not mention this script.
            echo "error: unexpected argument '$arg' (overrides look like --config.x=v)" >&2
            usage >&2
            exit 2
            ;;
    esac
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ! -f ${config%%:*} ]]; then
    echo "error: config file ${config%%:*} does not exist" >&2
    exit 2
fi
if [[ -n ${OOD_JAX:-} ]]; then
    ood_jax=$OOD_JAX
elif [[ -x $repo/.venv/bin/ood-jax ]]; then
    ood_jax=$repo/.venv/bin/ood-jax
elif command -v ood-jax >/dev/null; then
    ood_jax=$(command -v ood-jax)
else
    echo "error: no ood-jax executable; install the package (pip install -e .) or set OOD_JAX" >&2
    exit 1
fi

if [[ ${#launch[@]} -gt 0 && " ${launch[*]} " != *" --processes "* ]]; then
    echo "error: --cpu-devices needs --processes" >&2
    exit 2
fi

mkdir -p "$workdir"
echo "$command: $config -> $workdir ${launch[*]:-} ${overrides[*]:-}"
if [[ ${#launch[@]} -gt 0 ]]; then
    "$ood_jax" launch "${launch[@]}" "$command" --config="$config" --workdir="$workdir" \
        ${overrides[@]+"${overrides[@]}"}
else
    "$ood_jax" "$command" --config="$config" --workdir="$workdir" ${overrides[@]+"${overrides[@]}"}
fi
echo "results: $workdir/results.json, $workdir/results.md, $workdir/per_domain_ap.png"
echo "metrics: tensorboard --logdir $workdir/tensorboard"
