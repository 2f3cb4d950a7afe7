"""The `ood-jax` command line: one subcommand per job, one module per command group."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from ood_jax import multihost
from ood_jax.cli import help_text
from ood_jax.cli import coco, compare, config_flags, data, export, launch, mine, mllm, report
from ood_jax.cli import stats, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ood-jax",
        description=__doc__,
        epilog=help_text.examples(
            "ood-jax demo",
            "ood-jax build synthetic_shifts --config tiny --data-dir data/tfds",
            "ood-jax train --help",
        )
        + f"\n\n--debug (anywhere) or {DEBUG_ENV}=1 shows the traceback of an error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    coco.add_parsers(sub)  # coco-eval, coco-demo
    data.add_parsers(sub)  # build, convert
    train.add_parsers(sub)  # pretrain, train, evaluate, sweep, demo
    export.add_parsers(sub)
    launch.add_parsers(sub)
    mine.add_parsers(sub)  # mine foci | oodbench | oodbench-ablation | oodg
    report.add_parser(sub)  # report: the effective-robustness page of several runs
    mllm.add_parsers(sub)  # eval-mllm, rescore, merge
    compare.add_parsers(sub)  # compare (two eval-mllm runs), compare-detectors (two workdirs)
    stats.add_parsers(sub)  # stats: OODBench's checks and FOCI's clip-conditional
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """argv -> the command's arguments; a config command's `args.config` is its loaded config
    with the `--config.field=value` overrides applied."""
    argv = list(argv)
    if not argv or argv[0] not in train.CONFIG_COMMANDS:
        return build_parser().parse_args(argv)
    rest, overrides = config_flags.split_overrides(argv)
    if "-h" in rest or "--help" in rest:
        print(train.config_help(argv[0], rest))
        raise SystemExit(0)
    args = build_parser().parse_args(rest)
    if args.config is not None:
        args.config = config_flags.load(args.config, overrides)
    elif overrides:
        raise ValueError(f"--config.{overrides[0][0]} needs --config=FILE[:arg]")
    return args


# A user's mistake (a missing file, a bad value, an unknown name) surfaces as one of these, with
# a message naming the file, field or value; `--debug` or OOD_JAX_DEBUG=1 keeps the traceback.
USER_ERRORS = (ValueError, OSError)
DEBUG_ENV = "OOD_JAX_DEBUG"


def _error_line(error: BaseException) -> str:
    message = " ".join(str(error).split()) or type(error).__name__
    return f"error: {message} (--debug shows the traceback)"


# Ctrl-C: a long job that knows what it kept re-raises `KeyboardInterrupt("what was kept; how to
# continue")` from its own handler; the message becomes the one line printed. Exit code 130 is
# the shell's for SIGINT.
INTERRUPTED_EXIT_CODE = 130


def _interrupted_line(interrupt: KeyboardInterrupt) -> str:
    message = " ".join(str(interrupt).split()) or "stopped by Ctrl-C"
    return f"interrupted: {message}"


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(argv)
    except SystemExit as e:
        # Every process of a preempted job stops at the same step, together.
        if e.code not in (None, 0, multihost.PREEMPTED_EXIT_CODE):
            code = e.code if isinstance(e.code, int) else 1
            multihost.exit_failed(e.code if isinstance(e.code, str) else None, code)
        raise
    except BaseException:
        multihost.exit_failed(traceback.format_exc().rstrip(), 1)
        raise


def _main(argv: Sequence[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        if argv[:1] != ["launch"]:
            multihost.initialize()  # a process of `ood-jax launch`, or of a job named likewise
        args = parse_args(argv)
        args.run(args)
    except USER_ERRORS as e:
        if debug:
            raise
        raise SystemExit(_error_line(e)) from None
    except multihost.Preempted as e:
        print(str(e), file=sys.stderr, flush=True)
        raise SystemExit(multihost.PREEMPTED_EXIT_CODE) from None
    except Exception as e:
        multihost.stop_if_lost(e)  # a collective failed because a process is lost: says so
        raise
    except KeyboardInterrupt as e:
        if debug:
            raise
        print(_interrupted_line(e), file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
