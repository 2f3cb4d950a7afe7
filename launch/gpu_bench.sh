#!/usr/bin/env bash
# DETR-R50 train and eval step times on one GPU, float32 and bfloat16, as one table, then the
# OODBench scorers' seconds per 1,000 images.
#
# Runs bench/detr_train_step.py --no-torch once per dtype (random weights and input, no data or
# checkpoint needed; torch is not imported), then bench/paper_scorers.py --no-torch (torch only
# builds the random weights on the host). Each run is capped at TIMEOUT / SCORER_TIMEOUT seconds,
# so the whole script, compiles included, stays within about 10 minutes on one H200.
set -euo pipefail

usage() {
    cat <<EOF
usage: launch/gpu_bench.sh [--batch B] [--size S] [--steps N] [--warmup W]

  --batch   images per step (default 4: the paper's per-GPU batch)
  --size    image height and width (default 800: the paper's shorter side)
  --steps   timed steps per measurement, median reported (default 20)
  --warmup  untimed steps after compiling (default 3)
  Environment:
    PYTHON       interpreter (default .venv/bin/python if present, else python3)
    TIMEOUT      seconds per dtype run (default 140)
    ALLOW_CPU=1  run even when JAX sees no GPU (to test this script)
    SKIP_SCORERS=1  leave out the scorer timings (bench/paper_scorers.py); SCORER_TIMEOUT (300)
EOF
}

batch=4
size=800
steps=20
warmup=3
while [[ $# -gt 0 ]]; do
    case $1 in
        --batch | --size | --steps | --warmup)
            [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || {
                echo "error: $1 needs a number" >&2
                usage >&2
                exit 2
            }
            declare "${1#--}=$2"
            shift 2
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "error: unexpected argument '$1'" >&2
            usage >&2
            exit 2
            ;;
    esac
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi

backend=$("$python" -c 'import jax; print(jax.default_backend())' 2>/dev/null | tail -n 1)
if [[ $backend != gpu && ${ALLOW_CPU:-0} != 1 ]]; then
    echo "error: JAX's backend is '$backend', not gpu (install with pip install -e '.[gpu]';" \
        "ALLOW_CPU=1 runs anyway)" >&2
    exit 1
fi
"$python" -c 'import jax; d = jax.devices()[0]; print(f"{len(jax.devices())} x {d.device_kind}")'

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
for dtype in float32 bfloat16; do
    echo "== $dtype: batch $batch, ${size}x$size, $steps steps after $warmup warm-up"
    # Only the bench's own lines; XLA's and absl's start-up chatter goes to the log alone.
    timeout "${TIMEOUT:-140}" "$python" bench/detr_train_step.py --no-torch --dtype "$dtype" \
        --batch "$batch" --size "$size" --steps "$steps" --warmup "$warmup" \
        >"$logs/$dtype.out" 2>"$logs/$dtype.err" || {
        status=$?
        tail -n 20 "$logs/$dtype.err" >&2
        [[ $status == 124 ]] && echo "error: $dtype run exceeded TIMEOUT=${TIMEOUT:-140} s" >&2
        exit "$status"
    }
    cat "$logs/$dtype.out"
done

# One row per dtype from the bench's lines "ours compile: train step A s, predict B s" and
# "train step: ours X s; inference: ours Y s".
echo
echo "DETR-R50 on $(
    "$python" -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null | tail -n 1
), batch $batch, ${size}x$size (median of $steps steps)"
printf '%-9s %14s %14s %12s %12s %14s\n' dtype "train step s" "images/s" "eval step s" \
    "images/s" "compile s"
for dtype in float32 bfloat16; do
    awk -v dtype="$dtype" -v batch="$batch" '
        /ours compile:/ { gsub(/,/, ""); compile_train = $5; compile_predict = $8 }
        /^train step: ours/ { gsub(/;/, ""); train = $4; infer = $8 }
        END {
            printf "%-9s %14.4f %14.1f %12.4f %12.1f %7.0f + %4.0f\n", dtype, train,
                batch / train, infer, batch / infer, compile_train, compile_predict
        }' "$logs/$dtype.out"
done

# OODBench's scorers at their published sizes: seconds per 1,000 images (image towers only).
# torch builds the random weights on the host and is not timed (--no-torch).
if [[ ${SKIP_SCORERS:-0} != 1 ]]; then
    echo
    echo "== scorers: CLIP ViT-L/14, BLIP-2 ViT-g, GroupViT, LiT-L16L image tower (batch 32)"
    timeout "${SCORER_TIMEOUT:-300}" "$python" bench/paper_scorers.py --no-torch --batch 32 \
        --steps 5 --warmup 1 >"$logs/scorers.out" 2>"$logs/scorers.err" || {
        status=$?
        tail -n 20 "$logs/scorers.err" >&2
        [[ $status == 124 ]] && echo "error: scorers exceeded SCORER_TIMEOUT=${SCORER_TIMEOUT:-300} s" >&2
        exit "$status"
    }
    cat "$logs/scorers.out"
fi
