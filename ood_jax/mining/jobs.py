"""The mining jobs behind `ood-jax mine`: each takes a frozen option record, loads its scorers,
mines, and writes its files with a manifest beside them (ood_jax.manifest)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ood_jax import files, manifest, multihost
from ood_jax.mining import DEFAULT_CHUNK_SIZE, foci, oodbench

# path -> scorer. The default loads ood_jax.scorers.from_hf over every device; tests pass their own.
ScorerFactory = Callable[[str], Any]


# ---------------------------------------------------------------------------------------------
# Option records: a field per `ood-jax mine` flag, named as the flag, so that a manifest's
# options are the command's flags (`options`).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a job encodes images with its scorer.

    Attributes:
      batch_size: images encoded per batch.
      quiet: no progress bar.
    """

    batch_size: int = 256
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class FociMining:
    """`mine foci`: FOCI's options file for the images of a source directory.

    Attributes:
      dataset: the FOCI config, e.g. "food101" or "foci/custom".
      source: the directory the foci builder reads.
      scorer: the scorer's checkpoint directory.
      out: the options file; None: where the builder looks for it in `source`.
      templates: class text templates, averaged.
      cache: a directory keeping image features as they are computed, so a killed job resumes
        where it stopped; None keeps nothing.
      chunk_size: images per jitted mining step.
      encoding: batch size and progress bar.
    """

    dataset: str
    source: str
    scorer: str
    out: str | None = None
    templates: tuple[str, ...] = foci.DEFAULT_TEMPLATES
    cache: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    encoding: Encoding = Encoding()


@dataclasses.dataclass(frozen=True)
class FociZeroShot:
    """`mine foci-zero-shot`: a scorer's accuracy per split of a foci or corrupted build.

    Attributes:
      data_dir: the TFDS data directory holding the build.
      dataset: "foci/CONFIG", or "corrupted/NAME" built from a foci config.
      scorer: the scorer's checkpoint directory.
      out: the run directory (zero_shot.json, corruptions.json).
      templates: class text templates, averaged.
      chunk_size: images per jitted step.
      encoding: batch size and progress bar.
    """

    data_dir: str
    dataset: str
    scorer: str
    out: str
    templates: tuple[str, ...] = foci.DEFAULT_TEMPLATES
    chunk_size: int = DEFAULT_CHUNK_SIZE
    encoding: Encoding = Encoding()


@dataclasses.dataclass(frozen=True)
class PairScoring:
    """How `mine oodbench` and `mine oodbench-ablation` score (image, category) pairs; a scorer
    is named by its NAME (the ablation) or its directory's name (oodbench).

    Attributes:
      threshold: T, below which a scorer puts a pair out of distribution.
      logit_scale: (scorer name, logit scale) pairs replacing a checkpoint's scale.
      lavis: (scorer name, LAVIS checkpoint) pairs: a BLIP-2 scorer's weights and temperature.
      match: scorer names scored with their image-text matching head.
      templates: category text templates, averaged.
      cache: a directory keeping each contrastive scorer's image features (CACHE/NAME).
    """

    threshold: float = oodbench.THRESHOLD
    logit_scale: tuple[tuple[str, float], ...] = ()
    lavis: tuple[tuple[str, str], ...] = ()
    match: tuple[str, ...] = ()
    templates: tuple[str, ...] = oodbench.DEFAULT_TEMPLATES
    cache: str | None = None


@dataclasses.dataclass(frozen=True)
class OodbenchMining:
    """`mine oodbench`: splits.jsonl of a COCO or LVIS source.

    Attributes:
      source: the directory the oodbench builder reads.
      scorer: scorer checkpoint directories, each named after its directory.
      max_per_split: larger splits are downsampled to this many pairs; 0 keeps all.
      seed: seed of the ID draw and the downsampling.
      out: the splits file; None: SOURCE/splits.jsonl.
      scoring: how pairs are scored.
      encoding: batch size and progress bar.
    """

    source: str
    scorer: tuple[str, ...]
    max_per_split: int = oodbench.MAX_PER_SPLIT
    seed: int = 0
    out: str | None = None
    scoring: PairScoring = PairScoring()
    encoding: Encoding = Encoding()


@dataclasses.dataclass(frozen=True)
class OodbenchAblation:
    """`mine oodbench-ablation`: the pairs divided by several scorer sets, and compared.

    Attributes:
      source: the directory the oodbench builder reads.
      scorer: (name, checkpoint directory) pairs.
      out: the output directory.
      group: (name, scorer names) pairs: a division each, OUT/group-NAME.jsonl.
      series: scorer names: divisions by the first 1, 2, ... of them, OUT/series-K.jsonl.
      scoring: how pairs are scored.
      encoding: batch size and progress bar.
    """

    source: str
    scorer: tuple[tuple[str, str], ...]
    out: str
    group: tuple[tuple[str, tuple[str, ...]], ...] = ()
    series: tuple[str, ...] = ()
    scoring: PairScoring = PairScoring()
    encoding: Encoding = Encoding()


