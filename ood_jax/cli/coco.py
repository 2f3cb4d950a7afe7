"""`ood-jax coco-eval | coco-demo`: the COCO evaluator on a detections file or a generated case."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ood_jax import files
from ood_jax.cli import help_text


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "coco-eval",
        help="COCO bbox evaluation of a detections JSON file",
        epilog=help_text.examples(
            "ood-jax coco-eval --gt instances_val.json --detections detections.json",
            "ood-jax coco-eval --gt gt.json --detections detections.json --json numbers.json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gt", required=True, help="COCO ground-truth JSON")
    p.add_argument("--detections", required=True, help="COCO results JSON (list of detections)")
    p.add_argument("--json", help="also write the numbers and per-category AP here")
    p.set_defaults(run=_coco_eval)

    p = subparsers.add_parser(
        "coco-demo",
        help="the COCO evaluator on a generated case",
        epilog=help_text.examples("ood-jax coco-demo --images 2000 --categories 80"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--categories", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_coco_demo)


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: {what} file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {what} file {path} is not valid JSON: {e}") from None


def _coco_eval(args: argparse.Namespace) -> None:
    from ood_jax.metrics import coco

    gt = _read_json(args.gt, "ground-truth")
    detections = _read_json(args.detections, "detections")
    if isinstance(detections, dict) and "annotations" in detections:
        detections = detections["annotations"]
    if not isinstance(detections, list):
        raise SystemExit(f"error: {args.detections} must hold a list of detections")
    try:
        ground_truth = coco.GroundTruth.from_coco(gt)
    except ValueError as e:
        raise SystemExit(f"error: {args.gt}: {e}") from None
    try:
        result = coco.evaluate_detailed(ground_truth, detections)
    except ValueError as e:
        raise SystemExit(f"error: {args.detections}: {e}") from None
    print(result.table())
    if args.json:
        out = {
            "stats": result.stats,
            "per_category_ap": {
                name: result.per_category_ap[cid.item()]
                for cid, name in zip(ground_truth.category_ids, result.category_names)
            },
        }
        files.write_json_atomic(args.json, out)


def _coco_demo(args: argparse.Namespace) -> None:
    from ood_jax.metrics import coco
    from ood_jax.testing import coco_cases

    print(f"Generating a COCO case: {args.images} images, {args.categories} categories ...")
    gt, detections = coco_cases.random_case(
        seed=args.seed, num_images=args.images, num_categories=args.categories
    )
    start = time.perf_counter()
    result = coco.evaluate_detailed(gt, detections)
    elapsed = time.perf_counter() - start
    print(
        f"{len(detections)} detections, {len(gt['annotations'])} ground-truth boxes, "
        f"evaluated in {elapsed:.2f} s\n"
    )
    print(result.table())
