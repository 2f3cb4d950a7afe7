"""`ood-jax mine foci | oodbench | oodbench-ablation | oodg`: files the builders and harness read.

Each run function takes the parsed arguments and a scorer factory, path -> scorer (by default
`ood_jax.scorers.from_hf`, imported only when a scorer is loaded), so tests can pass their own.
The scorers split each batch over every device; with several processes (`ood-jax launch`, a
SLURM or TPU-pod job) each reads only its images, every process gets every embedding, and the
first process alone writes outputs, manifests and caches.

Each run writes a manifest (ood_jax.manifest) when it starts and when it ends, however it ends:
beside what it writes, named after it (foci_options.json -> foci_options.manifest.json,
splits.jsonl -> splits.manifest.json, oodg's directory items/ -> items.manifest.json, the
ablation's directory OUT/ -> OUT.manifest.json). It holds the command's options, the data read
(the source directory or TFDS build, and a digest of the records: FOCI's (image, label) list,
OODBench's (image, category) pairs, OODG's test images), each scorer's path, identity and
weights' digest, jax's devices, and the output's SHA-256.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

from ood_jax import files, help_text, manifest, multihost

ScorerFactory = Callable[[str], Any]


def _every_device():
    """The scorers' mesh: a batch is split over every device of every process."""
    from ood_jax import sharding

    return sharding.make_mesh([("data", -1)])


def _from_hf(path: str):
    from ood_jax import scorers

    return scorers.from_hf(path, mesh=_every_device())


def _from_lavis(checkpoint: str, config_dir: str):
    from ood_jax import scorers

    return scorers.from_lavis(checkpoint, config_dir, mesh=_every_device())


def _load_scorer(factory: ScorerFactory | None, path: str):
    from ood_jax import scorers

    scorer = (factory or _from_hf)(path)
    if scorer.kind not in scorers.KINDS:
        raise ValueError(
            f"{path}: scorer kind {scorer.kind!r}; expected one of {', '.join(scorers.KINDS)}"
        )
    return scorer


def _fail(error: Exception) -> SystemExit:
    return SystemExit(f"error: {error}")


# ---------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------


def manifest_path(out: str | pathlib.Path, directory: bool = False) -> pathlib.Path:
    """Where the manifest of a mining run writing `out` (a file, or a `directory`) goes: beside
    it, named after it, so that outputs in one directory each keep their own, and an output
    directory holds only what the run made (two runs with the same arguments, the same files)."""
    out = pathlib.Path(out)
    return out.with_name(f"{out.name if directory else out.stem}.manifest.json")


def _start_manifest(command: str, args: argparse.Namespace, devices: bool, **fields) -> dict:
    options = {k: v for k, v in vars(args).items() if k not in ("run", "command", "mine_command")}
    return manifest.collect(
        f"mine {command}",
        devices=devices,
        packages=("transformers", "tensorflow-datasets"),
        options=options,
        **fields,
    )


def _recording(out: str | pathlib.Path, record: dict, directory: bool = False):
    """manifest.recording for a run that writes `out` (a file, or a `directory`); the first
    process of several writes it, as it writes `out`."""
    path = manifest_path(out, directory)
    return manifest.recording(path.parent, record, name=path.name, enabled=multihost.is_primary())


def _say(*args, **kwargs) -> None:
    """print, once per job rather than once per process."""
    if multihost.is_primary():
        print(*args, **kwargs)


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and multihost.is_primary()


def _records(pairs) -> dict:
    pairs = list(pairs)
    return {"count": len(pairs), "digest": manifest.items_digest(pairs)}


def _scorer_manifest(path: str, scorer: Any) -> dict:
    return {
        "path": path,
        "kind": scorer.kind,
        # ood_jax.scorers' Scorer has one; mining itself needs none (without a cache).
        "identity": getattr(scorer, "identity", None),
        "weights": manifest.weights_digest(path),
    }


def _output(path: pathlib.Path) -> dict:
    return {"path": str(path), "sha256": manifest.file_sha256(path)}


