"""COUNTS' label space, its 14 domains, and O(OD)^2 split expressions.

Every detection dataset here (COUNTS and the synthetic stand-in) stores each image once, in the
split of its source split and its domains: `{split}_{domain}`, or `{split}_{d1}_{d2}...` (DOMAINS
order) for an image of several. O(OD)^2 is defined on images, so its training, in-domain and
per-target sets are unions of whole splits: TFDS split expressions such as
"train_dim+train_snow" (`held_out_split_expressions`; docs/guide/datasets.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

# Table 7 of the COUNTS paper, in its order.
CATEGORIES = (
    "person", "sculpture", "building", "bicycle", "wheel", "car", "train", "glasses", "truck",
    "football", "dress", "dog", "drum", "guitar", "motorcycle", "sunglasses", "suit", "boat",
    "bird", "flowerpot", "houseplant", "horse", "poster", "goggles", "food", "trousers", "chair",
    "shorts", "wineglass", "bicyclehelmet", "umbrella", "sunhat", "helmet", "drink", "handbag",
)  # fmt: skip

DOMAINS = (
    "dim", "painting", "snow", "sand", "handmade", "street", "road", "water", "grass", "indoor",
    "mountain", "sky", "tree", "occlusion",
)  # fmt: skip

# Spellings found in the release that name one of DOMAINS.
DOMAIN_ALIASES = {"handmake": "handmade"}

# The held-out target domains of the paper's O(OD)^2 experiments.
PAPER_TARGET_DOMAINS = ("sky", "occlusion", "grass", "water", "dim", "handmade")

SOURCE_SPLITS = ("train", "val", "test")


def canonical_domain(name: str) -> str:
    """The domain a release's spelling names; ValueError naming it if unknown."""
    domain = DOMAIN_ALIASES.get(name.lower(), name.lower())
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; expected one of {', '.join(DOMAINS)}")
    return domain


def split_name(split: str, domains: str | Sequence[str]) -> str:
    """The split holding the images of `split` whose domains are exactly `domains`."""
    domains = [domains] if isinstance(domains, str) else domains
    return "_".join((split, *ordered_domains(domains)))


def ordered_domains(domains: Iterable[str]) -> tuple[str, ...]:
    """Domains, canonical, without repeats, in DOMAINS order; ValueError if none."""
    canonical = {canonical_domain(d) for d in domains}
    if not canonical:
        raise ValueError("no domains given")
    return tuple(d for d in DOMAINS if d in canonical)


def parse_split_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(source split, domains) of a split `split_name` made; None for any other name."""
    split, *domains = name.split("_")
    if split not in SOURCE_SPLITS or not domains or any(d not in DOMAINS for d in domains):
        return None
    return (split, tuple(domains)) if split_name(split, domains) == name else None


def _union(
    split: str, available: Iterable[str], keep: Callable[[frozenset[str]], bool], what: str
) -> str:
    if split not in SOURCE_SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SOURCE_SPLITS}")
    available = sorted(available)
    chosen = {}
    for name in available:
        found = parse_split_name(name)
        if found and found[0] == split and keep(frozenset(found[1])):
            chosen[name] = [DOMAINS.index(d) for d in found[1]]
    if not chosen:
        raise ValueError(f"no {split} image {what} (splits: {', '.join(available)})")
    return "+".join(sorted(chosen, key=chosen.get))


def images_with(split: str, domains: Sequence[str], available: Iterable[str]) -> str:
    """Split expression of every `split` image that carries at least one of `domains`."""
    wanted = set(ordered_domains(domains))
    return _union(
        split, available, lambda have: bool(have & wanted), f"carries {', '.join(sorted(wanted))}"
    )


def images_within(split: str, domains: Sequence[str], available: Iterable[str]) -> str:
    """Split expression of every `split` image all of whose domains are among `domains`."""
    allowed = set(ordered_domains(domains))
    return _union(
        split, available, lambda have: have <= allowed, f"lies in {', '.join(sorted(allowed))} only"
    )


def held_out_split_expressions(
    available: Iterable[str],
    targets: Sequence[str] = PAPER_TARGET_DOMAINS,
    train_split: str = "train",
    test_split: str = "test",
) -> dict[str, str]:
    """O(OD)^2 over a build's splits `available`: train on every training image none of whose
    domains is a target; test in-domain on every test image none of whose domains is a target,
    and on each target t on every test image that carries t. Each is a union of whole splits, so
    no image is read twice in an epoch.

    Returns {"train": ..., "iid": ..., <target>: ...}.
    """
    targets = ordered_domains(targets)
    sources = [d for d in DOMAINS if d not in targets]
    if not sources:
        raise ValueError("every domain is a target; nothing is left to train on")
    available = list(available)
    expressions = {
        "train": images_within(train_split, sources, available),
        "iid": images_within(test_split, sources, available),
    }
    expressions.update({t: images_with(test_split, [t], available) for t in targets})
    return expressions


def hold_out_windows(
    expression: str, sizes: Mapping[str, int], fraction: float, seed: int
) -> tuple[str, str]:
    """(kept, held out): the "+" union of whole splits `expression` without, and as, a window of
    round(fraction * n) consecutive records of each of its splits (n records, `sizes[name]`),
    the window's start drawn from (seed, split name). Either side is "" when it holds nothing.

    Both sides are again split expressions (e.g. "train_dim[:3]+train_dim[5:]" and
    "train_dim[3:5]"), disjoint and together the whole union. TFDS writes a split's records in an
    order shuffled by key, so a window is a random sample of the split's images, and a pure
    function of the seed and the build.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"a held-out fraction must be in [0, 1), got {fraction}")
    kept, held = [], []
    for name in expression.split("+"):
        n = sizes[name]
        size = round(fraction * n)
        if not size:
            kept.append(name)
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        start = int(rng.integers(0, n - size + 1))
        held.append(f"{name}[{start}:{start + size}]")
        if start > 0:
            kept.append(f"{name}[:{start}]")
        if start + size < n:
            kept.append(f"{name}[{start + size}:]")
    return "+".join(kept), "+".join(held)


def detection_features(class_names: Sequence[str], several_domains: bool = False):
    """The TFDS features shared by COUNTS and synthetic_shifts. `domain` is an image's first
    domain; with `several_domains` (COUNTS), `domains` lists all of them in DOMAINS order."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict(
        {
            "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
            "image/id": tf.int64,
            "image/filename": tfds.features.Text(),
            "domain": tfds.features.ClassLabel(names=DOMAINS),
            **(
                {"domains": tfds.features.Sequence(tfds.features.ClassLabel(names=DOMAINS))}
                if several_domains
                else {}
            ),
            "objects": tfds.features.Sequence(
                {
                    "bbox": tfds.features.BBoxFeature(),
                    "label": tfds.features.ClassLabel(names=list(class_names)),
                    "area": tf.float32,
                    "is_crowd": tf.bool,
                    "id": tf.int64,
                }
            ),
        }
    )
