"""OODBench's splits: (image, category) pairs scored by contrastive scorers' probability S(x, c)
(`clip_probability`, `siglip_probability`, `match_pairs`), divided into ID, OOD-S and OOD-H
(`assign_splits`, `sample_splits`) and written as the splits.jsonl the oodbench builder reads
(`split_records`); the paper's scorer ablations (`ablation_divisions`, `consistency`). The rules
and where they differ from the paper: docs/protocols.md.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax import mining, scorers
from ood_jax.data import oodbench as oodbench_source
from ood_jax.data.oodbench import category_text

THRESHOLD = 0.05  # T, the paper's ablation's choice
MAX_PER_SPLIT = 6000  # "random downsampling ... when the number of samples exceeds 6,000"
SPLITS = ("ID", "OOD-S", "OOD-H")
# The paper does not print its prompt; this is CLIP's usual one, a choice of this project.
DEFAULT_TEMPLATES = ("a photo of a {}.",)


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------


def _cosine(images, texts):
    """[N, D] or [N, Q, D] images, [C, D] texts -> [N, C]; an image with several embeddings
    (BLIP-2's queries) takes its best cosine, as BLIP-2's contrastive similarity does."""
    images = images / jnp.linalg.norm(images, axis=-1, keepdims=True)
    texts = texts / jnp.linalg.norm(texts, axis=-1, keepdims=True)
    cosine = images @ texts.T
    return cosine.max(axis=1) if cosine.ndim == 3 else cosine


@jax.jit
def _softmax_at(rows, categories, images, texts, logit_scale):
    logits = logit_scale * _cosine(images[rows], texts)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.exp(jnp.take_along_axis(log_probs, categories[:, None], axis=1)[:, 0])


@jax.jit
def _sigmoid_at(rows, categories, images, texts, logit_scale, logit_bias):
    cosine = jnp.take_along_axis(_cosine(images[rows], texts), categories[:, None], axis=1)[:, 0]
    return jax.nn.sigmoid(logit_scale * cosine + logit_bias)


def _checked(image_features, text_features, categories, image_rows):
    texts = mining.check_features("text_features", text_features)
    images = mining.check_features("image_features", image_features, texts.shape[1], per_row=True)
    for name, features in (("image_features", images), ("text_features", texts)):
        zero = ~np.any(features, axis=-1).reshape(len(features), -1).all(axis=1)
        if zero.any():
            raise ValueError(f"{name} row {int(np.argmax(zero))} has an all-zero embedding")
    if image_rows is None:
        image_rows = np.arange(len(images))
    rows = mining.check_indices("image_rows", image_rows, len(images), len(image_rows))
    categories = mining.check_indices("categories", categories, len(texts), len(rows))
    return rows, categories, images, texts


def clip_probability(
    image_features: np.ndarray,
    text_features: np.ndarray,
    categories: np.ndarray,
    logit_scale: float,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    image_rows: np.ndarray | None = None,
) -> np.ndarray:
    """float32 [N]: softmax over all C categories of logit_scale * cosine, at each pair's category.

    image_features [N, D] (one row per pair; or [N, Q, D], scored by the best of the Q),
    text_features [C, D] (every category of the dataset), categories [N] (index of each pair's
    category); both features normalized here. With `image_rows` [P], image_features holds each
    image once and pair p is image `image_rows[p]`: no per-pair copy of the features is made.
    """
    rows, categories, images, texts = _checked(
        image_features, text_features, categories, image_rows
    )
    fn = functools.partial(_softmax_at, logit_scale=np.float32(logit_scale))
    return mining.map_rows_in_chunks(fn, [rows, categories], [images, texts], chunk_size)[0]


def siglip_probability(
    image_features: np.ndarray,
    text_features: np.ndarray,
    categories: np.ndarray,
    logit_scale: float,
    logit_bias: float,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    image_rows: np.ndarray | None = None,
) -> np.ndarray:
    """float32 [N]: sigmoid(logit_scale * cosine + logit_bias) of each pair's category; the
    arguments as `clip_probability`'s."""
    rows, categories, images, texts = _checked(
        image_features, text_features, categories, image_rows
    )
    fn = functools.partial(
        _sigmoid_at, logit_scale=np.float32(logit_scale), logit_bias=np.float32(logit_bias)
    )
    return mining.map_rows_in_chunks(fn, [rows, categories], [images, texts], chunk_size)[0]


def assign_splits(scores: Mapping[str, np.ndarray], threshold: float = THRESHOLD) -> np.ndarray:
    """Per pair "OOD-H" (every scorer < threshold), "OOD-S" (some, not all) or "ID" (none)."""
    if not scores:
        raise ValueError("no scores given")
    arrays = {}
    for name, values in scores.items():
        values = np.asarray(values, np.float64)
        if values.ndim != 1:
            raise ValueError(f"scores[{name!r}] must be 1-D, got shape {values.shape}")
        if np.isnan(values).any():
            raise ValueError(f"scores[{name!r}][{int(np.argmax(np.isnan(values)))}] is NaN")
        arrays[name] = values
    lengths = {name: len(v) for name, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"scores differ in length: {lengths}")
    below = np.stack([v < threshold for v in arrays.values()])
    return np.where(below.all(0), "OOD-H", np.where(below.any(0), "OOD-S", "ID"))


def sample_splits(
    labels: np.ndarray, max_per_split: int | None = MAX_PER_SPLIT, seed: int = 0
) -> dict[str, np.ndarray]:
    """Split -> sorted indices of the pairs kept: all of a split, or a seeded random max_per_split.

    ID pairs are those `assign_splits` calls "ID", so an OOD pair can never be drawn as ID.
    Each split draws from its own stream of the seed, so the ID draw does not depend on how
    many OOD pairs there are.
    """
    if max_per_split is not None and max_per_split < 1:
        raise ValueError(f"max_per_split must be positive or None, got {max_per_split}")
    labels = np.asarray(labels)
    kept = {}
    for stream, split in enumerate(SPLITS):
        members = np.flatnonzero(labels == split)
        if max_per_split is not None and len(members) > max_per_split:
            rng = np.random.default_rng([seed, stream])
            members = np.sort(rng.choice(members, size=max_per_split, replace=False))
        kept[split] = members
    return kept


# ---------------------------------------------------------------------------------------------
# From a COCO / LVIS source to splits.jsonl
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The annotated (image, category) pairs of a source, and what scoring them needs."""

    image_ids: np.ndarray  # [P] image id of each pair
    category_ids: np.ndarray  # [P] category id of each pair
    image_files: dict[int, pathlib.Path]  # image id -> file, for the images in some pair
    category_names: dict[int, str]  # every category of the dataset, id -> name


def read_pairs(root: str | pathlib.Path) -> Pairs:
    """Every (image, category present in its annotations) pair, ordered by image then category.

    Definition 1's OOD instance has its object present in the image, so a category absent from
    an image is never paired with it (crowd instances count as present)."""
    root = pathlib.Path(root)
    # The builder's reader: the same validation, file names and presence rules as the build.
    categories, _, images = oodbench_source.read_annotations(root / "annotations.json")
    image_ids, category_ids, files = [], [], {}
    for image_id in sorted(images):
        present = images[image_id].annotated()
        if present:
            files[image_id] = oodbench_source.image_path(root / "images", images[image_id])
        image_ids += [image_id] * len(present)
        category_ids += present
    if not image_ids:
        raise ValueError(f"{root / 'annotations.json'}: no annotated image-category pairs")
    return Pairs(
        image_ids=np.array(image_ids, np.int64),
        category_ids=np.array(category_ids, np.int64),
        image_files=files,
        category_names=dict(sorted(categories.items())),
    )


def score_pairs(
    pairs: Pairs,
    scorer,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    batch_size: int = 256,
    progress: bool = True,
    cache_dir: str | pathlib.Path | None = None,
    matching: bool = False,
) -> np.ndarray:
    """float32 [P]: S(x, c) of each pair under one scorer (softmax kinds: `clip_probability`;
    SigLIP: `siglip_probability`); image features cached in `cache_dir` if given (see `foci.encode_image_files`). With `matching`,
    S(x, c) is instead the scorer's image-text matching probability (`match_pairs`)."""
    from ood_jax.mining import foci

    if matching:
        if cache_dir is not None:
            raise ValueError("matching scores are pairwise: there are no image features to cache")
        return match_pairs(pairs, scorer, templates, batch_size, progress)

    if scorer.logit_scale is None:
        raise ValueError(
            f"scorer {getattr(scorer, 'identity', {}).get('path', scorer.kind)}: no logit scale, so no "
            "probability; transformers' BLIP-2 retrieval checkpoints drop BLIP-2's learned "
            "temperature: give it (--logit-scale NAME=1/temperature)"
        )
    category_ids = list(pairs.category_names)
    texts = [category_text(pairs.category_names[c]) for c in category_ids]
    text_features = np.asarray(scorer.encode_texts(texts, templates=tuple(templates)), np.float32)
    image_ids = sorted(pairs.image_files)
    image_features = foci.encode_image_files(
        scorer, [pairs.image_files[i] for i in image_ids], batch_size, progress, cache_dir
    )
    row = {image_id: k for k, image_id in enumerate(image_ids)}
    column = {category_id: k for k, category_id in enumerate(category_ids)}
    image_rows = np.array([row[i] for i in pairs.image_ids.tolist()], np.int32)
    pair_categories = np.array([column[c] for c in pairs.category_ids.tolist()], np.int32)
    if scorer.kind in scorers.SOFTMAX_KINDS:
        return clip_probability(
            image_features, text_features, pair_categories, scorer.logit_scale,
            image_rows=image_rows,
        )  # fmt: skip
    if scorer.kind == "siglip":
        if scorer.logit_bias is None:
            raise ValueError("a SigLIP scorer needs a logit_bias")
        return siglip_probability(
            image_features, text_features, pair_categories, scorer.logit_scale,
            scorer.logit_bias, image_rows=image_rows,
        )  # fmt: skip
    raise ValueError(
        f"unknown scorer kind {scorer.kind!r}; expected one of {', '.join(scorers.KINDS)}"
    )


def match_pairs(
    pairs: Pairs,
    scorer,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    batch_size: int = 256,
    progress: bool = True,
) -> np.ndarray:
    """float32 [P]: each pair's image-text matching probability (BLIP-2's ITM head), averaged
    over the templates. Images are read `batch_size` at a time and each is encoded once for all
    its pairs; the matching head then runs once per pair and template."""
    from tqdm import tqdm

    from ood_jax.mining import foci

    if not getattr(scorer, "has_matching_head", False):
        raise ValueError(f"a {scorer.kind} scorer has no image-text matching head")
    category_ids = list(pairs.category_names)
    names = [category_text(pairs.category_names[c]) for c in category_ids]
    texts = [template.format(name) for template in templates for name in names]
    column = {category_id: k for k, category_id in enumerate(category_ids)}
    pair_categories = np.array([column[c] for c in pairs.category_ids.tolist()], np.int64)
    image_ids = sorted(pairs.image_files)
    # Each pair's image as a position in image_ids; a batch's pairs are then one run of them.
    positions = np.searchsorted(np.asarray(image_ids), pairs.image_ids)
    order = np.argsort(positions, kind="stable")
    bounds = np.searchsorted(
        positions[order], np.arange(0, len(image_ids) + batch_size, batch_size)
    )
    out = np.zeros(len(pair_categories), np.float64)
    with tqdm(total=len(image_ids), desc="matching", unit="image", disable=not progress) as bar:
        for start, lo, hi in zip(range(0, len(image_ids), batch_size), bounds, bounds[1:]):
            batch = image_ids[start : start + batch_size]
            images = foci.ImageFiles([pairs.image_files[i] for i in batch])
            chosen = order[lo:hi]
            rows = positions[chosen] - start
            for t in range(len(templates)):
                text_rows = t * len(names) + pair_categories[chosen]
                out[chosen] += scorer.match_probabilities(
                    images, texts, rows, text_rows, batch_size=batch_size
                )
            bar.update(len(batch))
    return (out / len(templates)).astype(np.float32)


def split_records(
    pairs: Pairs,
    scores: Mapping[str, np.ndarray],
    threshold: float = THRESHOLD,
    max_per_split: int | None = MAX_PER_SPLIT,
    seed: int = 0,
) -> list[dict]:
    """splits.jsonl records: ID, then OOD-S, then OOD-H, each by image id and category id."""
    labels = assign_splits(scores, threshold)
    if len(labels) != len(pairs.image_ids):
        raise ValueError(f"{len(labels)} scores for {len(pairs.image_ids)} pairs")
    records = []
    for split, members in sample_splits(labels, max_per_split, seed).items():
        for i in members.tolist():
            records.append(
                {
                    "image_id": int(pairs.image_ids[i]),
                    "category": pairs.category_names[int(pairs.category_ids[i])],
                    "split": split,
                    "scores": {name: float(values[i]) for name, values in scores.items()},
                }
            )
    return records


# ---------------------------------------------------------------------------------------------
# Ablations: re-divisions by other scorer sets, and how much the divisions agree
# ---------------------------------------------------------------------------------------------

# Compared beyond the three labels: "OOD" is OOD-S and OOD-H together, every pair some scorer put
# below T, the set the paper keeps whole when it re-divides.
OOD_SETS = {"OOD-S": ("OOD-S",), "OOD-H": ("OOD-H",), "OOD": ("OOD-S", "OOD-H")}


def ablation_divisions(
    scorer_names: Sequence[str],
    groups: Mapping[str, Sequence[str]],
    series: Sequence[str] = (),
) -> dict[str, tuple[str, ...]]:
    """Division name -> its scorers: "group-NAME" per group, "series-K" for the first K of
    `series` (K = 1 .. len(series)), the paper's one-to-four scorer ablation in its fixed order."""
    known = set(scorer_names)
    if not groups and not series:
        raise ValueError("give at least one --group or a --series")
    divisions = {}
    for name, members in groups.items():
        divisions[f"group-{name}"] = _members(f"--group {name}", members, known)
    ordered = _members("--series", series, known) if series else ()
    for k in range(1, len(ordered) + 1):
        divisions[f"series-{k}"] = ordered[:k]
    unused = known.difference(*divisions.values())
    if unused:
        raise ValueError(f"--scorer {', '.join(sorted(unused))}: in no --group or --series")
    return divisions


def _members(flag: str, members: Sequence[str], known: set[str]) -> tuple[str, ...]:
    members = tuple(members)
    if not members:
        raise ValueError(f"{flag}: no scorers")
    if len(set(members)) != len(members):
        raise ValueError(f"{flag}: a scorer is repeated in {','.join(members)}")
    missing = [m for m in members if m not in known]
    if missing:
        raise ValueError(f"{flag}: {', '.join(missing)} is not a --scorer NAME")
    return members


def divide(
    scores: Mapping[str, np.ndarray],
    divisions: Mapping[str, Sequence[str]],
    threshold: float = THRESHOLD,
) -> dict[str, np.ndarray]:
    """Division name -> `assign_splits` labels [P] under that division's scorers only."""
    return {
        name: assign_splits({m: scores[m] for m in members}, threshold)
        for name, members in divisions.items()
    }


def _jaccard(a: np.ndarray, b: np.ndarray) -> float | None:
    union = int((a | b).sum())
    # Two empty sets agree trivially; None keeps that apart from a measured 1.0.
    return int((a & b).sum()) / union if union else None


def consistency(labels: Mapping[str, np.ndarray]) -> dict:
    """How far divisions of the same pairs agree: per division the size of each split, and per
    two divisions the fraction of pairs given the same label and, per set of OOD_SETS, the pairs
    in both, in either, and their Jaccard overlap (both / either)."""
    names = list(labels)
    lengths = {n: len(labels[n]) for n in names}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"divisions differ in length: {lengths}")
    members = {n: {s: np.isin(labels[n], splits) for s, splits in OOD_SETS.items()} for n in names}
    sizes = {
        n: {s: int((labels[n] == s).sum()) for s in SPLITS} | {"OOD": int(members[n]["OOD"].sum())}
        for n in names
    }
    comparisons = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            sets = {}
            for s in OOD_SETS:
                x, y = members[a][s], members[b][s]
                sets[s] = {
                    "both": int((x & y).sum()),
                    "either": int((x | y).sum()),
                    "jaccard": _jaccard(x, y),
                }
            agreement = float(np.mean(labels[a] == labels[b])) if lengths[a] else None
            comparisons.append({"a": a, "b": b, "agreement": agreement, "sets": sets})
    return {"pairs": next(iter(lengths.values()), 0), "sizes": sizes, "comparisons": comparisons}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def consistency_markdown(table: Mapping, divisions: Mapping[str, Sequence[str]]) -> str:
    """The consistency table as two markdown tables: split sizes, then agreement per two."""
    lines = [
        f"{table['pairs']} pairs",
        "",
        "| division | scorers | ID | OOD-S | OOD-H | OOD |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, size in table["sizes"].items():
        counts = " | ".join(str(size[s]) for s in (*SPLITS, "OOD"))
        lines.append(f"| {name} | {', '.join(divisions[name])} | {counts} |")
    lines += [
        "",
        "| a | b | same split | Jaccard OOD-S | Jaccard OOD-H | Jaccard OOD |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in table["comparisons"]:
        jaccards = " | ".join(_cell(c["sets"][s]["jaccard"]) for s in OOD_SETS)
        lines.append(f"| {c['a']} | {c['b']} | {_cell(c['agreement'])} | {jaccards} |")
    return "\n".join(lines) + "\n"
