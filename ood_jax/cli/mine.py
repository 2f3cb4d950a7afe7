"""`ood-jax mine foci | foci-zero-shot | oodbench | oodbench-ablation | oodg`: the flags of the
mining jobs (ood_jax.mining.jobs), each turned into the job's option record."""

from __future__ import annotations

import argparse
import re

from ood_jax.cli import help_text
from ood_jax.mining import DEFAULT_CHUNK_SIZE, foci, jobs, oodbench, oodg

FOCI_EXAMPLE = (
    "ood-jax mine foci --dataset food101 --source data/foci/food101 \\\n"
    "      --scorer models/clip-vit-l14 --cache work/foci_cache"
)
FOCI_ZERO_SHOT_EXAMPLE = (
    "ood-jax mine foci-zero-shot --data-dir data/tfds \\\n"
    "      --dataset corrupted/foci-food101-1a2b3c4d5e --scorer models/clip-vit-l14 \\\n"
    "      --out work/food101_zero_shot"
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

DOCS = "Sources, outputs and the rules: docs/guide/scorers-and-mining.md, docs/protocols.md."
FOCI_DESCRIPTION = help_text.fill(
    "FOCI's options file: per image of a source, the truth and the three wrong classes the "
    "scorer ranks highest by cosine similarity with the class text (FOCI's mining). SOURCE is "
    "the directory the foci builder reads; the file goes where the builder looks for it "
    "(SOURCE/foci_options.json, or SOURCE/options.json for imagenet21k_* and custom) unless "
    "--out says otherwise. " + DOCS
)
ZERO_SHOT_DESCRIPTION = help_text.fill(
    "A scorer's zero-shot accuracy over all classes and over each record's 4 options, per split "
    "of a foci build, or per corruption and severity of a corrupted build of one (FOCI Fig. 3): "
    "OUT/zero_shot.json and .md, and for a corrupted build OUT/corruptions.json, which "
    "`ood-jax report` reads. " + DOCS
)
OODBENCH_DESCRIPTION = help_text.fill(
    "OODBench's splits file: every (image, category present in its annotations) pair of a COCO "
    "or LVIS source scored by each scorer's probability S(x, c); OOD-H when every scorer puts "
    "it below --threshold, OOD-S when some do, ID a random draw of the others; splits over "
    "--max-per-split pairs are downsampled. " + DOCS
)
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
OODG_DESCRIPTION = help_text.fill(
    "COUNTS OODG items: grounding, localization or mapping questions about a built COUNTS (or "
    "synthetic_shifts) split, drawn as OUT/images/*.png, with in-context examples chosen by "
    "--setting, written to OUT/items.jsonl for `ood-jax eval-mllm counts-oodg`. " + DOCS
)


def add_parsers(subparsers) -> None:
    """Adds `mine` with its subcommands to an ood-jax parser."""
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
    for add in (_add_foci, _add_foci_zero_shot, _add_oodbench, _add_oodbench_ablation, _add_oodg):
        add(sub)


def _command(sub, name: str, summary: str, description: str, example: str, run):
    p = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=help_text.examples(example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(run=run)
    return p


def _add_foci(sub) -> None:
    p = _command(
        sub, "foci",
        "FOCI options: the truth and the 3 wrong classes a CLIP scorer ranks highest",
        FOCI_DESCRIPTION, FOCI_EXAMPLE, _foci,
    )  # fmt: skip
    p.add_argument("--dataset", required=True, help="FOCI config, e.g. food101 or foci/custom")
    p.add_argument(
        "--source",
        "--data-dir",
        dest="source",
        required=True,
        help="the directory the foci builder reads (its --source)",
    )
    _add_scorer(p)
    p.add_argument(
        "--out", help="options file (default: where the builder reads it in the source directory)"
    )
    _add_templates(p, "class", foci.DEFAULT_TEMPLATES, "FOCI's 'an image of a {}'")
    _add_encoding(p, cache=True, chunk_size=True)


def _add_foci_zero_shot(sub) -> None:
    p = _command(
        sub, "foci-zero-shot",
        "a scorer's zero-shot and 4-way accuracy per split of a foci or corrupted build",
        ZERO_SHOT_DESCRIPTION, FOCI_ZERO_SHOT_EXAMPLE, _foci_zero_shot,
    )  # fmt: skip
    p.add_argument("--data-dir", required=True, help="TFDS data directory holding the build")
    p.add_argument(
        "--dataset", required=True, help="foci/CONFIG, or corrupted/NAME built from a foci config"
    )
    _add_scorer(p)
    p.add_argument("--out", required=True, help="run directory (zero_shot.json, corruptions.json)")
    _add_templates(p, "class", foci.DEFAULT_TEMPLATES, "FOCI's 'an image of a {}'")
    _add_encoding(p, cache=False, chunk_size=True)


def _add_oodbench(sub) -> None:
    p = _command(
        sub, "oodbench",
        "OODBench splits.jsonl: ID / OOD-S / OOD-H pairs by scorer probability < T",
        OODBENCH_DESCRIPTION, OODBENCH_EXAMPLE, _oodbench,
    )  # fmt: skip
    _add_pair_source(p)
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


def _add_oodbench_ablation(sub) -> None:
    p = _command(
        sub, "oodbench-ablation",
        "OODBench's scorer ablations: Group I/II/III and 1..N scorer divisions, compared",
        ABLATION_DESCRIPTION, ABLATION_EXAMPLE, _oodbench_ablation,
    )  # fmt: skip
    _add_pair_source(p)
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


def _add_oodg(sub) -> None:
    p = _command(
        sub, "oodg",
        "COUNTS OODG items: drawn images and items.jsonl for the MLLM harness",
        OODG_DESCRIPTION, OODG_EXAMPLE, _oodg,
    )  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# Flag groups, each declared once, and the option records they make
# ---------------------------------------------------------------------------------------------


def _add_scorer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scorer", required=True, help="scorer checkpoint directory (ood_jax.scorers)")


def _add_templates(p: argparse.ArgumentParser, what: str, default, named: str) -> None:
    p.add_argument(
        "--templates",
        nargs="+",
        default=list(default),
        help=f"{what} text templates, averaged (default: {named})",
    )


def _add_encoding(p: argparse.ArgumentParser, cache: bool, chunk_size: bool) -> None:
    """jobs.Encoding's flags, with the job's --cache and --chunk-size where it has them."""
    p.add_argument("--batch-size", type=int, default=256, help="images encoded per batch")
    if cache:
        p.add_argument(
            "--cache",
            help="directory keeping image features in shards as they are computed, so a killed "
            "run resumes where it stopped (refused if written by another scorer)",
        )
    if chunk_size:
        p.add_argument(
            "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="images per jitted step"
        )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _encoding(args: argparse.Namespace) -> jobs.Encoding:
    return jobs.Encoding(batch_size=args.batch_size, quiet=args.quiet)


def _add_pair_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, help="COCO/LVIS directory the oodbench builder reads")


def _add_pair_scoring(p: argparse.ArgumentParser) -> None:
    """jobs.PairScoring's flags, and jobs.Encoding's."""
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
    _add_templates(p, "category", oodbench.DEFAULT_TEMPLATES, "'a photo of a {}.'")
    _add_encoding(p, cache=True, chunk_size=False)


def _pair_scoring(args: argparse.Namespace) -> jobs.PairScoring:
    return jobs.PairScoring(
        threshold=args.threshold,
        logit_scale=tuple(args.logit_scale or ()),
        lavis=tuple(args.lavis or ()),
        match=tuple(args.match or ()),
        templates=tuple(args.templates),
        cache=args.cache,
    )


def _named(spec: str) -> tuple[str, str]:
    """NAME=VALUE of --scorer, --group and --lavis; NAME also names files, so it stays a plain
    word."""
    name, sep, value = spec.partition("=")
    if not sep or not value or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=VALUE, NAME of [A-Za-z0-9_.-]")
    return name, value


def _logit_scale(spec: str) -> tuple[str, float]:
    name, value = _named(spec)
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise argparse.ArgumentTypeError(f"{spec!r}: the logit scale must be a positive number")
    return name, scale


# ---------------------------------------------------------------------------------------------
# The commands: flags -> option record -> job
# ---------------------------------------------------------------------------------------------


def _run(job, make_options, args: argparse.Namespace, *scorer_factory) -> None:
    """The job on the options the flags give; a ValueError (a bad source, value or name)
    becomes the command's one error line."""
    try:
        job(make_options(args), *scorer_factory)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def foci_options(args: argparse.Namespace) -> jobs.FociMining:
    return jobs.FociMining(
        dataset=args.dataset,
        source=args.source,
        scorer=args.scorer,
        out=args.out,
        templates=tuple(args.templates),
        cache=args.cache,
        chunk_size=args.chunk_size,
        encoding=_encoding(args),
    )


def foci_zero_shot_options(args: argparse.Namespace) -> jobs.FociZeroShot:
    return jobs.FociZeroShot(
        data_dir=args.data_dir,
        dataset=args.dataset,
        scorer=args.scorer,
        out=args.out,
        templates=tuple(args.templates),
        chunk_size=args.chunk_size,
        encoding=_encoding(args),
    )


def oodbench_options(args: argparse.Namespace) -> jobs.OodbenchMining:
    return jobs.OodbenchMining(
        source=args.source,
        scorer=tuple(args.scorer),
        max_per_split=args.max_per_split,
        seed=args.seed,
        out=args.out,
        scoring=_pair_scoring(args),
        encoding=_encoding(args),
    )


def oodbench_ablation_options(args: argparse.Namespace) -> jobs.OodbenchAblation:
    return jobs.OodbenchAblation(
        source=args.source,
        scorer=tuple(args.scorer),
        out=args.out,
        group=tuple((name, tuple(members.split(","))) for name, members in args.group or ()),
        series=tuple(args.series.split(",")) if args.series else (),
        scoring=_pair_scoring(args),
        encoding=_encoding(args),
    )


def oodg_options(args: argparse.Namespace) -> jobs.OodgMining:
    return jobs.OodgMining(
        dataset=args.dataset,
        data_dir=args.data_dir,
        task=args.task,
        setting=args.setting,
        num_items=args.num_items,
        out=args.out,
        split=args.split,
        domains=tuple(args.domains) if args.domains is not None else None,
        ice_split=args.ice_split,
        ice=args.ice,
        seed=args.seed,
    )


# The subcommands' `run`: `args.run(args)`, and in tests `args.run(args, scorer_factory=...)`.


def _foci(args: argparse.Namespace, scorer_factory: jobs.ScorerFactory | None = None) -> None:
    _run(jobs.run_foci, foci_options, args, scorer_factory)


def _foci_zero_shot(
    args: argparse.Namespace, scorer_factory: jobs.ScorerFactory | None = None
) -> None:
    _run(jobs.run_foci_zero_shot, foci_zero_shot_options, args, scorer_factory)


def _oodbench(args: argparse.Namespace, scorer_factory: jobs.ScorerFactory | None = None) -> None:
    _run(jobs.run_oodbench, oodbench_options, args, scorer_factory)


def _oodbench_ablation(
    args: argparse.Namespace, scorer_factory: jobs.ScorerFactory | None = None
) -> None:
    _run(jobs.run_oodbench_ablation, oodbench_ablation_options, args, scorer_factory)


def _oodg(args: argparse.Namespace) -> None:
    _run(jobs.run_oodg, oodg_options, args)
