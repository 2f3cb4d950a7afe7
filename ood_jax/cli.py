"""The `ood-jax` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any, Sequence

from ood_jax import config_files, files
from ood_jax.eval import cli as eval_cli
from ood_jax.mining import cli as mining_cli
from ood_jax.stats import cli as stats_cli


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
        result = coco.evaluate_detailed(gt, detections)
    except ValueError as e:
        raise SystemExit(f"error: {args.detections}: {e}") from None
    print(result.table())
    if args.json:
        out = {
            "stats": result.stats,
            "per_category_ap": {
                name: result.per_category_ap[int(cid)]
                for cid, name in zip(
                    coco.GroundTruth.from_coco(gt).category_ids, result.category_names
                )
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


def _load_config(spec: str):
    """`path/to/config.py[:arg]` -> its get_config(arg), as `--config=` flags load it."""
    try:
        return config_files.load_spec(spec)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None


def _demo(args: argparse.Namespace) -> None:
    """The main job on the embedded synthetic data: build, train, evaluate, export."""
    from ood_jax.train import export, train

    config = _load_config(args.config)
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


def _build(args: argparse.Namespace) -> None:
    from ood_jax import datasets
    from ood_jax.data import building

    try:
        builder = datasets.build(
            args.name,
            data_dir=args.data_dir,
            source=args.source,
            config=args.config,
            on_error=args.on_error,
        )
    except building.BuildError as e:
        raise SystemExit(f"error: {e}") from None
    splits = {name: info.num_examples for name, info in builder.info.splits.items()}
    print(
        f"\n{builder.name} {builder.builder_config.name if builder.builder_config else ''}"
        f" {builder.version} -> {builder.data_dir}"
    )
    report = getattr(builder, "report", None)
    print(report.summary(splits) if report else "\n".join(f"  {k}: {v}" for k, v in splits.items()))


def _export(args: argparse.Namespace) -> None:
    from ood_jax.train import export

    path = export.export(args.workdir, args.out, step=args.step)
    print(f"exported {args.workdir} -> {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ood-jax",
        description=__doc__,
        epilog=f"--debug (anywhere) or {DEBUG_ENV}=1 shows the traceback of an error.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coco-eval", help="COCO bbox evaluation of a detections JSON file")
    p.add_argument("--gt", required=True, help="COCO ground-truth JSON")
    p.add_argument("--detections", required=True, help="COCO results JSON (list of detections)")
    p.add_argument("--json", help="also write the numbers and per-category AP here")
    p.set_defaults(run=_coco_eval)

    p = sub.add_parser("build", help="build a TFDS dataset from its release files")
    p.add_argument("name", help="counts, foci, oodbench or synthetic_shifts")
    p.add_argument(
        "--source", help="directory holding the release (not needed for synthetic_shifts)"
    )
    p.add_argument("--data-dir", required=True, help="TFDS data directory to write to")
    p.add_argument(
        "--config", help="builder config, e.g. food101 for foci or tiny for synthetic_shifts"
    )
    p.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="a corrupt or missing image fails the build (default) or is skipped and counted",
    )
    p.set_defaults(run=_build)

    for command, what in DETECTOR_COMMANDS.items():
        sub.add_parser(
            command,
            help=f"{what}: --config=configs/X.py[:arg] --workdir=DIR [--config.f=v]",
        )

    p = sub.add_parser("export", help="a self-contained inference checkpoint of a training run")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.set_defaults(run=_export)

    p = sub.add_parser("demo", help="build synthetic data, train DETR, evaluate, export")
    p.add_argument("--config", default="configs/synthetic_detr.py")
    p.add_argument("--data-dir", default="data/tfds")
    p.add_argument("--workdir", default="workdirs/synthetic_detr")
    p.set_defaults(run=_demo)

    p = sub.add_parser("coco-demo", help="the COCO evaluator on a generated case")
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--categories", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_coco_demo)

    mining_cli.add_parsers(sub)
    eval_cli.add_parsers(sub)  # eval-mllm
    # stats: OODBench's checks, plus FOCI's clip-conditional, which reads eval-mllm runs.
    eval_cli.add_stats_parsers(stats_cli.add_parsers(sub))
    return parser


# Commands that take ml_collections config flags (--config=FILE[:arg] --config.x=v).
DETECTOR_COMMANDS = {
    "pretrain": "pretrain a detector's backbone (the stage train runs first when configured)",
    "train": "train a detector",
    "evaluate": "evaluate a detector",
}


_DETECTOR_EXAMPLES = {
    "pretrain": "ood-jax pretrain --config=configs/synthetic_detr.py --workdir=workdirs/run",
    "train": "ood-jax train --config=configs/synthetic_detr.py:smoke --workdir=/tmp/smoke "
    "--config.total_steps=20",
    "evaluate": "ood-jax evaluate --config=configs/synthetic_detr.py --workdir=workdirs/run",
}


def _detector_help(command: str, argv: Sequence[str]) -> str:
    """`ood-jax train --help`: the flags, an example, the configs at hand and, given --config,
    that config's description (its variants) and its top-level fields with their values."""
    lines = [
        f"usage: ood-jax {command} --config=FILE[:variant] --workdir=DIR "
        "[--config.FIELD=VALUE ...] [--debug]",
        "",
        DETECTOR_COMMANDS[command] + ".",
        "",
        "flags:",
        "  --config=FILE[:variant]  the experiment: a config file's get_config(variant)",
        "  --workdir=DIR            checkpoints, TensorBoard metrics and results; a workdir with",
        "                           checkpoints is resumed",
        "  --config.FIELD=VALUE     override a config field, e.g. --config.total_steps=100",
        "  --debug                  show the traceback of an error",
        "",
        "example:",
        f"  {_DETECTOR_EXAMPLES[command]}",
    ]
    configs = sorted(pathlib.Path("configs").glob("*.py"))
    if configs:
        lines += ["", "configs here:"]
        lines += [f"  {path}: {_first_line(path)}" for path in configs]
    specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if specs:
        path, _, variant = specs[-1].partition(":")
        config = config_files.load(path, variant)
        lines += ["", f"{specs[-1]}:", _docstring(pathlib.Path(path)), "", "top-level fields:"]
        for key in sorted(config.keys()):
            value = config[key]
            if hasattr(value, "keys"):
                lines.append(f"  {key}.{{{', '.join(sorted(value.keys()))}}}")
            else:
                lines.append(f"  {key} = {value!r}")
    return "\n".join(lines)


