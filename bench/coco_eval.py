#!/usr/bin/env python
"""Benchmark: COCO bbox evaluation, from Python dicts to the 12 summary numbers.

Builds a val2017-sized random case (``ood_jax.testing.coco_cases.val2017_like``:
5000 images, 80 categories, ~7 gt and 100 detections per image, with crowd
regions, tied scores, >100-detection groups, ...) and times, in one run:

  * ours:              ``ood_jax.metrics.coco.evaluate(gt, detections)``
  * pycocotools:       COCO + loadRes + COCOeval evaluate/accumulate/summarize
  * faster-coco-eval:  its COCO + loadRes + COCOeval_faster evaluate/accumulate/summarize

each the same way: imported before any timing, `--warmup` untimed calls, then the
median of `--steps` timed calls, the three alternating (`common.time_alternating`).
The peers write into the dicts they are given, so each of their calls gets fresh
copies, made outside the timing. Checks the peers agree with ours within 1e-6 (max
abs difference over the 12 numbers) and prints a table of seconds and ratios (peer
time / ours). The last line is `common.result_line`'s, against faster-coco-eval
(else pycocotools), with every peer under "peers".

    python bench/coco_eval.py [--images 5000] [--seed 0] [--steps 3] [--warmup 1]
                              [--skip-pycocotools] [--skip-faster-coco-eval] [--smoke]

Exit status 1 when a peer disagrees by more than the tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402  (bench/, the directory of this script)

from ood_jax.metrics import coco  # noqa: E402
from ood_jax.testing.coco_cases import val2017_like  # noqa: E402

TOL = 1e-6


def _fresh_copies(gt: dict, detections: list[dict]) -> tuple[dict, list[dict]]:
    """pycocotools and faster-coco-eval write into the annotation and detection
    dicts they are given (ignore, id, area, iscrowd, segmentation); each peer gets
    its own shallow copies, made outside the timed region."""
    gt_copy = {**gt, "annotations": [dict(a) for a in gt["annotations"]]}
    return gt_copy, [dict(d) for d in detections]


def run_ours(gt, detections):
    stats = coco.evaluate(gt, detections)
    return np.array([stats[k] for k in coco.STAT_NAMES], np.float64)


def run_pycocotools(gt, detections):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(detections)
        E = COCOeval(coco_gt, coco_dt, "bbox")
        E.evaluate()
        E.accumulate()
        E.summarize()
    return np.asarray(E.stats[:12], np.float64)


def run_faster_coco_eval(gt, detections):
    from faster_coco_eval import COCO, COCOeval_faster

    def quiet(*args, **kwargs):
        pass

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt, print_function=quiet)
        coco_dt = coco_gt.loadRes(detections)
        E = COCOeval_faster(coco_gt, coco_dt, "bbox", print_function=quiet)
        E.evaluate()
        E.accumulate()
        E.summarize()
    return np.asarray(E.stats[:12], np.float64)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--images", type=int, default=5000, help="number of images (val2017: 5000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-pycocotools", action="store_true")
    ap.add_argument("--skip-faster-coco-eval", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="timed calls of each")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls of each first")
    ap.add_argument("--smoke", action="store_true", help="20 images, 1 step: for the tests")
    args = ap.parse_args(argv)
    if args.smoke:
        args.images, args.steps, args.warmup = 20, 1, 1
    if args.steps < 1 or args.warmup < 0:
        ap.error("need --steps >= 1 and --warmup >= 0")

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"machine: {platform.machine()} {platform.processor() or ''}".rstrip())
    print(f"cpu count: os.cpu_count()={os.cpu_count()}  usable (affinity)={affinity}")
    print(f"python {platform.python_version()}, numpy {np.__version__}")

    (gt, dets), t_gen = _timed(val2017_like, args.seed, args.images)
    n_crowd = sum(a["iscrowd"] for a in gt["annotations"])
    print(
        f"case: val2017_like(seed={args.seed}, num_images={args.images}): {len(gt['images'])} images, "
        f"{len(gt['categories'])} categories, {len(gt['annotations'])} annotations ({n_crowd} crowd), "
        f"{len(dets)} detections; generated in {t_gen:.2f}s"
    )
    print()

    # Imports outside the timing: the first call of a peer would otherwise pay for them.
    peers = {}
    if not args.skip_pycocotools:
        try:
            import pycocotools.cocoeval  # noqa: F401

            peers["pycocotools"] = run_pycocotools
        except ImportError as e:
            print(f"pycocotools: not available ({e})")
    if not args.skip_faster_coco_eval:
        try:
            import faster_coco_eval  # noqa: F401

            peers["faster-coco-eval"] = run_faster_coco_eval
        except ImportError as e:
            print(f"faster-coco-eval: not available ({e})")

    results: dict[str, list[np.ndarray]] = {name: [] for name in ("ours", *peers)}

    def keep(name, fn):
        return lambda *a: results[name].append(fn(*a))

    fns = {"ours": keep("ours", run_ours), **{n: keep(n, fn) for n, fn in peers.items()}}
    setup = {"ours": lambda: (gt, dets), **{n: lambda: _fresh_copies(gt, dets) for n in peers}}
    load = os.getloadavg()[0]
    runs = common.time_alternating(fns, args.steps, args.warmup, setup)
    times = {name: statistics.median(t) for name, t in runs.items()}
    if any(not np.array_equal(r, results["ours"][0]) for r in results["ours"]):
        print("WARNING: ours is not deterministic across runs")
    results = {name: r[0] for name, r in results.items()}
    ref_time = times["ours"]

    # ------------------------------------------------------------- agreement
    ok = True
    print("agreement with ours (max abs difference over the 12 numbers):")
    for name in results:
        if name == "ours":
            continue
        diff = np.abs(results[name] - results["ours"])
        worst = int(np.argmax(diff))
        good = bool(diff.max() <= TOL)
        ok &= good
        print(
            f"  {name:<18} {diff.max():.3e}  {'OK' if good else 'MISMATCH'}"
            + (
                ""
                if good
                else f" (worst {coco.STAT_NAMES[worst]}: ours {results['ours'][worst]!r} "
                f"vs {results[name][worst]!r})"
            )
        )
    print()

    # ----------------------------------------------------------------- stats
    names = list(results)
    print(f"{'stat':<6}" + "".join(f"{n:>18}" for n in names))
    for i, s in enumerate(coco.STAT_NAMES):
        print(f"{s:<6}" + "".join(f"{results[n][i]:>18.6f}" for n in names))
    print()

    # ---------------------------------------------------------------- timing
    stat = common.stat_text(args.steps, args.warmup)
    print(
        f"seconds: {stat}, each side imported and warmed up alike; peers get fresh copies of "
        f"the dicts outside the timing; load average {load:.1f} before"
    )
    print(f"{'implementation':<20}{'seconds':>10}{'ratio (time / ours)':>24}")
    for name, t in times.items():
        print(f"{name:<20}{t:>10.3f}{t / ref_time:>24.2f}")
    print()
    print("all agree within 1e-6" if ok else "DISAGREEMENT beyond 1e-6")
    headline = next((n for n in ("faster-coco-eval", "pycocotools") if n in times), None)
    common.result_line(
        "coco_eval",
        times["ours"],
        headline,
        times.get(headline),
        stat,
        images=args.images,
        agree=ok,
        peers={
            n: {"peer_s": times[n], "ratio": round(times[n] / ref_time, 4)}
            for n in times
            if n != "ours"
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
