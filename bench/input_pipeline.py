#!/usr/bin/env python
"""Benchmark: training input pipeline throughput next to what a train step consumes.

Builds synthetic_shifts:demo (2,240 train images over 14 domains, 128-160 px, rendered; ~30 s)
into a temporary directory, or reuses it from --data-dir, and times
``ood_jax.data.pipeline.train_iterator`` at demo resolution with the default augmentation:

  * images/s and batches/s over --batches batches, after --warmup batches;
  * the wait for the first batch when resuming at a late step (skipped records are read but
    not decoded) next to a fresh start.

With --train-step-ms it prints the images/s a train step of that length consumes at this batch
size and the ratio pipeline / step (above 1: the step, not the input, sets the pace); without it,
the steps/s the pipeline could feed. On a CPU-only machine both share the same cores.

    python bench/input_pipeline.py [--data-dir DIR] [--batch-size 16] [--image-size 160]
                                   [--batches 200] [--warmup 10] [--train-step-ms MS] [--smoke]

Only ours is timed (a train step's length is given, not measured). The last line is
`common.result_line`'s: seconds per batch (the mean over --batches), and with --train-step-ms
the step as the "peer" (ratio step / pipeline batch, above 1 when the input keeps up).
`--smoke` builds synthetic_shifts:tiny instead and reads a few small batches, for the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)
import ml_collections  # noqa: E402

from ood_jax import datasets  # noqa: E402
from ood_jax.data import counts, pipeline  # noqa: E402

RESUME_STEP = 10_000


def _first_batch_seconds(builder, split: str, config, start_step: int) -> float:
    start = time.perf_counter()
    next(pipeline.train_iterator(builder, split, config, start_step=start_step))
    return time.perf_counter() - start


def run(args: argparse.Namespace, data_dir: str) -> None:
    start = time.perf_counter()
    builder = datasets.build("synthetic_shifts", data_dir, config=args.dataset_config)
    built = time.perf_counter() - start
    split = counts.images_within("train", counts.DOMAINS, builder.info.splits.keys())
    config = ml_collections.ConfigDict(
        {
            "image_size": args.image_size,
            "max_size": args.image_size,
            "scales": tuple(range(args.image_size * 3 // 5, args.image_size + 1, 16)),
            "eval_size": args.image_size,
            "batch_size": args.batch_size,
        }
    )

    batches = pipeline.train_iterator(builder, split, config)
    for _ in range(args.warmup):
        next(batches)
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    seconds = time.perf_counter() - start
    images_per_s = args.batches * args.batch_size / seconds
    batches_per_s = args.batches / seconds
    fresh = _first_batch_seconds(builder, split, config, 0)
    resumed = _first_batch_seconds(builder, split, config, args.resume_step)

    print(
        f"input pipeline: synthetic_shifts:{args.dataset_config}, {builder.info.splits[split].num_examples} "
        f"train images over {len(counts.DOMAINS)} domains (prepared in {built:.1f} s)"
    )
    print(
        f"  {args.image_size} px canvas, batch {args.batch_size}, scales {tuple(config.scales)}, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} before timing"
    )
    print(
        f"  pipeline: {images_per_s:.0f} images/s = {batches_per_s:.1f} batches/s "
        f"({args.batches} batches after {args.warmup} warm-up)"
    )
    print(
        f"  resume: first batch after {resumed:.2f} s at start_step={args.resume_step} "
        f"vs {fresh:.2f} s at start_step=0"
    )
    if args.train_step_ms is None:
        print(
            f"  train step: not given (--train-step-ms); the pipeline keeps up with any step "
            f"of {1000 / batches_per_s:.1f} ms or more, i.e. up to {batches_per_s:.1f} steps/s "
            f"at batch {args.batch_size}"
        )
    else:
        consumed = args.batch_size / (args.train_step_ms / 1000)
        verdict = "the step sets the pace" if images_per_s >= consumed else "input-bound"
        print(
            f"  train step: {args.train_step_ms:.1f} ms consumes {consumed:.0f} images/s; "
            f"pipeline / step = {images_per_s / consumed:.2f}x ({verdict})"
        )
    common.result_line(
        "input_pipeline",
        seconds / args.batches,
        None if args.train_step_ms is None else "train step (given by --train-step-ms)",
        None if args.train_step_ms is None else args.train_step_ms / 1000,
        f"mean of {args.batches} batches after {args.warmup} warm-up",
        unit="s per batch",
        images_per_s=images_per_s,
        batch_size=args.batch_size,
        image_size=args.image_size,
        dataset=f"synthetic_shifts:{args.dataset_config}",
        resume_first_batch_s=resumed,
        fresh_first_batch_s=fresh,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="TFDS data dir to build into or reuse (default: temp)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=160)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--train-step-ms", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny dataset and batches: tests")
    args = parser.parse_args()
    args.dataset_config, args.resume_step = "demo", RESUME_STEP
    if args.smoke:
        args.dataset_config, args.resume_step = "tiny", 10
        args.batch_size, args.image_size, args.batches, args.warmup = 2, 64, 2, 1
    if args.data_dir:
        run(args, args.data_dir)
    else:
        with tempfile.TemporaryDirectory() as data_dir:
            run(args, data_dir)


if __name__ == "__main__":
    main()
