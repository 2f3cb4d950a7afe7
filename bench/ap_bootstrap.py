#!/usr/bin/env python
"""Benchmark: a bootstrap confidence interval for COCO AP over images.

Builds a random case (``ood_jax.testing.coco_cases.random_case``: 5000 images, 5
categories, ~7 gt and 100 detections per image, crowd regions, tied scores and duplicate
detections, ...), evaluates it once (which keeps the per-image matches) and times:

  * ours:  ``ood_jax.metrics.bootstrap.ap_resamples`` on 1000 resamples of the images,
           from the matches (no matching per resample), and the interval from them;
  * peer:  what a toolkit without per-image matches has to do: build each resampled
           dataset (every drawn copy of an image a new image, with its ground truth
           and detections) and run our evaluator on it (``coco.evaluate``; as fast as
           any COCO evaluator here, see bench/coco_eval.py), for 20 of the same
           resamples, extrapolated to 1000.

Both sides are timed the same way, alternating (`common.time_alternating`): `--warmup`
untimed calls each (ours: the whole computation; peer: one extra resample), then `--steps`
timed calls; ours runs all resamples per call, the peer an equal share of its
`--peer-resamples` per call (building each resampled dataset is timed apart and left out).
Each side's figure is the median call, scaled to `--resamples` resamples.

The peer's APs must equal ours on the same resamples (max abs difference <= 1e-12 over
AP, AP50 and AP75); the exit status is 1 when they do not. The last line is
`common.result_line`'s (seconds for `--resamples` resamples).

    python bench/ap_bootstrap.py [--images 5000] [--resamples 1000] [--peer-resamples 20]
                                 [--steps 3] [--warmup 1] [--seed 0] [--smoke]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax.metrics import bootstrap, coco  # noqa: E402
from ood_jax.testing.coco_cases import random_case  # noqa: E402

TOL = 1e-12


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run_peer(gt, detections, weights):
    """Per resample: (stats of the explicit dataset, seconds to build it, seconds to evaluate)."""
    out = []
    for row in weights:
        (g, d), t_build = _timed(bootstrap.resampled_dataset, gt, detections, row)
        stats, t_eval = _timed(coco.evaluate, g, d)
        out.append((stats, t_build, t_eval))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--peer-resamples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3, help="timed calls of each side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls of each side first")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 step: for the tests")
    args = ap.parse_args(argv)
    if args.smoke:
        args.images, args.resamples, args.peer_resamples = 30, 20, 1
        args.steps, args.warmup = 1, 1
    if min(args.steps, args.resamples, args.peer_resamples) < 1 or args.warmup < 0:
        ap.error("need --steps, --resamples, --peer-resamples >= 1 and --warmup >= 0")

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"machine: {platform.machine()} {platform.processor() or ''}".rstrip())
    print(f"cpu count: os.cpu_count()={os.cpu_count()}  usable (affinity)={affinity}")
    print(f"python {platform.python_version()}, numpy {np.__version__}")

    (gt, dets), t_gen = _timed(random_case, args.seed, args.images)
    print(
        f"case: random_case(seed={args.seed}, num_images={args.images}): {len(gt['images'])} "
        f"images, {len(gt['categories'])} categories, {len(gt['annotations'])} annotations, "
        f"{len(dets)} detections; generated in {t_gen:.2f}s"
    )
    result, t_eval = _timed(coco.evaluate_detailed, gt, dets)
    matches = result.matches
    print(
        f"evaluation (once, keeps the matches): {t_eval:.2f}s; {len(matches.image)} detections "
        f"kept, {len(matches.candidate)} candidates; AP {result.stats['AP']:.4f}"
    )
    print()

    weights, t_weights = _timed(
        bootstrap.resample_weights, len(matches.image_ids), args.resamples, args.seed, "bench"
    )
    # The peer's resamples in weights' order: one per warm-up call, then an equal share per
    # timed call (its figure is a call's evaluation seconds scaled to --resamples).
    per_call = math.ceil(args.peer_resamples / args.steps)
    sizes = [1] * args.warmup + [per_call] * args.steps
    if sum(sizes) > args.resamples:
        raise SystemExit("--peer-resamples, --warmup and --steps need more --resamples")
    peer, peer_eval_s, ours_cpu, ours_runs = [], [], [], []

    def run_ours():
        cpu0 = time.process_time()
        ours_runs.append(bootstrap.ap_resamples(matches, weights))
        ours_cpu.append(time.process_time() - cpu0)

    def run_peer_call():
        start = len(peer)
        done = run_peer(gt, dets, weights[start : start + sizes[len(peer_eval_s)]])
        peer.extend(done)
        peer_eval_s.append(sum(p[2] for p in done))

    runs = common.time_alternating(
        {"ours": run_ours, "peer": run_peer_call}, args.steps, args.warmup
    )
    ours = ours_runs[-1]
    t_ours = statistics.median(runs["ours"])
    cpu_ours = statistics.median(ours_cpu[args.warmup :])
    low, high = bootstrap.centered_interval(result.stats["AP"], ours["AP"])
    stat = f"median of {args.steps} after {args.warmup} warm-up, alternating"
    print(
        f"ours: {args.resamples} resamples in {t_ours:.2f}s ({cpu_ours:.2f}s of CPU time; "
        f"+ {t_weights:.2f}s drawing the weights; {stat}); AP {result.stats['AP']:.4f}, 95% "
        f"interval [{low:.4f}, {high:.4f}], bootstrap s.e. {np.std(ours['AP'], ddof=1):.4f}"
    )
    t_build = sum(p[1] for p in peer[args.warmup :])
    t_peer = statistics.median(peer_eval_s[args.warmup :])
    scale = args.resamples / per_call
    print(
        f"peer: {per_call} explicit resamples per call evaluated in {t_peer:.2f}s ({stat}; "
        f"{t_build:.2f}s building all {args.steps * per_call} timed ones, not counted) -> "
        f"{t_peer * scale:.0f}s for {args.resamples} ({t_peer * scale / 60:.1f} min)"
    )
    print()

    worst = max(
        abs(stats[name] - ours[name][b]) for b, (stats, _, _) in enumerate(peer) for name in ours
    )
    ok = worst <= TOL
    print(
        f"agreement on the {len(peer)} shared resamples (max abs difference, AP/AP50/AP75): "
        f"{worst:.3e}  {'OK' if ok else 'MISMATCH'}"
    )
    print(f"{'implementation':<34}{'seconds':>10}{'ratio (time / ours)':>22}")
    for name, t in (
        (f"ours ({args.resamples} resamples)", t_ours),
        (f"peer (extrapolated to {args.resamples})", t_peer * scale),
    ):
        print(f"{name:<34}{t:>10.2f}{t / t_ours:>22.1f}")
    common.result_line(
        "ap_bootstrap",
        t_ours,
        "explicit resampled datasets through coco.evaluate (extrapolated)",
        t_peer * scale,
        stat,
        resamples=args.resamples,
        peer_resamples_timed=args.steps * per_call,
        images=args.images,
        agree=ok,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
