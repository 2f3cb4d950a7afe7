#!/usr/bin/env bash
# DETR-R50 and DINO-4scale R50 train and eval steps on one GPU, float32 and bfloat16, as one
# table (step seconds, images/s, GFLOP per step, TFLOP/s, MFU, compiled and device peak
# memory, compile seconds), then the OODBench scorers' seconds per 1,000 images.
#
# Runs bench/detr_train_step.py --no-torch and bench/dino_step.py --no-torch --no-op once per
# dtype (random weights and input, no data or checkpoint needed; torch is not imported), then
# bench/paper_scorers.py --no-torch (torch only builds the random weights on the host). The
# FLOPs come from XLA's cost analysis of the compiled steps, MFU divides the achieved rate by
# the device's dense peak (bench/common.py's PEAK_TFLOPS table, or PEAK_TFLOPS in the
# environment), the memory from the compiled steps' memory_analysis() and the device's
# memory_stats() (see bench/common.py's device_figures). Each run is capped at TIMEOUT,
# DINO_TIMEOUT or SCORER_TIMEOUT seconds, so the whole script, compiles included, stays within
# about 10 minutes on one H200.
set -euo pipefail

usage() {
    cat <<EOF2
usage: launch/gpu_bench.sh [--batch B] [--size S] [--steps N] [--warmup W]
                           [--dino-batch B] [--dino-size HxW] [--dino-steps N] [--dino-warmup W]

  --batch        DETR images per step (default 4: the paper's per-GPU batch)
  --size         DETR image height and width (default 800: the paper's shorter side)
  --steps        DETR timed steps per measurement, median reported (default 20)
  --warmup       DETR untimed steps after compiling (default 3)
  --dino-batch   DINO images per step (default 2: the paper's per-GPU batch)
  --dino-size    DINO image size, S or HxW (default 800x1333: the paper's scale); needs
                 (H/8)*(W/8) >= 900 encoder positions, e.g. 240
  --dino-steps   DINO timed steps (default 10: its compile takes the time)
  --dino-warmup  DINO untimed steps after compiling (default 2)
  Environment:
    PYTHON          interpreter (default .venv/bin/python if present, else python3)
    TIMEOUT         seconds per DETR dtype run (default 140)
    DINO_TIMEOUT    seconds per DINO dtype run (default 200)
    PEAK_TFLOPS     dense peak TFLOP/s for MFU, overriding bench/common.py's table
    ALLOW_CPU=1     run even when JAX sees no GPU (to test this script)
    SKIP_DINO=1     leave out DINO
    SKIP_SCORERS=1  leave out the scorer timings (bench/paper_scorers.py); SCORER_TIMEOUT (300)
EOF2
}

batch=4
size=800
steps=20
warmup=3
dino_batch=2
dino_size=800x1333
dino_steps=10
dino_warmup=2
while [[ $# -gt 0 ]]; do
    case $1 in
        --batch | --size | --steps | --warmup | --dino-batch | --dino-steps | --dino-warmup)
            [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || {
                echo "error: $1 needs a number" >&2
                usage >&2
                exit 2
            }
            name=${1#--}
            declare "${name//-/_}=$2"
            shift 2
            ;;
        --dino-size)
            [[ $# -ge 2 && $2 =~ ^[0-9]+(x[0-9]+)?$ ]] || {
                echo "error: $1 needs S or HxW" >&2
                usage >&2
                exit 2
            }
            dino_size=$2
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
[[ $dino_size == *x* ]] || dino_size=${dino_size}x$dino_size

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
device_kind=$("$python" -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null |
    tail -n 1)

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# run NAME LIMIT_VAR COMMAND...: COMMAND capped at ${LIMIT_VAR} seconds; the bench's own lines
# to the terminal and $logs/NAME.out, XLA's and absl's start-up chatter to $logs/NAME.err alone,
# whose tail is shown (and the script exits with the run's status) if the run fails.
declare -A limits=([TIMEOUT]=140 [DINO_TIMEOUT]=200 [SCORER_TIMEOUT]=300)
run() {
    local name=$1 var=$2 status=0
    local limit=${!var:-${limits[$var]}}
    shift 2
    timeout "$limit" "$@" >"$logs/$name.out" 2>"$logs/$name.err" || status=$?
    if [[ $status != 0 ]]; then
        tail -n 20 "$logs/$name.err" >&2
        [[ $status == 124 ]] && echo "error: $name run exceeded $var=$limit s" >&2
        exit "$status"
    fi
    cat "$logs/$name.out"
}

models=(detr)
[[ ${SKIP_DINO:-0} == 1 ]] || models+=(dino)
for dtype in float32 bfloat16; do
    echo "== DETR-R50 $dtype: batch $batch, ${size}x$size, $steps steps after $warmup warm-up"
    run "detr-$dtype" TIMEOUT "$python" bench/detr_train_step.py --no-torch \
        --dtype "$dtype" --batch "$batch" --size "$size" --steps "$steps" --warmup "$warmup"
    [[ ${SKIP_DINO:-0} == 1 ]] && continue
    echo "== DINO-4scale R50 $dtype: batch $dino_batch, $dino_size, $dino_steps steps after" \
        "$dino_warmup warm-up"
    run "dino-$dtype" DINO_TIMEOUT "$python" bench/dino_step.py --no-torch --no-op \
        --dtype "$dtype" --batch "$dino_batch" --size "$dino_size" --steps "$dino_steps" \
        --warmup "$dino_warmup"
done

# One row per model and dtype from the benches' lines "ours compile: train step A s, predict
# B s" and "device figures: KIND step S s, I images/s, G GFLOP, T TFLOP/s, MFU M%, compiled
# peak C GB, device peak D GB (...)" (bench/common.py's device_figures). "tr/ev": train step /
# eval step; the device peak is the train line's: the max over both steps.
echo
echo "On $device_kind: DETR-R50 batch $batch at ${size}x$size (median of $steps steps);" \
    "DINO-4scale R50 batch $dino_batch at $dino_size (median of $dino_steps steps)"
printf '%-5s %-9s %9s %8s %9s %8s %15s %13s %11s %11s %7s %13s\n' model dtype "train s" \
    "img/s" "eval s" "img/s" "GFLOP tr/ev" "TFLOP/s tr/ev" "MFU tr/ev" "compiled GB" \
    "dev GB" "compile s"
for model in "${models[@]}"; do
    for dtype in float32 bfloat16; do
        awk -v model="$model" -v dtype="$dtype" '
            function word(text, n, parts) { split(text, parts, " "); return parts[n] }
            /ours compile:/ { line = $0; gsub(/,/, "", line); compile_train = word(line, 5)
                compile_predict = word(line, 8) }
            /^device figures:/ {
                split($0, f, ", "); kind = word(f[1], 3)
                seconds[kind] = word(f[1], 5); rate[kind] = word(f[2], 1)
                gflop[kind] = word(f[3], 1); tflops[kind] = word(f[4], 1)
                mfu[kind] = word(f[5], 2); compiled[kind] = word(f[6], 3)
                device[kind] = word(f[7], 3)
            }
            END {
                printf "%-5s %-9s %9s %8s %9s %8s %15s %13s %11s %11s %7s %13s\n", model,
                    dtype, seconds["train"], rate["train"], seconds["predict"],
                    rate["predict"], gflop["train"] "/" gflop["predict"],
                    tflops["train"] "/" tflops["predict"], mfu["train"] "/" mfu["predict"],
                    compiled["train"] "/" compiled["predict"], device["train"],
                    compile_train " + " compile_predict
            }' "$logs/$model-$dtype.out"
    done
done
for dtype in float32 bfloat16; do
    sed -n "s/^ *peak for MFU: /MFU $dtype: peak /p" "$logs/detr-$dtype.out"
done

# OODBench's scorers at their published sizes: seconds per 1,000 images (image towers only).
# torch builds the random weights on the host and is not timed (--no-torch).
if [[ ${SKIP_SCORERS:-0} != 1 ]]; then
    echo
    echo "== scorers: CLIP ViT-L/14, BLIP-2 ViT-g, GroupViT, LiT-L16L image tower (batch 32)"
    run scorers SCORER_TIMEOUT "$python" bench/paper_scorers.py --no-torch --batch 32 \
        --steps 5 --warmup 1
fi
