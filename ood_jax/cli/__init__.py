"""The `ood-jax` command line: one subcommand per job."""

from __future__ import annotations

import os

# TensorFlow (the data pipeline's) prints its oneDNN and CPU-feature notices at import, before
# any flag could silence them; the environment is read then, so it is set before any import.
# The oneDNN kernels only change TF's own float ops, which here decode images. A user's own
# settings win.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from ood_jax import config_files, files, help_text, multihost  # noqa: E402
from ood_jax.data import convert_cityscapes, convert_nuscenes  # noqa: E402
from ood_jax.detection import compare as compare_detectors  # noqa: E402
from ood_jax.cli import mine as mining_cli  # noqa: E402
from ood_jax.cli import mllm as eval_cli  # noqa: E402
from ood_jax.cli import report as report_cli  # noqa: E402
from ood_jax.cli import stats as stats_cli  # noqa: E402
from ood_jax.eval import compare as compare_cli  # noqa: E402


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

    try:
        builder = datasets.build(
            args.name,
            data_dir=args.data_dir,
            source=args.source,
            config=args.config,
            on_error=args.on_error,
            overwrite=args.overwrite,
            custom_name=args.set_name,
            beam_runner=args.beam_runner,
            beam_options=args.beam_options,
            corruption=_corruption_request(args),
        )
    except BaseException as error:
        # What a failed or interrupted build skipped is printed before its one error line.
        report = getattr(error, "build_report", None)
        if report:
            print(f"build report until it stopped:\n{report}", file=sys.stderr)
        raise
    config = f"/{builder.builder_config.name}" if builder.builder_config else ""
    record = builder.provenance
    if builder.reused and record is None:
        print(
            f"{builder.name}{config}: already built by an older ood-jax, which kept no build "
            "record; nothing to do (--overwrite rebuilds it)"
        )
    elif builder.reused:
        print(
            f"{builder.name}{config}: already built from {record.made_from} on "
            f"{record.built_at}, nothing to do (--overwrite rebuilds it)"
        )
    print(f"\n{builder.name}{config} {builder.version} -> {builder.data_dir}")
    if record is not None:
        print(record.summary)
    else:
        print("\n".join(f"  {k}: {v.num_examples}" for k, v in builder.info.splits.items()))


def _corruption_request(args: argparse.Namespace) -> dict | None:
    """`build corrupted`'s request (`datasets.build`) from the flags given; None if none is."""
    given = {
        "dataset": args.dataset,
        "corruptions": args.corruptions,
        "severities": args.severities,
        "splits": args.splits,
    }
    return {k: v for k, v in given.items() if v is not None} or None


def _export(args: argparse.Namespace) -> None:
    from ood_jax.train import export

    path = export.export(
        args.workdir,
        args.out,
        step=args.step,
        file_format=args.format,
        batch_size=args.batch_size,
    )
    print(f"exported {args.workdir} -> {path}")


