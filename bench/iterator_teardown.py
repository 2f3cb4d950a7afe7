#!/usr/bin/env python
"""Benchmark: how long the end of a tf.data pipeline keeps its caller waiting, on loaded cores.

Each trial builds a pipeline shaped like the detector's (a parallel map with AUTOTUNE, a batch,
an AUTOTUNE prefetch), reads it for --read-seconds while --load busy processes share the cores,
and times the caller's wait as it lets go of the iterator: ours, `ood_jax.data.iteration`'s
`numpy_iterator` closed (the teardown on a daemon thread), against the peer, deleting
`dataset.as_numpy_iterator()` on the caller's thread. tf.data's autotuning thread can miss its
cancellation and sleep out its optimization period (which grows with the iterator's age, up to
60 s) before the deleting thread may go on; the peer's mean shows those stalls.

    python bench/iterator_teardown.py [--trials 15] [--read-seconds 3] [--load 3] [--smoke]

The last line is `common.result_line`'s: the mean wait of each side (stalls are rare events, so
the mean, not the median; the slowest wait and the count of waits over 0.5 s beside). `--smoke`
runs 2 short trials a side, for the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from ood_jax.data import iteration  # noqa: E402

STALL_S = 0.5


def _pipeline() -> tf.data.Dataset:
    return (
        tf.data.Dataset.range(1 << 40)
        .map(lambda x: tf.cast(x, tf.float32) * 2.0, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(8)
        .prefetch(tf.data.AUTOTUNE)
    )


def _read(batches, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        next(batches)
        time.sleep(0.001)  # a consumer that does work between batches, as a train loop does


def ours(seconds: float) -> float:
    batches = iteration.numpy_iterator(_pipeline())
    _read(batches, seconds)
    start = time.perf_counter()
    batches.close()
    return time.perf_counter() - start


def peer(seconds: float) -> float:
    batches = _pipeline().as_numpy_iterator()
    _read(batches, seconds)
    start = time.perf_counter()
    del batches
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=15, help="timed pipelines per side")
    parser.add_argument("--read-seconds", type=float, default=3.0)
    parser.add_argument(
        "--load", type=int, default=(os.cpu_count() or 1) + 1, help="busy processes"
    )
    parser.add_argument("--smoke", action="store_true", help="2 short trials a side, for tests")
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.read_seconds, args.load = 2, 0.3, 1
    if args.trials < 1 or args.read_seconds <= 0 or args.load < 0:
        parser.error("need --trials >= 1, --read-seconds > 0, --load >= 0")

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        waits: dict[str, list[float]] = {"ours": [], "peer": []}
        for i in range(1 + args.trials):  # the first trial of each side is a warm-up
            for name, trial in (("ours", ours), ("peer", peer)):
                wait = trial(args.read_seconds)
                if i:
                    waits[name].append(wait)
    finally:
        for process in busy:
            process.kill()
            process.wait()

    print(
        f"tf.data iterator teardown after {args.read_seconds:g} s of reading, {args.load} busy "
        f"processes on {os.cpu_count()} cores, TensorFlow {tf.__version__}: {args.trials} "
        "pipelines a side, alternating"
    )
    for name, label in (("ours", "numpy_iterator closed"), ("peer", "iterator deleted")):
        w = np.asarray(waits[name])
        print(
            f"  {label:22s} mean {w.mean():.3f} s, max {w.max():.3f} s, "
            f"{int((w > STALL_S).sum())} of {w.size} over {STALL_S} s"
        )
    common.result_line(
        "iterator_teardown",
        float(np.mean(waits["ours"])),
        "as_numpy_iterator deleted on the caller's thread",
        float(np.mean(waits["peer"])),
        f"mean of {args.trials} after 1 warm-up, alternating, {args.load} busy processes",
        unit="s the caller waits",
        ours_max_s=float(np.max(waits["ours"])),
        peer_max_s=float(np.max(waits["peer"])),
        peer_stalls=int((np.asarray(waits["peer"]) > STALL_S).sum()),
    )


if __name__ == "__main__":
    main()
