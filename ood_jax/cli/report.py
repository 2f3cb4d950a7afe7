"""`ood-jax report RUN_DIR... --out report.html`: the effective-robustness report of some runs."""

from __future__ import annotations

import argparse
import pathlib

from ood_jax.cli import help_text
from ood_jax.report import DEFAULT_TITLE, fit, write_report

DESCRIPTION = (
    "One static HTML page (inline SVG plots, no script, nothing loaded from elsewhere) about "
    "the run directories given: detector workdirs (ood-jax train / evaluate), eval-mllm runs "
    "(MLLMs and the CLIP baseline on FOCI, OODBench, COUNTS OODG) and corruptions.json files. "
    "It shows each run's in-domain against its held-out score, one panel per shift, with the "
    f"linear fit across the panel's runs (at least {fit.MIN_RUNS}) and each run's effective "
    "robustness, the distance of its held-out score from the fit; per-domain bars with their "
    "intervals; and the corruption curves with mPC and rPC."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `report` to the `ood-jax` sub-command parsers; returns its parser."""
    p = subparsers.add_parser(
        "report",
        help="one HTML page: in-domain vs held-out with effective robustness, per domain, "
        "corruptions",
        description=help_text.fill(DESCRIPTION),
        epilog=help_text.examples(
            "ood-jax report workdirs/detr workdirs/dino workdirs/deformable --out report.html",
            "ood-jax report runs/foci_qwen runs/foci_llava runs/foci_clip --out foci.html "
            "--scale linear",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="a detector workdir, an eval-mllm output directory, or a directory with a "
        "corruptions.json",
    )
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument(
        "--scale",
        choices=fit.SCALES,
        default="logit",
        help="scores the line is fitted on (default: logit, as Taori et al. 2020)",
    )
    p.add_argument("--title", default=DEFAULT_TITLE, help="the page's title")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> None:
    runs, panels = write_report(args.run_dirs, args.out, args.scale, args.title)
    fitted = sum(p.fit is not None for p in panels)
    print(
        f"wrote {pathlib.Path(args.out)}: {len(runs)} runs, {len(panels)} in-domain vs "
        f"held-out panels ({fitted} with a fit)"
    )