FOCI_EXAMPLE = (
    "ood-jax mine foci --dataset food101 --source data/foci/food101 \\\n"
    "      --scorer models/clip-vit-l14 --cache work/foci_cache"
)
OODBENCH_EXAMPLE = (
    "ood-jax mine oodbench --source data/coco --scorer models/clip-vit-l14 \\\n"
    "      --scorer models/blip2-itm-vit-g --lavis blip2-itm-vit-g=models/blip2_pretrained.pth \\\n"
    "      --out data/coco/splits.jsonl"
)
ABLATION_EXAMPLE = (
    "ood-jax mine oodbench-ablation --source data/coco --scorer clip=models/clip-vit-l14 \\\n"
    "      --scorer blip2=models/blip2-itm-vit-g --lavis blip2=models/blip2_pretrained.pth \\\n"
    "      --scorer groupvit=models/groupvit-gcc-yfcc --scorer lit=models/lit-b16b \\\n"
    "      --group I=clip,blip2 --group II=blip2,groupvit \\\n"
    "      --group III=groupvit,lit --series clip,blip2,groupvit,lit --out work/coco_ablation"
)
OODG_EXAMPLE = (
    "ood-jax mine oodg --dataset counts --data-dir data/tfds --split test --domains sky \\\n"
    "      --task grounding --setting covariate_shift --ice 3 --num-items 500 --out items/"
)


def _interrupted(args: argparse.Namespace, out: str) -> KeyboardInterrupt:
    """Ctrl-C while mining: the output is written whole at the end, so only a cache keeps work."""
    if args.cache:
        kept = f"image features computed so far are kept in {args.cache}"
        how = "rerun the same command to continue from them"
    else:
        kept, how = "nothing kept", "rerun with --cache DIR to keep image features as they come"
    return KeyboardInterrupt(f"{kept}; {out} was not written; {how}")


def run_foci(args: argparse.Namespace, scorer_factory: ScorerFactory | None = None) -> None:
    from ood_jax.data import building
    from ood_jax.mining import foci

    try:
        source = foci.read_source(args.dataset, args.source)
    except (ValueError, building.BuildError) as e:
        raise _fail(e) from None
    out = pathlib.Path(args.out) if args.out else source.root / source.options_file
    dataset = {
        "name": args.dataset,
        "source": str(source.root.resolve()),
        "records": _records(zip(source.images, source.labels)),
    }
    record = _start_manifest("foci", args, devices=True, dataset=dataset)
    with _recording(out, record):
        try:
            scorer = _load_scorer(scorer_factory, args.scorer)
            record["scorers"] = [_scorer_manifest(args.scorer, scorer)]
            contents, accuracy = foci.mine_source(
                source,
                scorer,
                templates=args.templates,
                batch_size=args.batch_size,
                chunk_size=args.chunk_size,
                progress=_progress(args),
                cache_dir=args.cache,
            )
        except (ValueError, building.BuildError) as e:
            raise _fail(e) from None
        except KeyboardInterrupt:
            raise _interrupted(args, args.out or "the options file") from None
        if multihost.is_primary():
            files.write_json_atomic(out, contents)
            record.update(outputs=[_output(out)], accuracy=accuracy)
    _say(
        f"{len(source.images)} images, {len(source.class_names)} classes -> {out}\n"
        f"zero-shot accuracy of this scorer: {accuracy['all_classes']:.4f} over all classes, "
        f"{accuracy['options']:.4f} over the {foci.NUM_OPTIONS} options (the same number when "
        "one scorer both mines and answers: its top wrong class is always an option)"
    )


FOCI_ZERO_SHOT_EXAMPLE = (
    "ood-jax mine foci-zero-shot --data-dir data/tfds \\\n"
    "      --dataset corrupted/foci-food101-1a2b3c4d5e --scorer models/clip-vit-l14 \\\n"
    "      --out work/food101_zero_shot"
)


