"""`ood-jax build | convert`: datasets from their release files."""

from __future__ import annotations

import argparse
import pathlib
import sys

from ood_jax.cli import help_text
from ood_jax.data import conversion, convert_cityscapes, convert_nuscenes


def add_parsers(subparsers) -> None:
    _add_build(subparsers)
    _add_convert(subparsers)


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


def _add_build(subparsers) -> None:
    p = subparsers.add_parser(
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


NUSCENES_EXAMPLES = (
    "ood-jax convert nuscenes --dataroot /data/sets/nuscenes --version v1.0-trainval "
    "--split val --out data/sources/oodbench_nuscenes",
    "ood-jax convert nuscenes --dataroot /data/sets/nuscenes --version v1.0-mini "
    "--split mini_val --out data/sources/nuscenes_mini --visibility all",
)


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="a release (nuScenes, Cityscapes) -> an oodbench source, with its official devkit",
        description="Writes OUT/annotations.json (COCO), OUT/images (a link to the release) and "
        "OUT/ood_jax_convert.json; then `ood-jax mine oodbench --source OUT` and `ood-jax build "
        "oodbench --source OUT`.",
        epilog=help_text.examples(
            NUSCENES_EXAMPLES[0],
            "ood-jax convert cityscapes --root data/cityscapes --split val "
            "--out data/sources/oodbench_cityscapes",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    converters = p.add_subparsers(dest="converter", required=True, metavar="RELEASE")
    _add_nuscenes(converters)
    _add_cityscapes(converters)


def _nuscenes(args: argparse.Namespace) -> None:
    print(f"nuScenes {args.version} {args.split} from {args.dataroot}: loading the tables")
    counts = convert_nuscenes.convert(
        args.dataroot, args.version, args.split, args.out, visibility=args.visibility
    )
    print(convert_nuscenes.summary_lines(counts, args.out))


def _add_nuscenes(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "nuscenes",
        help="nuScenes CAM_FRONT keyframes -> an oodbench source (COCO annotations.json)",
        description=help_text.fill(
            "Writes a nuScenes split's front-camera keyframes, with the objects each shows by the "
            "devkit's visibility rule, as OUT/annotations.json (COCO), OUT/images (a link to the "
            "dataroot) and OUT/ood_jax_convert.json (provenance). OODBench uses v1.0-trainval "
            "val (6,019 keyframes)."
        ),
        epilog=help_text.examples(*NUSCENES_EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dataroot", required=True, help="nuScenes folder holding samples/ and the version tables"
    )
    p.add_argument(
        "--version",
        required=True,
        help=f"table folder in the dataroot: {', '.join(convert_nuscenes.SPLITS)}",
    )
    p.add_argument(
        "--split",
        required=True,
        help="; ".join(
            f"{version}: {', '.join(splits)}" for version, splits in convert_nuscenes.SPLITS.items()
        ),
    )
    p.add_argument("--out", required=True, help="oodbench source directory to write")
    p.add_argument(
        "--visibility",
        choices=tuple(convert_nuscenes.VISIBILITY_RULES),
        default="any",
        help="an object counts when any (default) or all of its 3D box's corners project "
        "inside the image",
    )
    p.set_defaults(run=_nuscenes)
    return p


def _counts(counts: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "none"


def _cityscapes(args: argparse.Namespace) -> None:
    summary = convert_cityscapes.convert(args.root, args.split, args.out)
    out = pathlib.Path(args.out)
    print(
        f"cityscapes {summary['split']}: {summary['images']} images -> {out / 'annotations.json'}"
        f" (images: {out / 'images'} -> {pathlib.Path(args.root).resolve()})\n"
        f"  counted (iscrowd 0): {_counts(summary['instances'])}\n"
        f"  present, not counted (iscrowd 1): {_counts(summary['regions'])}\n"
        f"  dropped labels: {_counts(summary['dropped'])}\n"
        f"  ignored polygons: {_counts(summary['ignored'])}\n"
        f"next: ood-jax mine oodbench --source {out} --scorer MODEL --out {out / 'splits.jsonl'}"
    )


def _add_cityscapes(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cityscapes",
        help="Cityscapes' gtFine polygons -> an OODBench source (annotations.json, images)",
        description=help_text.fill(
            "Writes OUT/annotations.json (COCO instances: people and vehicles counted, groups "
            "and stuff such as road or sky as present but not counted, void and ambiguous "
            "labels dropped), OUT/images (a link to ROOT, nothing copied) and "
            f"OUT/{conversion.RECORD_FILE} (where it came from, the label table, the counts). The label "
            "table is this project's: OODBench's own list is not published."
        ),
        epilog=help_text.examples(
            "ood-jax convert cityscapes --root data/cityscapes --split val "
            "--out data/oodbench_cityscapes",
            "ood-jax convert cityscapes --root data/cityscapes --split train "
            "--out data/cityscapes_train",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--root", required=True, help="the release: the folder holding leftImg8bit/ and gtFine/"
    )
    parser.add_argument(
        "--split",
        default="val",
        help="train or val (default: val, OODBench's; the test split's labels are not public)",
    )
    parser.add_argument(
        "--out", required=True, help="the OODBench source directory to write (build --source)"
    )
    parser.set_defaults(run=_cityscapes)
    return parser