@dataclasses.dataclass(frozen=True)
class OodgMining:
    """`mine oodg`: COUNTS OODG items and their images.

    Attributes:
      dataset: "counts" or "synthetic_shifts/CONFIG", built in `data_dir`.
      data_dir: the TFDS data directory.
      task: one of oodg.TASKS.
      setting: one of oodg.SETTINGS.
      num_items: items to write.
      out: the output directory (images/ and items.jsonl).
      split: the source split of the test units.
      domains: test domains; None: every domain of the split.
      ice_split: the source split of the in-context examples; None: `split`.
      ice: in-context examples per item.
      seed: seed of the draws.
    """

    dataset: str
    data_dir: str
    task: str
    setting: str
    num_items: int
    out: str
    split: str = "test"
    domains: tuple[str, ...] | None = None
    ice_split: str | None = None
    ice: int = 0
    seed: int = 0


def options(record: Any) -> dict:
    """What a job's manifest records as its options: every field by its name (a flag's name),
    the fields of a group (Encoding, PairScoring) among them."""
    flat = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if dataclasses.is_dataclass(value):
            flat.update(options(value))
        else:
            flat[field.name] = os.fspath(value) if isinstance(value, os.PathLike) else value
    return flat


# ---------------------------------------------------------------------------------------------
# Scorers, manifests, output
# ---------------------------------------------------------------------------------------------


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


def manifest_path(out: str | os.PathLike, directory: bool = False) -> pathlib.Path:
    """Where the manifest of a job writing `out` (a file, or a `directory`) goes: beside it,
    named after it (foci_options.json -> foci_options.manifest.json, OUT/ ->
    OUT.manifest.json), so that outputs in one directory each keep their own, and an output
    directory holds only what the job made."""
    out = pathlib.Path(out)
    return out.with_name(f"{out.name if directory else out.stem}.manifest.json")


def _start_manifest(command: str, record: Any, devices: bool, **fields) -> dict:
    return manifest.collect(
        f"mine {command}",
        devices=devices,
        packages=("transformers", "tensorflow-datasets"),
        options=options(record),
        **fields,
    )


def _recording(out: str | os.PathLike, record: dict, directory: bool = False):
    """manifest.recording for a job that writes `out` (a file, or a `directory`); the first
    process of several writes it, as it writes `out`."""
    path = manifest_path(out, directory)
    return manifest.recording(path.parent, record, name=path.name, enabled=multihost.is_primary())


def _say(*args, **kwargs) -> None:
    """print, once per job rather than once per process."""
    if multihost.is_primary():
        print(*args, **kwargs)


def _progress(encoding: Encoding) -> bool:
    return not encoding.quiet and multihost.is_primary()


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


def _interrupted(cache: str | None, out: str) -> KeyboardInterrupt:
    """Ctrl-C while mining: the output is written whole at the end, so only a cache keeps work."""
    if cache:
        kept = f"image features computed so far are kept in {cache}"
        how = "rerun the same command to continue from them"
    else:
        kept, how = "nothing kept", "rerun with --cache DIR to keep image features as they come"
    return KeyboardInterrupt(f"{kept}; {out} was not written; {how}")


# ---------------------------------------------------------------------------------------------
# FOCI
# ---------------------------------------------------------------------------------------------


def run_foci(job: FociMining, scorer_factory: ScorerFactory | None = None) -> None:
    """Mines FOCI's options file; ValueError for a bad source or scorer."""
    source = foci.read_source(job.dataset, job.source)
    out = pathlib.Path(job.out) if job.out else source.root / source.options_file
    dataset = {
        "name": job.dataset,
        "source": str(source.root.resolve()),
        "records": _records(zip(source.images, source.labels)),
    }
    record = _start_manifest("foci", job, devices=True, dataset=dataset)
    with _recording(out, record):
        try:
            scorer = _load_scorer(scorer_factory, job.scorer)
            record["scorers"] = [_scorer_manifest(job.scorer, scorer)]
            contents, accuracy = foci.mine_source(
                source, scorer, job.templates, job.encoding.batch_size, job.chunk_size,
                progress=_progress(job.encoding), cache_dir=job.cache,
            )  # fmt: skip
        except KeyboardInterrupt:
            raise _interrupted(job.cache, job.out or "the options file") from None
        if multihost.is_primary():
            files.write_json_atomic(out, contents)
            record.update(outputs=[_output(out)], accuracy=accuracy)
    _say(
        f"{len(source.images)} images, {len(source.class_names)} classes -> {out}\n"
        f"zero-shot accuracy of this scorer: {accuracy['all_classes']:.4f} over all classes, "
        f"{accuracy['options']:.4f} over the {foci.NUM_OPTIONS} options (the same number when "
        "one scorer both mines and answers: its top wrong class is always an option)"
    )