def run_foci_zero_shot(
    args: argparse.Namespace, scorer_factory: ScorerFactory | None = None
) -> None:
    from ood_jax.mining import zero_shot

    try:
        target = zero_shot.read_target(args.data_dir, args.dataset)
    except ValueError as e:
        raise _fail(e) from None
    dataset = {**manifest.tfds_dataset(target.builder), "source": target.source}
    record = _start_manifest("foci-zero-shot", args, devices=True, dataset=dataset)
    with _recording(args.out, record, directory=True):
        try:
            scorer = _load_scorer(scorer_factory, args.scorer)
            record["scorers"] = [_scorer_manifest(args.scorer, scorer)]
            results = zero_shot.evaluate(
                scorer, target, args.dataset, args.templates, args.batch_size, args.chunk_size,
                progress=_progress(args),
            )  # fmt: skip
        except ValueError as e:
            raise _fail(e) from None
        if not multihost.is_primary():
            return
        written = zero_shot.write(args.out, results)
        record["outputs"] = [_output(path) for path in written]
    print(written[1].read_text(), end="")
    print(f"-> {args.out}")


def _scorer_names(paths: list[str]) -> list[str]:
    names = []
    for path in paths:
        name = pathlib.Path(path).name or path
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def _pairs_dataset(args: argparse.Namespace, pairs) -> dict:
    """The manifest's dataset entry of the (image, category) pairs read from --source."""
    return {
        "source": str(pathlib.Path(args.source).resolve()),
        "records": _records(zip(pairs.image_ids.tolist(), pairs.category_ids.tolist())),
    }


def _score_with_each(
    args: argparse.Namespace, pairs, scorer_paths: dict[str, str], record: dict, factory
) -> dict:
    """{name: S(x, c) per pair} for each named scorer, one encoding pass (cached) each."""
    from ood_jax.mining import oodbench

    scales = _unique("--logit-scale", args.logit_scale or [])
    unknown = sorted(set(scales) - set(scorer_paths))
    if unknown:
        raise ValueError(
            f"--logit-scale {unknown[0]}: no scorer of that name (scorers: {', '.join(scorer_paths)})"
        )
    matching = set(args.match or [])
    for name in sorted(matching - set(scorer_paths)):
        raise ValueError(
            f"--match {name}: no scorer of that name (scorers: {', '.join(scorer_paths)})"
        )
    lavis = _unique("--lavis", args.lavis or [])
    unknown = sorted(set(lavis) - set(scorer_paths))
    if unknown:
        raise ValueError(
            f"--lavis {unknown[0]}: no scorer of that name ({', '.join(scorer_paths)})"
        )
    scores = {}
    for name, path in scorer_paths.items():
        scorer = (
            _load_scorer(factory, path) if name not in lavis else _from_lavis(lavis[name], path)
        )
        entry = {"name": name, **_scorer_manifest(path, scorer)}
        if name in lavis:
            entry["lavis_checkpoint"] = {
                "path": lavis[name],
                "weights": manifest.weights_digest(lavis[name]),
            }
        if name in scales:
            entry["logit_scale"] = {"checkpoint": scorer.logit_scale, "given": scales[name]}
            scorer.logit_scale = scales[name]
        record["scorers"].append(entry)
        head = "image-text matching" if name in matching else "contrastive"
        entry["score"] = head
        _say(f"scoring {len(pairs.image_ids)} pairs with {name} ({scorer.kind}, {head})")
        cache = pathlib.Path(args.cache) / name if args.cache and name not in matching else None
        scores[name] = oodbench.score_pairs(
            pairs, scorer, args.templates, args.batch_size, _progress(args), cache,
            matching=name in matching,
        )  # fmt: skip
    return scores