def _launch(args: argparse.Namespace) -> None:
    from ood_jax import launch

    job = launch.Job(
        processes=args.processes,
        cpu_devices=args.cpu_devices,
        port=args.port,
        lost_after_s=args.lost_after,
    )
    raise SystemExit(launch.run(job, args.command))


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

    p = sub.add_parser(
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

    class BuildHelp(argparse.Action):
        """`build --help` lists each builder's configs, which come from ood_jax.datasets; it
        imports TFDS, so they are read only when the help is asked for."""

        def __call__(self, parser, namespace, values, option_string=None):
            import textwrap

            from ood_jax import datasets

            listed = [
                textwrap.fill(
                    ", ".join(datasets.configs(n)) or "(no configs)",
                    width=94,
                    initial_indent=f"  {n:<18}",
                    subsequent_indent=" " * 20,
                )
                for n in datasets.NAMES
            ]
            configs = "builders and their configs (--config):\n" + "\n".join(listed)
            parser.epilog = f"{configs}\n\n{parser.epilog}"
            parser.print_help()
            parser.exit()

    p = sub.add_parser(
        "build",
        help="build a TFDS dataset from its release files",
        description=(
            "Builds a dataset into DATA_DIR/NAME[/CONFIG]/VERSION and records its source there\n"
            "(ood_jax_build.json). A rebuild from the same source does nothing; one from another\n"
            "source, or from changed annotation files, is refused unless --overwrite."
        ),
        epilog=help_text.examples(
            "ood-jax build synthetic_shifts --config tiny --data-dir data/tfds",
            "ood-jax build counts --source COUNTS_DIR --data-dir data/tfds",
            "ood-jax build foci --config food101 --source FOOD101_DIR --data-dir data/tfds "
            "--on-error skip",
            "ood-jax build foci --config custom --name imagenet_v2 --source IMAGENET_V2_DIR "
            "--data-dir data/tfds",
            "ood-jax build oodbench --config bap --source OODBENCH_DIR --data-dir data/tfds "
            "--overwrite",
            "ood-jax build counts --source COUNTS_DIR --data-dir /shared/tfds --beam-runner "
            'FlinkRunner --beam-options="--flink_master=HOST:8081 --parallelism=64"',
            "ood-jax build corrupted --dataset synthetic_shifts/tiny --data-dir data/tfds "
            "--corruptions gaussian_noise,fog --severities 1,3 --splits test_sky,test_dim",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=BuildHelp, nargs=0, help="show this help and exit")
    p.add_argument("name", help="counts, foci, oodbench, synthetic_shifts or corrupted")
    p.add_argument(
        "--source", help="directory holding the release (not needed for synthetic_shifts)"
    )
    p.add_argument("--data-dir", required=True, help="TFDS data directory to write to")
    p.add_argument(
        "--config", help="builder config, e.g. food101 for foci or tiny for synthetic_shifts"
    )
    p.add_argument(
        "--name",
        dest="set_name",
        metavar="NAME",
        help="with --config custom: build the set under its own config name NAME "
        "(DATA_DIR/foci/NAME; eval-mllm foci --config NAME reads it), so several sets live "
        "side by side",
    )
    p.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="a corrupt or missing image fails the build (default) or is skipped and counted",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="rebuild a dataset that is already there (e.g. from another source); the old one "
        "stays readable until the new one is complete",
    )
    p.add_argument(
        "--beam-runner",
        metavar="RUNNER",
        help="build on Apache Beam with this runner (DirectRunner, FlinkRunner, SparkRunner, "
        "...); the records are those of a build without it. --source and --data-dir must be on "
        "a filesystem the workers share",
    )
    p.add_argument(
        "--beam-options",
        metavar="FLAGS",
        help='the pipeline options of --beam-runner, one string after "=" (it starts with '
        '"--"), e.g. --beam-options="--direct_num_workers=4 --direct_running_mode=multi_processing"',
    )
    corrupted = p.add_argument_group(
        "corrupted",
        "a dataset prepared in --data-dir under ImageNet-C corruptions (imagecorruptions); its "
        "config is named after the request, printed at the end, and read as corrupted/CONFIG",
    )
    corrupted.add_argument(
        "--dataset", metavar="NAME[/CONFIG]", help="the prepared dataset to corrupt"
    )
    corrupted.add_argument(
        "--corruptions",
        metavar="C,...",
        help="of the 15 ImageNet-C corruptions, e.g. gaussian_noise,fog (default: all)",
    )
    corrupted.add_argument(
        "--severities", metavar="S,...", help="severities 1-5, e.g. 1,3 (default: all)"
    )
    corrupted.add_argument(
        "--splits", metavar="SPLIT,...", help="the source's splits to corrupt (default: all)"
    )
    p.set_defaults(run=_build)

    for command, what in DETECTOR_COMMANDS.items():
        sub.add_parser(
            command,
            help=f"{what}: --config=configs/X.py[:arg] --workdir=DIR [--config.f=v]",
        )

    p = sub.add_parser(
        "export",
        help="a self-contained inference checkpoint of a training run",
        epilog=help_text.examples(
            "ood-jax export --workdir workdirs/synthetic_detr --out exported/detr",
            "ood-jax export --workdir workdirs/run --out exported/run_step20 --step 20",
            "ood-jax export --workdir workdirs/synthetic_detr --out exported/detr_stablehlo "
            "--format stablehlo",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument(
        "--format",
        choices=("msgpack", "stablehlo"),
        default="msgpack",
        help="msgpack: one file for ood_jax.models.load_exported (default); stablehlo: a "
        "directory with the predict function as a jax.export artifact for cpu, cuda and tpu "
        "and its input contract, loadable with jax alone",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="with --format stablehlo: a fixed batch size (default: any, a symbolic batch)",
    )
    p.set_defaults(run=_export)

    p = sub.add_parser(
        "launch",
        help="run an ood-jax command as N processes of one jax.distributed job on this machine",
        description=help_text.fill(
            "Starts COMMAND as N processes joined as on a cluster (multihost.py): the way to run "
            "or debug a multi-host job on one machine. Process 0's output passes through, the "
            "others' lines are prefixed [i]; SIGTERM and Ctrl-C reach every process."
        ),
        epilog=help_text.examples(
            "ood-jax launch --processes 2 --cpu-devices 2 train "
            "--config=configs/synthetic_detr.py:smoke --workdir=workdirs/smoke2x2",
            "ood-jax launch --processes 2 evaluate --config=configs/synthetic_detr.py:smoke "
            "--workdir=workdirs/smoke2x2",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--processes", type=int, required=True, metavar="N")
    p.add_argument(
        "--cpu-devices",
        type=int,
        metavar="D",
        help="simulate D CPU devices in each process (default: the machine's devices; GPUs "
        "are shared out equally)",
    )
    p.add_argument("--port", type=int, help="the coordinator's port (default: a free one)")
    p.add_argument(
        "--lost-after",
        type=float,
        metavar="SECONDS",
        help=f"a process silent this long is lost and the job stops (default "
        f"{multihost.DEFAULT_LOST_AFTER_S:.0f}; {multihost.LOST_AFTER_ENV})",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="an ood-jax command and its flags")
    p.set_defaults(run=_launch)

    p = sub.add_parser(
        "demo",
        help="build synthetic data, train DETR, evaluate, export",
        epilog=help_text.examples(
            "ood-jax demo",
            "ood-jax demo --config configs/synthetic_dino.py --workdir workdirs/synthetic_dino",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/synthetic_detr.py")
    p.add_argument("--data-dir", default="data/tfds")
    p.add_argument("--workdir", default="workdirs/synthetic_detr")
    p.set_defaults(run=_demo)

    p = sub.add_parser(
        "coco-demo",
        help="the COCO evaluator on a generated case",
        epilog=help_text.examples("ood-jax coco-demo --images 2000 --categories 80"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--categories", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_coco_demo)

    p = sub.add_parser(
        "convert",
        help="a release (nuScenes, Cityscapes) -> an oodbench source, with its official devkit",
        description="Writes OUT/annotations.json (COCO), OUT/images (a link to the release) and "
        "OUT/ood_jax_convert.json; then `ood-jax mine oodbench --source OUT` and `ood-jax build "
        "oodbench --source OUT`.",
        epilog=help_text.examples(
            convert_nuscenes.EXAMPLES[0],
            "ood-jax convert cityscapes --root data/cityscapes --split val "
            "--out data/sources/oodbench_cityscapes",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    converters = p.add_subparsers(dest="converter", required=True, metavar="RELEASE")
    convert_nuscenes.add_parser(converters)
    convert_cityscapes.add_parser(converters)

    mining_cli.add_parsers(sub)
    report_cli.add_parser(sub)  # report: the effective-robustness page of several runs
    eval_cli.add_parsers(sub)  # eval-mllm
    compare_cli.add_parsers(sub)  # compare: two eval-mllm runs on the same items
    compare_detectors.add_parsers(sub)  # compare-detectors: two workdirs on the same splits
    # stats: OODBench's checks, plus FOCI's clip-conditional, which reads eval-mllm runs.
    eval_cli.add_stats_parsers(stats_cli.add_parsers(sub))
    return parser


# Commands that take ml_collections config flags (--config=FILE[:arg] --config.x=v).
DETECTOR_COMMANDS = {
    "pretrain": "pretrain a detector's backbone (the stage train runs first when configured)",
    "train": "train a detector",
    "evaluate": "evaluate a detector",
    "sweep": "train N seeds of a detector and select checkpoints by each model-selection protocol",
}


_DETECTOR_EXAMPLES = {
    "pretrain": "ood-jax pretrain --config=configs/synthetic_detr.py --workdir=workdirs/run",
    "train": "ood-jax train --config=configs/synthetic_detr.py:smoke --workdir=/tmp/smoke "
    "--config.total_steps=20",
    "evaluate": "ood-jax evaluate --config=configs/synthetic_detr.py --workdir=workdirs/run",
    "sweep": "ood-jax sweep --config=configs/synthetic_detr.py:smoke --workdir=/tmp/sweep "
    "--seeds=2 --config.total_steps=4 --config.eval_every=2",
}

# Commands' own flags, beside the config flags: `sweep`'s (ood_jax/train/sweep.py), and
# `evaluate --corrupted` (ood_jax/train/evaluate_corrupted.py).
_EVALUATE_FLAGS = {
    "--corrupted=corrupted/NAME": "evaluate on a corrupted copy of the run's dataset (`ood-jax "
    "build corrupted`): corruptions.json, results_corruptions.md (mPC, rPC) and "
    "corruptions_severity.png in the workdir",
}
_SWEEP_FLAGS = {
    "--seeds=N": "runs of seeds config.seed, config.seed + 1, ... (default 1)",
    "--protocols=P,...": "last, training_domain, leave_one_domain_out, oracle (default: "
    "last,training_domain,oracle; leave_one_domain_out adds a run per seed and training domain)",
    "--leave-out=D,...": "the training domains leave_one_domain_out leaves out (default: all)",
    "--job=NAME_OR_INDEX": "run this job of the sweep only (a cluster array task)",
    "--list-jobs": "write WORKDIR/sweep.json and print its jobs, one a line",
    "--aggregate-only": "only aggregate the jobs' evaluations into WORKDIR/results.json and "
    "results.md (no --config needed)",
}


def _detector_help(command: str, argv: Sequence[str]) -> str:
    """`ood-jax train --help`: the flags, an example, the configs at hand and, given --config,
    that config's description (its variants) and its top-level fields with their values."""
    import textwrap

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
        "  --config.FIELD=VALUE     override a config field, e.g. --config.total_steps=100;",
        "                           resuming a workdir with another model or data config needs",
        "                           --config.allow_config_change=True",
        *(
            line
            for flag, what in {"sweep": _SWEEP_FLAGS, "evaluate": _EVALUATE_FLAGS}.get(
                command, {}
            ).items()
            for line in textwrap.wrap(
                what, 94, initial_indent=f"  {flag:<24} ", subsequent_indent=" " * 27
            )
        ),
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
    if command == "sweep":
        from ood_jax.train import sweep

        flags.DEFINE_integer("seeds", 1, "seeds", flag_values=flag_values)
        flags.DEFINE_list("protocols", list(sweep.DEFAULT_PROTOCOLS), "", flag_values=flag_values)
        flags.DEFINE_list("leave-out", [], "left-out domains", flag_values=flag_values)
        flags.DEFINE_string("job", None, "one job", flag_values=flag_values)
        flags.DEFINE_bool("list-jobs", False, "print the jobs", flag_values=flag_values)
        flags.DEFINE_bool("aggregate-only", False, "only aggregate", flag_values=flag_values)
    if command == "evaluate":
        flags.DEFINE_string("corrupted", None, "a corrupted dataset", flag_values=flag_values)
    try:
        flag_values([f"ood-jax {command}", *argv])
    except flags.Error as e:
        raise SystemExit(f"error: {e}") from None
    if command == "sweep" and flag_values.workdir is not None:
        sweep.sweep(
            flag_values.config,
            flag_values.workdir,
            seeds=flag_values.seeds,
            protocols=flag_values.protocols,
            leave_out=flag_values["leave-out"].value,
            job=flag_values.job,
            list_jobs=flag_values["list-jobs"].value,
            aggregate_only=flag_values["aggregate-only"].value,
        )
        if not (flag_values.job or flag_values["list-jobs"].value):
            print((pathlib.Path(flag_values.workdir) / "results.md").read_text())
        return
    if flag_values.config is None or flag_values.workdir is None:
        raise SystemExit(
            f"usage: ood-jax {command} --config=configs/X.py[:arg] --workdir=DIR [--config.f=v]"
        )

    from ood_jax.train import train

    def show(text: str | pathlib.Path) -> None:
        # Once per job, not once per process: the others never read what process 0 writes.
        if multihost.is_primary():
            print(text.read_text() if isinstance(text, pathlib.Path) else text)

    if command == "pretrain":
        try:
            path = train.pretrain_stage(flag_values.config, flag_values.workdir)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        show(f"pretrained backbone: {path} (train on this workdir starts from it)")
        return
    if command == "evaluate" and flag_values.corrupted:
        from ood_jax.train import evaluate_corrupted

        evaluate_corrupted.evaluate_corrupted(
            flag_values.config, flag_values.workdir, flag_values.corrupted
        )
        show(pathlib.Path(flag_values.workdir) / "results_corruptions.md")
        return
    run = train.train_and_evaluate if command == "train" else train.evaluate
    run(flag_values.config, flag_values.workdir)
    show(pathlib.Path(flag_values.workdir) / "results.md")


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
        if argv and argv[0] in DETECTOR_COMMANDS:
            _train_or_evaluate(argv[0], argv[1:])
            return
        args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    main(sys.argv[1:])
