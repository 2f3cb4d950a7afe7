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

The peer's 20 APs must equal ours on the same resamples (max abs difference <= 1e-12 over
AP, AP50 and AP75); the exit status is 1 when they do not.

    python bench/ap_bootstrap.py [--images 5000] [--resamples 1000] [--peer-resamples 20]
                                 [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    args = ap.parse_args(argv)

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
    cpu0 = time.process_time()
    ours, t_ours = _timed(bootstrap.ap_resamples, matches, weights)
    cpu_ours = time.process_time() - cpu0
    low, high = bootstrap.centered_interval(result.stats["AP"], ours["AP"])
    print(
        f"ours: {args.resamples} resamples in {t_ours:.2f}s ({cpu_ours:.2f}s of CPU time; "
        f"+ {t_weights:.2f}s drawing the weights); AP {result.stats['AP']:.4f}, 95% interval "
        f"[{low:.4f}, {high:.4f}], bootstrap s.e. {np.std(ours['AP'], ddof=1):.4f}"
    )

    peer = run_peer(gt, dets, weights[: args.peer_resamples])
    t_build = sum(p[1] for p in peer)
    t_peer = sum(p[2] for p in peer)
    scale = args.resamples / len(peer)
    print(
        f"peer: {len(peer)} explicit resamples evaluated in {t_peer:.2f}s "
        f"(+ {t_build:.2f}s building them) -> {t_peer * scale:.0f}s for {args.resamples} "
        f"({t_peer * scale / 60:.1f} min; {(t_peer + t_build) * scale / 60:.1f} min with building)"
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