def run_oodbench(args: argparse.Namespace, scorer_factory: ScorerFactory | None = None) -> None:
    from ood_jax.data import building
    from ood_jax.mining import oodbench

    max_per_split = args.max_per_split or None
    try:
        pairs = oodbench.read_pairs(args.source)
    except (ValueError, building.BuildError) as e:
        raise _fail(e) from None
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.source) / "splits.jsonl"
    dataset = _pairs_dataset(args, pairs)
    record = _start_manifest("oodbench", args, devices=True, dataset=dataset, scorers=[])
    with _recording(out, record):
        try:
            named = dict(zip(_scorer_names(args.scorer), args.scorer))
            scores = _score_with_each(args, pairs, named, record, scorer_factory)
            records = oodbench.split_records(
                pairs, scores, args.threshold, max_per_split, args.seed
            )
        except (ValueError, building.BuildError) as e:
            raise _fail(e) from None
        except KeyboardInterrupt:
            raise _interrupted(args, args.out or "splits.jsonl") from None
        if not multihost.is_primary():
            return
        files.write_jsonl_atomic(out, records)
        record["outputs"] = [_output(out)]
    labels = oodbench.assign_splits(scores, args.threshold)
    print(f"{len(labels)} pairs scored; threshold {args.threshold}")
    for split in oodbench.SPLITS:
        kept = sum(r["split"] == split for r in records)
        print(f"  {split}: {int((labels == split).sum())} pairs, {kept} written")
    print(f"-> {out}")


ABLATION_DESCRIPTION = help_text.fill(
    "OODBench's scorer ablations: every pair scored once per named scorer, then divided into "
    "ID / OOD-S / OOD-H by each --group's scorers (the paper's Group I = CLIP + BLIP-2, II = "
    "BLIP-2 + GroupViT, III = GroupViT + LiT) and by the first 1, 2, ... scorers of --series "
    "(its one-to-four ablation). Each division keeps every pair, without the 6,000 downsampling, "
    "as the paper re-divides: OUT/group-NAME.jsonl and OUT/series-K.jsonl, splits files the "
    "oodbench builder reads. OUT/consistency.json and .md compare every two divisions: the "
    "fraction of pairs given the same split, and the Jaccard overlap of their OOD-S, OOD-H and "
    "OOD (either) sets. The paper's Group I is its published, downsampled benchmark; "
    "`mine oodbench` with the same two scorers writes that."
)


def _named(spec: str) -> tuple[str, str]:
    """NAME=VALUE of --scorer and --group; NAME also names files, so it stays a plain word."""
    name, sep, value = spec.partition("=")
    if not sep or not value or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=VALUE, NAME of [A-Za-z0-9_.-]")
    return name, value


def _unique(flag: str, specs: list[tuple[str, str]]) -> dict[str, str]:
    named = {}
    for name, value in specs:
        if name in named:
            raise ValueError(f"{flag} {name} is given twice")
        named[name] = value
    return named


def _ablation_divisions(args: argparse.Namespace, oodbench: Any) -> tuple[dict, dict]:
    """Scorer name -> path, and division name -> its scorer names, from the flags."""
    scorer_paths = _unique("--scorer", args.scorer)
    groups = {n: v.split(",") for n, v in _unique("--group", args.group or []).items()}
    series = args.series.split(",") if args.series else ()
    return scorer_paths, oodbench.ablation_divisions(list(scorer_paths), groups, series)


def run_oodbench_ablation(
    args: argparse.Namespace, scorer_factory: ScorerFactory | None = None
) -> None:
    from ood_jax.data import building
    from ood_jax.mining import oodbench

    try:
        scorer_paths, divisions = _ablation_divisions(args, oodbench)
        pairs = oodbench.read_pairs(args.source)
    except (ValueError, building.BuildError) as e:
        raise _fail(e) from None
    out = pathlib.Path(args.out)
    dataset = _pairs_dataset(args, pairs)
    record = _start_manifest("oodbench-ablation", args, devices=True, dataset=dataset, scorers=[])
    with _recording(out, record, directory=True):
        try:
            scores = _score_with_each(args, pairs, scorer_paths, record, scorer_factory)
            labels = oodbench.divide(scores, divisions, args.threshold)
        except (ValueError, building.BuildError) as e:
            raise _fail(e) from None
        except KeyboardInterrupt:
            raise _interrupted(args, str(out)) from None
        if not multihost.is_primary():
            return
        record["outputs"] = _write_ablation(out, pairs, scores, divisions, labels, args.threshold)
    print((out / "consistency.md").read_text(), end="")
    print(f"-> {out}")


