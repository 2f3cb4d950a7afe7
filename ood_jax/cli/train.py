"""`ood-jax pretrain | train | evaluate | sweep | demo`: detectors from a config file."""

from __future__ import annotations

import argparse
import pathlib
import textwrap
from collections.abc import Sequence

from ood_jax import multihost
from ood_jax.cli import help_text
from ood_jax.cli import config_flags

# The commands whose experiment is a config file (--config=FILE[:arg] --config.field=value).
CONFIG_COMMANDS = {
    "pretrain": "pretrain a detector's backbone (the stage train runs first when configured)",
    "train": "train a detector",
    "evaluate": "evaluate a detector",
    "sweep": "train N seeds of a detector and select checkpoints by each model-selection protocol",
}

_EXAMPLES = {
    "pretrain": ["ood-jax pretrain --config=configs/synthetic_detr.py --workdir=workdirs/run"],
    "train": [
        "ood-jax train --config=configs/synthetic_detr.py:smoke --workdir=/tmp/smoke "
        "--config.total_steps=20",
        "ood-jax train --help --config=configs/counts_dino_r50.py",
    ],
    "evaluate": [
        "ood-jax evaluate --config=configs/synthetic_detr.py --workdir=workdirs/run",
        "ood-jax evaluate --config=configs/synthetic_detr.py --workdir=workdirs/run "
        "--corrupted=corrupted/NAME",
    ],
    "sweep": [
        "ood-jax sweep --config=configs/synthetic_detr.py:smoke --workdir=/tmp/sweep "
        "--seeds=2 --config.total_steps=4 --config.eval_every=2",
        "ood-jax sweep --workdir=/tmp/sweep --aggregate-only",
        "ood-jax sweep --workdir=/tmp/sweep --aggregate-only --conventions=domainbed",
    ],
}


def _comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of one config command."""
    experiment = config_flags.add_config_flag(parser, required=command != "sweep")
    experiment.add_argument(
        "--workdir",
        required=True,
        metavar="DIR",
        help="checkpoints, TensorBoard metrics and results; a workdir with checkpoints is "
        "resumed (with another model or data config only given "
        "--config.allow_config_change=True)",
    )
    if command == "evaluate":
        parser.add_argument(
            "--corrupted",
            metavar="corrupted/NAME",
            help="evaluate on a corrupted copy of the run's dataset (`ood-jax build "
            "corrupted`): corruptions.json, results_corruptions.md (mPC, rPC) and "
            "corruptions_severity.png in the workdir",
        )
    if command == "sweep":
        parser.add_argument(
            "--seeds",
            type=int,
            default=1,
            metavar="N",
            help="runs of seeds config.seed, config.seed + 1, ... (default 1)",
        )
        parser.add_argument(
            "--protocols",
            type=_comma_list,
            metavar="P,...",
            help="of last, training_domain, leave_one_domain_out, oracle (default: "
            "last,training_domain,oracle; leave_one_domain_out adds a run per seed and "
            "training domain)",
        )
        parser.add_argument(
            "--leave-out",
            type=_comma_list,
            default=[],
            metavar="D,...",
            help="the training domains leave_one_domain_out leaves out (default: all)",
        )
        parser.add_argument(
            "--job", metavar="NAME_OR_INDEX", help="run this job of the sweep only (an array task)"
        )
        parser.add_argument(
            "--list-jobs",
            action="store_true",
            help="write WORKDIR/sweep.json and print its jobs, one a line",
        )
        parser.add_argument(
            "--aggregate-only",
            action="store_true",
            help="only aggregate the jobs' evaluations into WORKDIR/results.json and "
            "results.md (no --config needed)",
        )
        parser.add_argument(
            "--conventions",
            choices=("ours", "domainbed"),
            default="ours",
            help="how checkpoints are selected and seeds summarized: ours (default; ties to the "
            "later step, the oracle's best step, validation AP on the pooled validation images, "
            "mean ± sample std) or domainbed (DomainBed's model_selection.py and "
            "collect_results.py: ties to the earlier step, the oracle's last step, validation "
            "AP averaged over the training domains, mean ± standard error)",
        )


def _parser_options(command: str) -> dict:
    what = CONFIG_COMMANDS[command]
    return dict(
        description=what[0].upper() + what[1:] + ".",
        epilog=help_text.examples(*_EXAMPLES[command]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_parsers(subparsers) -> None:
    for command, what in CONFIG_COMMANDS.items():
        parser = subparsers.add_parser(command, help=what, **_parser_options(command))
        add_flags(parser, command)
        parser.set_defaults(run=_RUNS[command])
    parser = subparsers.add_parser(
        "demo",
        help="build synthetic data, train DETR, evaluate, export",
        epilog=help_text.examples(
            "ood-jax demo",
            "ood-jax demo --config configs/synthetic_dino.py --workdir workdirs/synthetic_dino",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default="configs/synthetic_detr.py", metavar="FILE[:arg]")
    parser.add_argument("--data-dir", default="data/tfds")
    parser.add_argument("--workdir", default="workdirs/synthetic_detr")
    parser.set_defaults(run=_demo)


def config_help(command: str, argv: Sequence[str]) -> str:
    """A config command's --help: its flags and examples, the configs under ./configs and,
    given `--config`, that config's description and top-level fields."""
    parser = argparse.ArgumentParser(prog=f"ood-jax {command}", **_parser_options(command))
    add_flags(parser, command)
    lines = [parser.format_help().rstrip()]
    configs = sorted(pathlib.Path("configs").glob("*.py"))
    if configs:
        lines += ["", "configs here:"]
        for path in configs:
            first = (config_flags.docstring(path).splitlines() or [""])[0]
            lines += textwrap.wrap(
                f"{path}: {first}", 94, initial_indent="  ", subsequent_indent="    "
            )
    specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    specs += [b for a, b in zip(argv, argv[1:]) if a == "--config"]
    if specs:
        lines += ["", config_flags.describe(specs[-1])]
    return "\n".join(lines)