def run_foci_zero_shot(job: FociZeroShot, scorer_factory: ScorerFactory | None = None) -> None:
    """A scorer's zero-shot and 4-way accuracy per split; ValueError for a bad build or scorer."""
    from ood_jax.mining import zero_shot

    target = zero_shot.read_target(job.data_dir, job.dataset)
    dataset = {**manifest.tfds_dataset(target.builder), "source": target.source}
    record = _start_manifest("foci-zero-shot", job, devices=True, dataset=dataset)
    with _recording(job.out, record, directory=True):
        scorer = _load_scorer(scorer_factory, job.scorer)
        record["scorers"] = [_scorer_manifest(job.scorer, scorer)]
        results = zero_shot.evaluate(
            scorer, target, job.dataset, job.templates, job.encoding.batch_size, job.chunk_size,
            progress=_progress(job.encoding),
        )  # fmt: skip
        if not multihost.is_primary():
            return
        written = zero_shot.write(job.out, results)
        record["outputs"] = [_output(path) for path in written]
    print(written[1].read_text(), end="")
    print(f"-> {job.out}")


# ---------------------------------------------------------------------------------------------
# OODBench
# ---------------------------------------------------------------------------------------------


def _scorer_names(paths: Sequence[str]) -> list[str]:
    names = []
    for path in paths:
        name = pathlib.Path(path).name or path
        names.append(name if name not in names else f"{name}#{len(names)}")
    return names


