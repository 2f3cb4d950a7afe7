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
                                   [--batches 200] [--warmup 10] [--train-step-ms MS]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    builder = datasets.build("synthetic_shifts", data_dir, config="demo")
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
    resumed = _first_batch_seconds(builder, split, config, RESUME_STEP)

    print(
        f"input pipeline: synthetic_shifts:demo, {builder.info.splits[split].num_examples} "
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
        f"  resume: first batch after {resumed:.2f} s at start_step={RESUME_STEP} "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="TFDS data dir to build into or reuse (default: temp)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=160)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--train-step-ms", type=float, default=None)
    args = parser.parse_args()
    if args.data_dir:
        run(args, args.data_dir)
    else:
        with tempfile.TemporaryDirectory() as data_dir:
            run(args, data_dir)


if __name__ == "__main__":
    main()