def _docstring(path: pathlib.Path) -> str:
    import ast

    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _first_line(path: pathlib.Path) -> str:
    return (_docstring(path).splitlines() or [""])[0]


def _check_config_flags(argv: Sequence[str]) -> None:
    """Fails with one line on a missing config file, an unknown variant or an unknown
    `--config.field` override, before absl reports them as tracebacks."""
    import difflib

    import ml_collections

    specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if not specs:
        return
    config = config_files.load_spec(specs[-1])
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        name = arg[len("--config.") :].split("=", 1)[0]
        node, path = config, "config"
        for part in name.split("."):
            if not isinstance(node, ml_collections.ConfigDict):
                break
            if part not in node:
                close = difflib.get_close_matches(part, list(node.keys()), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ValueError(f"--config.{name}: {path} has no field {part!r}{hint}")
            node, path = node[part], f"{path}.{part}"


def _train_or_evaluate(command: str, argv: Sequence[str]) -> None:
    """`pretrain`, `train` and `evaluate`: config flags --config=FILE[:arg] --config.x=v."""
    from absl import flags
    from ml_collections import config_flags

    if "--help" in argv or "-h" in argv:
        print(_detector_help(command, argv))
        return
    _check_config_flags(argv)
    flag_values = flags.FlagValues()
    # sys_argv: overrides (--config.x=v) are read from argv, not from the process's sys.argv.
    config_flags.DEFINE_config_file(
        "config",
        None,
        "configs/X.py[:variant]",
        flag_values=flag_values,
        lock_config=True,
        sys_argv=[f"ood-jax {command}", *argv],
    )
    flags.DEFINE_string(
        "workdir", None, "run directory (checkpoints, results)", flag_values=flag_values
    )
    try:
        flag_values([f"ood-jax {command}", *argv])
    except flags.Error as e:
        raise SystemExit(f"error: {e}") from None
    if flag_values.config is None or flag_values.workdir is None:
        raise SystemExit(
            f"usage: ood-jax {command} --config=configs/X.py[:arg] --workdir=DIR [--config.f=v]"
        )

    from ood_jax.train import train

    if command == "pretrain":
        try:
            path = train.pretrain_stage(flag_values.config, flag_values.workdir)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"pretrained backbone: {path} (train on this workdir starts from it)")
        return
    run = train.train_and_evaluate if command == "train" else train.evaluate
    run(flag_values.config, flag_values.workdir)
    print((pathlib.Path(flag_values.workdir) / "results.md").read_text())


# A user's mistake (a missing file, a bad value, an unknown name) surfaces as one of these, with
# a message naming the file, field or value; `--debug` or OOD_JAX_DEBUG=1 keeps the traceback.
USER_ERRORS = (ValueError, OSError)
DEBUG_ENV = "OOD_JAX_DEBUG"


def _error_line(error: BaseException) -> str:
    message = " ".join(str(error).split()) or type(error).__name__
    return f"error: {message} (--debug shows the traceback)"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        if argv and argv[0] in DETECTOR_COMMANDS:
            _train_or_evaluate(argv[0], argv[1:])
            return
        args = build_parser().parse_args(argv)
        args.run(args)
    except USER_ERRORS as e:
        if debug:
            raise
        raise SystemExit(_error_line(e)) from None


if __name__ == "__main__":
    main(sys.argv[1:])