def _unique(flag: str, specs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    named = {}
    for name, value in specs:
        if name in named:
            raise ValueError(f"{flag} {name} is given twice")
        named[name] = value
    return named


def _pairs_dataset(source: str, pairs: oodbench.Pairs) -> dict:
    """The manifest's dataset entry of the (image, category) pairs read from `source`."""
    return {
        "source": str(pathlib.Path(source).resolve()),
        "records": _records(zip(pairs.image_ids.tolist(), pairs.category_ids.tolist())),
    }


def _named_in(flag: str, names: Sequence[str], scorers: Sequence[str], listed: str) -> None:
    """ValueError for the first of `names` (given with `flag`) that names no scorer."""
    for name in sorted(set(names) - set(scorers)):
        raise ValueError(f"{flag} {name}: no scorer of that name ({listed}{', '.join(scorers)})")


def _score_with_each(
    scoring: PairScoring,
    encoding: Encoding,
    pairs: oodbench.Pairs,
    scorer_paths: dict[str, str],
    record: dict,
    factory: ScorerFactory | None,
) -> dict:
    """{name: S(x, c) per pair} for each named scorer, one encoding pass (cached) each."""
    scales = _unique("--logit-scale", scoring.logit_scale)
    _named_in("--logit-scale", scales, list(scorer_paths), "scorers: ")
    _named_in("--match", scoring.match, list(scorer_paths), "scorers: ")
    lavis = _unique("--lavis", scoring.lavis)
    _named_in("--lavis", lavis, list(scorer_paths), "")
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
        matching = name in scoring.match
        entry["score"] = "image-text matching" if matching else "contrastive"
        record["scorers"].append(entry)
        _say(f"scoring {len(pairs.image_ids)} pairs with {name} ({scorer.kind}, {entry['score']})")
        # Matching scores are pairwise: there are no image features to cache.
        cache = pathlib.Path(scoring.cache) / name if scoring.cache and not matching else None
        scores[name] = oodbench.score_pairs(
            pairs, scorer, scoring.templates, encoding.batch_size, _progress(encoding), cache,
            matching=matching,
        )  # fmt: skip
    return scores


def run_oodbench(job: OodbenchMining, scorer_factory: ScorerFactory | None = None) -> None:
    """Writes OODBench's splits file; ValueError for a bad source, scorer or scorer name."""
    pairs = oodbench.read_pairs(job.source)
    out = pathlib.Path(job.out) if job.out else pathlib.Path(job.source) / "splits.jsonl"
    dataset = _pairs_dataset(job.source, pairs)
    record = _start_manifest("oodbench", job, devices=True, dataset=dataset, scorers=[])
    threshold = job.scoring.threshold
    with _recording(out, record):
        try:
            named = dict(zip(_scorer_names(job.scorer), job.scorer))
            scores = _score_with_each(
                job.scoring, job.encoding, pairs, named, record, scorer_factory
            )
            records = oodbench.split_records(
                pairs, scores, threshold, job.max_per_split or None, job.seed
            )
        except KeyboardInterrupt:
            raise _interrupted(job.scoring.cache, job.out or "splits.jsonl") from None
        if not multihost.is_primary():
            return
        files.write_jsonl_atomic(out, records)
        record["outputs"] = [_output(out)]
    labels = oodbench.assign_splits(scores, threshold)
    print(f"{len(labels)} pairs scored; threshold {threshold}")
    for split in oodbench.SPLITS:
        kept = sum(r["split"] == split for r in records)
        print(f"  {split}: {int((labels == split).sum())} pairs, {kept} written")
    print(f"-> {out}")


def run_oodbench_ablation(
    job: OodbenchAblation, scorer_factory: ScorerFactory | None = None
) -> None:
    """Writes each division's splits file and their consistency table; ValueError for a bad
    source, scorer, group or series."""
    scorer_paths = _unique("--scorer", job.scorer)
    groups = _unique("--group", job.group)
    divisions = oodbench.ablation_divisions(list(scorer_paths), groups, job.series)
    pairs = oodbench.read_pairs(job.source)
    out = pathlib.Path(job.out)
    dataset = _pairs_dataset(job.source, pairs)
    record = _start_manifest("oodbench-ablation", job, devices=True, dataset=dataset, scorers=[])
    threshold = job.scoring.threshold
    with _recording(out, record, directory=True):
        try:
            scores = _score_with_each(
                job.scoring, job.encoding, pairs, scorer_paths, record, scorer_factory
            )
            labels = oodbench.divide(scores, divisions, threshold)
        except KeyboardInterrupt:
            raise _interrupted(job.scoring.cache, str(out)) from None
        if not multihost.is_primary():
            return
        record["outputs"] = _write_ablation(out, pairs, scores, divisions, labels, threshold)
    print((out / "consistency.md").read_text(), end="")
    print(f"-> {out}")


def _write_ablation(out, pairs, scores, divisions, labels, threshold) -> list[dict]:
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


# ---------------------------------------------------------------------------------------------
# OODG
# ---------------------------------------------------------------------------------------------


def run_oodg(job: OodgMining) -> None:
    """Writes OODG items and their images; ValueError for an unbuilt dataset or impossible
    request. OODG items need no scorer."""
    from ood_jax.mining import oodg

    builder = oodg.load_builder(job.dataset, job.data_dir)
    record = _start_manifest("oodg", job, devices=False, dataset=manifest.tfds_dataset(builder))
    with _recording(job.out, record, directory=True):
        test_records = oodg.read_records(builder, job.split, job.domains)
        record["dataset"]["records"] = _records(r.key for r in test_records)
        plan = _oodg_plan(job, builder, test_records)
        if not multihost.is_primary():  # every process plans the same items
            return
        path = oodg.write(builder, plan, job.out)
        record.update(outputs=[_output(path)], items=len(plan.items), images=len(plan.units))
    print(
        f"{len(plan.items)} {job.task} items ({job.setting}, {job.ice} in-context examples), "
        f"{len(plan.units)} images -> {path}"
    )
    if plan.skipped:
        print(f"  {plan.skipped} test units skipped: too few eligible in-context examples")
    if len(plan.items) < job.num_items:
        print(f"  {job.num_items} items asked for, {len(plan.items)} possible", file=sys.stderr)


def _oodg_plan(job: OodgMining, builder: Any, test_records: list) -> Any:
    """The items of `job`: test units of `test_records`, their in-context examples."""
    from ood_jax.mining import oodg

    # Examples may come from any domain of their split, whatever the test domains are.
    ice_split = job.ice_split or job.split
    if job.ice == 0:
        example_records = []
    elif ice_split == job.split and job.domains is None:
        example_records = test_records
    else:
        example_records = oodg.read_records(builder, ice_split)
    make_units = oodg.UNIT_BUILDERS[job.task]
    test_units = make_units(test_records)
    if not test_units:
        raise ValueError(f"{job.dataset} {job.split}: no {job.task} units")
    label_names = builder.info.features["objects"]["label"].names
    plan = oodg.build_items(
        test_units, make_units(example_records), label_names, oodg.concepts_of(label_names),
        job.setting, job.ice, job.num_items, job.seed,
    )  # fmt: skip
    if not plan.items:
        raise ValueError(
            f"no item could be built: all {plan.considered} test units lack {job.ice} "
            f"eligible in-context examples for {job.setting}"
        )
    return plan