def _show(text: str | pathlib.Path) -> None:
    # Once per job, not once per process: the others never read what process 0 writes.
    if multihost.is_primary():
        print(text.read_text() if isinstance(text, pathlib.Path) else text)


def _pretrain(args: argparse.Namespace) -> None:
    from ood_jax.train import train

    path = train.pretrain_stage(args.config, args.workdir)
    _show(f"pretrained backbone: {path} (train on this workdir starts from it)")


def _train(args: argparse.Namespace) -> None:
    from ood_jax.train import train

    train.train_and_evaluate(args.config, args.workdir)
    _show(pathlib.Path(args.workdir) / "results.md")


def _evaluate(args: argparse.Namespace) -> None:
    if args.corrupted:
        from ood_jax.train import evaluate_corrupted

        evaluate_corrupted.evaluate_corrupted(args.config, args.workdir, args.corrupted)
        _show(pathlib.Path(args.workdir) / "results_corruptions.md")
        return
    from ood_jax.train import train

    train.evaluate(args.config, args.workdir)
    _show(pathlib.Path(args.workdir) / "results.md")


def _sweep(args: argparse.Namespace) -> None:
    from ood_jax.train import sweep

    if args.config is None and not args.aggregate_only:
        raise SystemExit("error: ood-jax sweep needs --config=FILE[:arg] (or --aggregate-only)")
    sweep.sweep(
        args.config,
        args.workdir,
        seeds=args.seeds,
        protocols=args.protocols or sweep.DEFAULT_PROTOCOLS,
        leave_out=args.leave_out,
        job=args.job,
        list_jobs=args.list_jobs,
        aggregate_only=args.aggregate_only,
        conventions=args.conventions,
    )
    if not (args.job or args.list_jobs):
        print((pathlib.Path(args.workdir) / "results.md").read_text())


_RUNS = {"pretrain": _pretrain, "train": _train, "evaluate": _evaluate, "sweep": _sweep}


def _demo(args: argparse.Namespace) -> None:
    """The main job on the embedded synthetic data: build, train, evaluate, export."""
    from ood_jax import config_files
    from ood_jax.train import export, train

    config = config_files.load_spec(args.config)
    config.dataset.data_dir = args.data_dir
    workdir = pathlib.Path(args.workdir)
    print(f"synthetic_shifts -> {args.data_dir}; training {config.model_name} in {workdir}")
    results = train.train_and_evaluate(config, str(workdir))
    exported = export.export(workdir, workdir / "exported")
    iid, ood = results["iid"], results["ood_average"]
    print()
    print((workdir / "results.md").read_text())
    print(
        f"in-domain AP50 {iid['AP50']:.3f}; held-out domains AP50 {ood['AP50']:.3f} "
        f"(drop {iid['AP50'] - ood['AP50']:.3f}); AP {iid['AP']:.3f} -> {ood['AP']:.3f}"
    )
    print(f"exported model: {exported}  (ood_jax.models.load_exported)")
