#!/usr/bin/env bash
# Training on a Cloud TPU pod slice: the same `ood-jax train` on every worker at once.
#
# Each worker needs the repository and its virtualenv at REPO_DIR (see launch/README.md).
# `--config.distributed=True` makes the trainer call jax.distributed.initialize(), which finds
# the slice's workers and coordinator from the TPU VM metadata by itself.
#
# WORKDIR must be one directory that every worker sees, e.g. a gcsfuse or Filestore mount:
# the trainer handles it as a local path (pathlib), so a gs:// URL would become a separate
# local directory named "gs:" on each worker; this script refuses one.
set -euo pipefail

usage() {
    cat <<EOF
usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG[:arg] WORKDIR [--config.FIELD=VALUE ...]

  TPU_NAME    the TPU VM (slice) name
  ZONE        its zone, e.g. us-central2-b
  CONFIG      config file path relative to REPO_DIR on the workers
  WORKDIR     a directory shared by all workers (mounted bucket or NFS), not a gs:// URL
  Environment:
    PROJECT   gcloud project (default: gcloud's configured one)
    REPO_DIR  repository on the workers (default: ~/ood-jax), with .venv inside
    DETACH=1  run under nohup on the workers, logging to REPO_DIR/train-<hostname>.log,
              so the run survives this ssh session

example:
  launch/tpu_pod.sh my-v5p-32 us-east5-a configs/synthetic_detr.py /mnt/runs/detr \\
      --config.total_steps=6000
EOF
}

if [[ $# -ge 1 && ($1 == -h || $1 == --help) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 4 ]]; then
    usage >&2
    exit 2
fi
name=$1
zone=$2
config=$3
workdir=$4
shift 4
for arg in "$@"; do
    if [[ $arg != --config.* ]]; then
        echo "error: unexpected argument '$arg' (overrides look like --config.x=v)" >&2
        exit 2
    fi
done
if [[ $workdir == *://* ]]; then
    echo "error: WORKDIR '$workdir' is a URL; mount the bucket on every worker and pass the path" >&2
    exit 2
fi
command -v gcloud >/dev/null || {
    echo "error: gcloud not found" >&2
    exit 1
}

repo_dir=${REPO_DIR:-'~/ood-jax'}
# Quote every argument for the remote shell; REPO_DIR stays unquoted so that ~ expands there.
train=$(printf '%q ' ood-jax train --config="$config" --workdir="$workdir" \
    --config.distributed=True "$@")
remote="cd $repo_dir && . .venv/bin/activate && mkdir -p $(printf '%q' "$workdir") && "
if [[ ${DETACH:-0} == 1 ]]; then
    remote+="nohup $train > train-\$(hostname).log 2>&1 < /dev/null & echo started on \$(hostname)"
else
    remote+="$train"
fi

echo "on every worker of $name ($zone): $remote"
gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" ${PROJECT:+--project="$PROJECT"} \
    --worker=all --command="$remote"
