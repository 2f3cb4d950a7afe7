"""`ood-jax compare` (two eval-mllm runs, ood_jax.eval.compare) and `ood-jax compare-detectors`
(two detector workdirs, ood_jax.detection.compare): paired comparisons of two runs on the same
items, their flags and what they print."""

from __future__ import annotations

import argparse

from ood_jax.cli import help_text
from ood_jax.cli import stats as stats_cli
from ood_jax.detection import compare as detectors
from ood_jax.eval import compare as runs


def add_parsers(subparsers) -> None:
    """Adds `compare` and `compare-detectors` to the `ood-jax` sub-command parsers."""
    add_compare(subparsers)
    add_compare_detectors(subparsers)


def _paired_flags(
    p: argparse.ArgumentParser, resamples: str, default: int, help: str, seed_help: str
) -> None:
    """What every paired comparison takes: its resamples, their seed, the level, --json."""
    p.add_argument(
        resamples, type=stats_cli.count(1), default=default, help=f"{help} (default {default})"
    )
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument(
        "--confidence",
        type=stats_cli.probability,
        default=0.95,
        help="level of every interval (default 0.95)",
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


# ---------------------------------------------------------------------------------------------
# compare: two eval-mllm runs
# ---------------------------------------------------------------------------------------------

_COMPARE_DESCRIPTION = (
    help_text.fill(
        "Compares two eval-mllm runs on the same items: each run's score with its interval, the "
        "difference B - A with a paired bootstrap interval, and a paired test (exact McNemar for "
        "accuracies, paired bootstrap for OODBench's F1 and MCC), per group results.json "
        "reports (FOCI dataset, OODBench split, COUNTS OODG setting/ICE and domain). Items "
        "whose request failed in either run are left out of both and counted."
    )
    + "\n\n"
    + help_text.fill(
        "The runs must hold the same item ids with the same digest (prompt and images) and "
        "answer; otherwise compare refuses, naming how many differ and the first few. "
        "--on-common compares the ids both hold instead; a changed digest is always refused."
    )
)


def add_compare(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="two eval-mllm runs on the same items: scores, intervals and paired tests",
        description=_COMPARE_DESCRIPTION,
        epilog=help_text.examples(
            "ood-jax compare runs/foci_qwen runs/foci_llava",
            "ood-jax compare runs/oodbench_qwen runs/oodbench_llava --bootstrap 5000 --json",
            "ood-jax compare runs/foci runs/foci_limit100 --on-common --interval wilson",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_a", metavar="RUN_A", help="an eval-mllm --output directory")
    p.add_argument("run_b", metavar="RUN_B", help="another one over the same items")
    p.add_argument(
        "--on-common",
        action="store_true",
        help="compare the item ids both runs hold instead of refusing runs whose ids differ",
    )
    p.add_argument(
        "--interval",
        choices=tuple(runs.INTERVALS),
        default="clopper-pearson",
        help="interval of an accuracy: clopper-pearson (default; exact, as in results.json) "
        "or wilson (shorter; its coverage is near the level on average, not at every p)",
    )
    _paired_flags(
        p,
        "--bootstrap",
        runs.DEFAULT_BOOTSTRAP,
        "paired bootstrap resamples",
        "seed of the bootstrap resamples (default 0)",
    )
    p.set_defaults(run=_compare)
    return p


def _compare(args: argparse.Namespace) -> dict:
    result = runs.compare_runs(
        args.run_a,
        args.run_b,
        on_common=args.on_common,
        confidence=args.confidence,
        interval=args.interval,
        num_bootstrap=args.bootstrap,
        seed=args.seed,
    )
    return stats_cli.emit(args, result, [runs.render(result)])


# ---------------------------------------------------------------------------------------------
# compare-detectors: two detector workdirs
# ---------------------------------------------------------------------------------------------

_DETECTORS_DESCRIPTION = (
    "Paired bootstrap of two detectors' COCO AP on the same splits: for each split (iid and "
    "every held-out domain) and for the OOD average, A's AP, B's AP, A - B with its percentile "
    "interval and a two-sided bootstrap p-value. Both are scored on the same resamples of each "
    "split's images, from the per-image matches evaluation saved in each workdir (matches.npz); "
    "it refuses workdirs whose splits, images or ground truth differ."
)


def add_compare_detectors(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare-detectors",
        help="paired bootstrap of two detectors' AP on the same splits",
        description=help_text.fill(_DETECTORS_DESCRIPTION),
        epilog=help_text.examples(
            "ood-jax compare-detectors workdirs/detr workdirs/dino",
            "ood-jax compare-detectors workdirs/detr workdirs/dino --stat AP50 --json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workdir_a", metavar="WORKDIR_A", help="an evaluated workdir (matches.npz)")
    p.add_argument("workdir_b", metavar="WORKDIR_B", help="another, evaluated on the same splits")
    p.add_argument(
        "--stat", choices=detectors.STATS, default="AP", help="the table's stat (default AP)"
    )
    _paired_flags(
        p,
        "--resamples",
        detectors.DEFAULT_RESAMPLES,
        "bootstrap resamples of each split's images",
        "seed of the resamples; results.json's intervals use 0 (default 0)",
    )
    p.set_defaults(run=_compare_detectors)
    return p


def _compare_detectors(args: argparse.Namespace) -> dict:
    result = detectors.compare(
        args.workdir_a, args.workdir_b, args.resamples, args.seed, args.confidence
    )
    return stats_cli.emit(args, result, [detectors.format_table(result, args.stat)])
