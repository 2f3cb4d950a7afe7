"""A scorer's zero-shot accuracy on a built FOCI dataset, clean or corrupted (FOCI Fig. 3): over
all classes and over each record's 4 options, per split or per corruption and severity, with
exact intervals (`evaluate`), written as RUN/zero_shot.json and .md and, for a corrupted build,
the RUN/corruptions.json `ood-jax report` reads (`write`). Usage: docs/guide/corruptions.md.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ood_jax import files, mining, stats
from ood_jax.data import building
from ood_jax.data import corrupted as naming
from ood_jax.data import corruptions
from ood_jax.data import iteration
from ood_jax.metrics import robustness
from ood_jax.mining import foci

# Not results.json: the report reads that as an eval-mllm run's, which this is not.
RESULTS_FILE = "zero_shot.json"
MARKDOWN_FILE = "zero_shot.md"
TEST = "test"
METRIC = "accuracy"
CORRUPTED = "corrupted"  # the TFDS name `ood-jax build corrupted` writes under
CONFIDENCE = 0.95
INTERVALS = {"method": "clopper-pearson", "confidence": CONFIDENCE}


@dataclasses.dataclass(frozen=True)
class Target:
    """What is scored: a built dataset (a tfds builder), the FOCI dataset its records come from,
    the split the classes are read from, and {results key: (TFDS split, what it holds)} in
    scoring order."""

    builder: Any
    source: str
    class_split: str
    splits: dict[str, tuple[str, naming.Split | None]]


def read_target(data_dir: str, dataset: str) -> Target:
    """The build `dataset` (foci/CONFIG or corrupted/NAME) under `data_dir`; ValueError naming
    what is missing otherwise."""
    from ood_jax import datasets

    name = dataset.partition("/")[0]
    if name not in ("foci", CORRUPTED):
        raise ValueError(f"--dataset {dataset!r}: expected foci/CONFIG or corrupted/NAME")
    if name == "foci":
        dataset = f"foci/{foci.config_name(dataset)}"
    try:
        builder = datasets.load(dataset, data_dir)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    if name == "foci":
        # The test split first: the other splits (ImageNet-1k's halves, GeoDE's regions) are
        # its parts.
        ordered = sorted(builder.info.splits, key=lambda split: (split != TEST, split))
        return Target(builder, dataset, TEST, {split: (split, None) for split in ordered})
    return _corrupted_target(builder, dataset)


def _corrupted_target(builder, dataset: str) -> Target:
    """A corrupted build of a foci dataset: its test split's clean copy, then each corruption
    (ImageNet-C's order) and severity (ascending)."""
    record = building.BuildRecord.read(pathlib.Path(builder.data_path))
    source = (record.settings or {}).get("dataset") if record else None
    if source is None or source.partition("/")[0] != "foci":
        raise ValueError(
            f"--dataset {dataset}: built from {source or 'an unrecorded dataset'}, not from a foci "
            "dataset; build one with `ood-jax build corrupted --dataset foci/CONFIG ...`"
        )
    parsed = [naming.parse_split_name(split) for split in builder.info.splits]
    held = sorted((s for s in parsed if s is not None and s.source == TEST), key=_order)
    if not held or held[0].corruption is not None:
        raise ValueError(f"--dataset {dataset}: holds no clean copy of {source}'s test split")
    splits = {_key(split): (naming.split_name(*split), split) for split in held}
    return Target(builder, source, naming.split_name(TEST), splits)


def _order(split: naming.Split) -> tuple[int, int]:
    # Clean first, then ImageNet-C's order of corruptions, severities ascending.
    if split.corruption is None:
        return (-1, 0)
    return corruptions.NAMES.index(split.corruption), split.severity


def _key(split: naming.Split) -> str:
    return naming.CLEAN if split.corruption is None else f"{split.corruption}/{split.severity}"


def records(builder, split: str) -> Iterator[dict]:
    """A split's records in file order, images left as their encoded bytes."""
    import tensorflow_datasets as tfds

    decoders = {"image": tfds.decode.SkipDecoding()}
    dataset = builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
    yield from iteration.numpy_iterator(dataset)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def interval(correct: int, n: int) -> list[float]:
    """The exact (Clopper-Pearson) CONFIDENCE interval of `correct` of `n`."""
    return list(stats.clopper_pearson(correct, n, CONFIDENCE))


def class_names(target: Target) -> tuple[str, ...]:
    """The class split's distinct labels, sorted (the lower index wins a tie, as in mining)."""
    labels = {_text(r["label"]) for r in records(target.builder, target.class_split)}
    if not labels:
        raise ValueError(f"{target.builder.data_path}: split {target.class_split} is empty")
    return tuple(sorted(labels))


def _decode(encoded: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(encoded)) as image:
        return np.asarray(image.convert("RGB"))


def _index(classes: dict[str, int], name: str, where: str) -> int:
    if name not in classes:
        raise ValueError(f"{where}: {name!r} is not a label of the test split, the class set")
    return classes[name]


def score_split(
    scorer,
    builder,
    split: str,
    classes: dict[str, int],
    text_features: np.ndarray,
    batch_size: int,
    chunk_size: int,
) -> dict:
    """One split's accuracies over all classes and over each record's options, with intervals."""
    images, labels, options, features = [], [], [], []
    for record in records(builder, split):
        where = f"{split} record {_text(record['image/filename'])}"
        labels.append(_index(classes, _text(record["label"]), where))
        options.append([_index(classes, _text(o), where) for o in record["options"]])
        images.append(bytes(record["image"]))
        # Decoded a batch at a time, so a split's pixels are never all in memory.
        if len(images) == batch_size:
            features.append(scorer.encode_images([_decode(b) for b in images], batch_size))
            images = []
    if images:
        features.append(scorer.encode_images([_decode(b) for b in images], batch_size))
    if not labels:
        raise ValueError(f"{builder.data_path}: split {split} is empty")
    accuracy = foci.zero_shot_accuracy(
        np.concatenate(features).astype(np.float32), text_features, np.array(labels),
        np.array(options), chunk_size,
    )  # fmt: skip
    n = accuracy["num_images"]
    entry = {"split": split, "images": n}
    for key, field in (("zero_shot", "all_classes"), ("four_way", "options")):
        entry[key] = accuracy[field]
        # The accuracy is a mean of n booleans, so this is its exact count of hits.
        entry[f"{key}_ci"] = interval(round(accuracy[field] * n), n)
    return entry


def evaluate(
    scorer,
    target: Target,
    dataset: str,
    templates: Sequence[str] = foci.DEFAULT_TEMPLATES,
    batch_size: int = 256,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    progress: bool = True,
) -> dict:
    """zero_shot.json's content for `target`, scored by `scorer`: {"dataset", "source",
    "templates", "classes", "intervals", "splits": {key: {"split", "images", "zero_shot",
    "zero_shot_ci", "four_way", "four_way_ci"[, "corruption", "severity"]}}}, keyed by the
    split's name (a foci build) or by "clean" and "CORRUPTION/SEVERITY" (a corrupted build)."""
    from tqdm import tqdm

    names = class_names(target)
    text_features = np.asarray(
        scorer.encode_texts(list(names), templates=tuple(templates)), np.float32
    )
    classes = {name: i for i, name in enumerate(names)}
    splits = {}
    for key, (split, held) in tqdm(target.splits.items(), desc="splits", disable=not progress):
        entry = score_split(
            scorer, target.builder, split, classes, text_features, batch_size, chunk_size
        )
        if held is not None and held.corruption is not None:
            entry.update(corruption=held.corruption, severity=held.severity)
        splits[key] = entry
    return {
        "dataset": dataset,
        "source": target.source,
        "templates": list(templates),
        "classes": list(names),
        "intervals": INTERVALS,
        "splits": splits,
    }


def robustness_summary(results: dict) -> dict | None:
    """mPC and rPC of the all-class accuracy (robustness.summary); None without corruptions."""
    grid: dict[str, dict[int, float]] = {}
    for entry in results["splits"].values():
        if "corruption" in entry:
            grid.setdefault(entry["corruption"], {})[entry["severity"]] = entry["zero_shot"]
    if not grid:
        return None
    return robustness.summary(results["splits"][naming.CLEAN]["zero_shot"], grid, METRIC)


def _pct_ci(value: float, ci: Sequence[float]) -> str:
    """A percentage and its interval: "43.48 [23.19, 65.51]"."""
    return f"{100 * value:.2f} [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]"


def markdown(results: dict, summary: dict | None) -> str:
    header = ["split", "images", f"zero-shot, {len(results['classes'])} classes", "4-way"]
    lines = [
        f"## Zero-shot accuracy: {results['dataset']} ({results['source']})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for key, e in results["splits"].items():
        zero, four = (
            _pct_ci(e["zero_shot"], e["zero_shot_ci"]),
            _pct_ci(e["four_way"], e["four_way_ci"]),
        )
        lines.append(f"| {key} | {e['images']} | {zero} | {four} |")
    lines += ["", f"Brackets: exact (Clopper-Pearson) {100 * CONFIDENCE:g}% intervals."]
    if summary is not None:
        rpc = "-" if summary["rPC"] is None else f"{summary['rPC']:.3f}"
        lines += ["", f"Zero-shot: mPC {100 * summary['mPC']:.2f}, rPC {rpc}."]
    return "\n".join(lines) + "\n"


def write(run_dir: str | pathlib.Path, results: dict) -> list[pathlib.Path]:
    """RUN/zero_shot.json and .md, and RUN/corruptions.json for a corrupted build; the paths."""
    run_dir = pathlib.Path(run_dir)
    summary = robustness_summary(results)
    written = [
        files.write_json_atomic(run_dir / RESULTS_FILE, results),
        files.write_atomic(run_dir / MARKDOWN_FILE, markdown(results, summary)),
    ]
    if summary is not None:
        robustness.write(run_dir, {TEST: summary}, TEST)
        written.append(run_dir / robustness.FILE)
    return written