def _write_ablation(out, pairs, scores, divisions, labels, threshold) -> list[dict]:
    from ood_jax.mining import oodbench

    out.mkdir(parents=True, exist_ok=True)
    outputs = []
    for name, members in divisions.items():
        path = out / f"{name}.jsonl"
        # max_per_split=None: the paper keeps every OOD sample when it re-divides.
        own = {m: scores[m] for m in members}
        files.write_jsonl_atomic(path, oodbench.split_records(pairs, own, threshold, None))
        outputs.append(_output(path))
    table = oodbench.consistency(labels)
    table.update(threshold=threshold, divisions={n: list(m) for n, m in divisions.items()})
    files.write_json_atomic(out / "consistency.json", table)
    markdown = files.write_atomic(
        out / "consistency.md", oodbench.consistency_markdown(table, divisions)
    )
    return [*outputs, _output(out / "consistency.json"), _output(markdown)]


def run_oodg(args: argparse.Namespace, scorer_factory: ScorerFactory | None = None) -> None:
    del scorer_factory  # OODG items need no scorer; the argument keeps the run signature uniform.
    from ood_jax.mining import oodg

    try:
        builder = oodg.load_builder(args.dataset, args.data_dir)
    except ValueError as e:
        raise _fail(e) from None
    record = _start_manifest("oodg", args, devices=False, dataset=manifest.tfds_dataset(builder))
    with _recording(args.out, record, directory=True):
        try:
            test_records = oodg.read_records(builder, args.split, args.domains)
            record["dataset"]["records"] = _records(r.key for r in test_records)
            plan = _oodg_plan(args, oodg, builder, test_records)
            if not multihost.is_primary():  # every process plans the same items
                return
            path = oodg.write(builder, plan, args.out)
        except ValueError as e:
            raise _fail(e) from None
        record.update(outputs=[_output(path)], items=len(plan.items), images=len(plan.units))
    print(
        f"{len(plan.items)} {args.task} items ({args.setting}, {args.ice} in-context examples), "
        f"{len(plan.units)} images -> {path}"
    )
    if plan.skipped:
        print(f"  {plan.skipped} test units skipped: too few eligible in-context examples")
    if len(plan.items) < args.num_items:
        print(
            f"  {args.num_items} items asked for, {len(plan.items)} possible",
            file=sys.stderr,
        )


def _oodg_plan(args: argparse.Namespace, oodg: Any, builder: Any, test_records: list) -> Any:
    """The items of `mine oodg`: test units of `test_records`, their in-context examples."""
    # Examples may come from any domain of their split, whatever the test domains are.
    ice_split = args.ice_split or args.split
    if args.ice == 0:
        example_records = []
    elif ice_split == args.split and args.domains is None:
        example_records = test_records
    else:
        example_records = oodg.read_records(builder, ice_split)
    make_units = oodg.UNIT_BUILDERS[args.task]
    test_units = make_units(test_records)
    if not test_units:
        raise ValueError(f"{args.dataset} {args.split}: no {args.task} units")
    label_names = builder.info.features["objects"]["label"].names
    plan = oodg.build_items(
        test_units,
        make_units(example_records),
        label_names,
        oodg.concepts_of(label_names),
        args.setting,
        args.ice,
        args.num_items,
        args.seed,
    )
    if not plan.items:
        raise ValueError(
            f"no item could be built: all {plan.considered} test units lack {args.ice} "
            f"eligible in-context examples for {args.setting}"
        )
    return plan


def add_parsers(subparsers) -> None:
    """Adds `mine` with its sub-subcommands foci, oodbench and oodg to an ood-jax parser."""
    from ood_jax import mining
    from ood_jax.mining import foci, oodbench, oodg, zero_shot

    mine = subparsers.add_parser(
        "mine",
        help="mine FOCI options, OODBench splits, OODG items",
        description="Mining: the files the foci and oodbench builders and eval-mllm read.",
        epilog=help_text.examples(
            FOCI_EXAMPLE, FOCI_ZERO_SHOT_EXAMPLE, OODBENCH_EXAMPLE, ABLATION_EXAMPLE, OODG_EXAMPLE
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = mine.add_subparsers(dest="mine_command", required=True)

    p = sub.add_parser(
        "foci",
        help="FOCI options: the truth and the 3 wrong classes a CLIP scorer ranks highest",
        description=foci.__doc__,
        epilog=help_text.examples(FOCI_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataset", required=True, help="FOCI config, e.g. food101 or foci/custom")
    p.add_argument(
        "--source",
        "--data-dir",
        dest="source",
        required=True,
        help="the directory the foci builder reads (its --source)",
    )
    p.add_argument("--scorer", required=True, help="scorer checkpoint directory (ood_jax.scorers)")
    p.add_argument(
        "--out", help="options file (default: where the builder reads it in the source directory)"
    )
    p.add_argument(
        "--templates",
        nargs="+",
        default=list(foci.DEFAULT_TEMPLATES),
        help="class text templates, averaged (default: FOCI's 'an image of a {}')",
    )
    _add_common(p, mining.DEFAULT_CHUNK_SIZE)
    p.set_defaults(run=run_foci)

    p = sub.add_parser(
        "foci-zero-shot",
        help="a scorer's zero-shot and 4-way accuracy per split of a foci or corrupted build",
        description=zero_shot.__doc__,
        epilog=help_text.examples(FOCI_ZERO_SHOT_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data-dir", required=True, help="TFDS data directory holding the build")
    p.add_argument(
        "--dataset", required=True, help="foci/CONFIG, or corrupted/NAME built from a foci config"
    )
    p.add_argument("--scorer", required=True, help="scorer checkpoint directory (ood_jax.scorers)")
    p.add_argument("--out", required=True, help="run directory (zero_shot.json, corruptions.json)")
    p.add_argument(
        "--templates",
        nargs="+",
        default=list(foci.DEFAULT_TEMPLATES),
        help="class text templates, averaged (default: FOCI's 'an image of a {}')",
    )
    p.add_argument("--batch-size", type=int, default=256, help="images encoded per batch")
    p.add_argument(
        "--chunk-size", type=int, default=mining.DEFAULT_CHUNK_SIZE, help="images per jitted step"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_foci_zero_shot)

    p = sub.add_parser(
        "oodbench",
        help="OODBench splits.jsonl: ID / OOD-S / OOD-H pairs by scorer probability < T",
        description=oodbench.__doc__,
        epilog=help_text.examples(OODBENCH_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", required=True, help="COCO/LVIS directory the oodbench builder reads")
    p.add_argument(
        "--scorer",
        action="append",
        required=True,
        help="a scorer checkpoint (CLIP, SigLIP, BLIP-2, GroupViT or LiT directory); repeat for "
        "each (the paper uses CLIP and BLIP-2); named after its directory for --logit-scale",
    )
    p.add_argument(
        "--max-per-split",
        type=int,
        default=oodbench.MAX_PER_SPLIT,
        help="downsample larger splits to this many pairs (default 6000; 0 keeps all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the ID draw and the downsampling")
    p.add_argument("--out", help="splits file (default: SOURCE/splits.jsonl)")
    _add_pair_scoring(p)
    p.set_defaults(run=run_oodbench)

    p = sub.add_parser(
        "oodbench-ablation",
        help="OODBench's scorer ablations: Group I/II/III and 1..N scorer divisions, compared",
        description=ABLATION_DESCRIPTION,
        epilog=help_text.examples(ABLATION_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", required=True, help="COCO/LVIS directory the oodbench builder reads")
    p.add_argument(
        "--scorer",
        action="append",
        required=True,
        type=_named,
        metavar="NAME=DIR",
        help="a named scorer checkpoint (ood_jax.scorers.from_hf); repeat for each",
    )
    p.add_argument(
        "--group",
        action="append",
        type=_named,
        metavar="NAME=A,B,...",
        help="a division by these scorers, written to OUT/group-NAME.jsonl; repeat for each",
    )
    p.add_argument(
        "--series",
        metavar="A,B,...",
        help="divisions by the first 1, 2, ... of these scorers, in this order: OUT/series-K.jsonl",
    )
    p.add_argument("--out", required=True, help="output directory")
    _add_pair_scoring(p)
    p.set_defaults(run=run_oodbench_ablation)

    p = sub.add_parser(
        "oodg",
        help="COUNTS OODG items: drawn images and items.jsonl for the MLLM harness",
        description=oodg.__doc__,
        epilog=help_text.examples(OODG_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataset", required=True, help="counts or synthetic_shifts/CONFIG (built)")
    p.add_argument("--data-dir", required=True, help="TFDS data directory holding the dataset")
    p.add_argument("--split", default="test", help="source split of the test units (default test)")
    p.add_argument("--domains", nargs="+", help="test domains (default: every domain of the split)")
    p.add_argument(
        "--ice-split", help="source split the in-context examples come from (default: --split)"
    )
    p.add_argument("--task", required=True, choices=oodg.TASKS)
    p.add_argument("--setting", required=True, choices=oodg.SETTINGS)
    p.add_argument("--ice", type=int, default=0, help="in-context examples per item (default 0)")
    p.add_argument("--num-items", type=int, required=True, help="items to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (images/ and items.jsonl)")
    p.set_defaults(run=run_oodg)


def _logit_scale(spec: str) -> tuple[str, float]:
    name, value = _named(spec)
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise argparse.ArgumentTypeError(f"{spec!r}: the logit scale must be a positive number")
    return name, scale


def _add_pair_scoring(p: argparse.ArgumentParser) -> None:
    """What `mine oodbench` and `mine oodbench-ablation` score pairs with."""
    from ood_jax.mining import oodbench

    p.add_argument("--threshold", type=float, default=oodbench.THRESHOLD, help="T (default 0.05)")
    p.add_argument(
        "--logit-scale",
        action="append",
        type=_logit_scale,
        metavar="NAME=SCALE",
        help="score scorer NAME at this logit scale (1 / temperature) instead of its checkpoint's; "
        "needed for BLIP-2 retrieval checkpoints from transformers, which drop BLIP-2's learned "
        "temperature (the manifest records both)",
    )
    p.add_argument(
        "--lavis",
        action="append",
        type=_named,
        metavar="NAME=FILE",
        help="load BLIP-2 scorer NAME's weights and learned temperature from this LAVIS checkpoint "
        "(blip2_pretrained.pth); its --scorer directory (Salesforce/blip2-itm-vit-g) supplies the "
        "architecture, tokenizer and image processor",
    )
    p.add_argument(
        "--match",
        action="append",
        metavar="NAME",
        help="score scorer NAME's pairs with its image-text matching head (BLIP-2's ITM: the "
        "probability that the category text matches the image) instead of the contrastive "
        "softmax; one Q-Former pass per pair, not cached",
    )
    p.add_argument(
        "--templates",
        nargs="+",
        default=list(oodbench.DEFAULT_TEMPLATES),
        help="category text templates, averaged (default: 'a photo of a {}.')",
    )
    _add_common(p, chunk_size=None)


def _add_common(p: argparse.ArgumentParser, chunk_size: int | None) -> None:
    p.add_argument("--batch-size", type=int, default=256, help="images encoded per batch")
    p.add_argument(
        "--cache",
        help="directory keeping image features in shards as they are computed, so a killed run "
        "resumes where it stopped (refused if written by another scorer)",
    )
    if chunk_size is not None:
        p.add_argument(
            "--chunk-size", type=int, default=chunk_size, help="images per jitted mining step"
        )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
