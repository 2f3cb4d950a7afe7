"""COUNTS' label space, its 14 domains, and O(OD)^2 split expressions.

Every detection dataset here (COUNTS and the synthetic stand-in) has one split per
(source split, domain), named `{split}_{domain}`, so a protocol that trains on some domains and
tests on others is a TFDS split expression such as "train_dim+train_snow".
"""

from __future__ import annotations

from typing import Sequence

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


def split_name(split: str, domain: str) -> str:
    return f"{split}_{domain}"


def split_expression(split: str, domains: Sequence[str]) -> str:
    """TFDS split expression for the union of `split` over `domains`."""
    if split not in SOURCE_SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SOURCE_SPLITS}")
    if not domains:
        raise ValueError("no domains given")
    return "+".join(split_name(split, canonical_domain(d)) for d in domains)


def held_out_split_expressions(
    targets: Sequence[str] = PAPER_TARGET_DOMAINS,
    train_split: str = "train",
    test_split: str = "test",
) -> dict[str, str]:
    """O(OD)^2: train on every domain except `targets`; test in-domain and on each target.

    Returns {"train": ..., "iid": <test split of the training domains>, <target>: ...}.
    """
    targets = [canonical_domain(t) for t in targets]
    sources = [d for d in DOMAINS if d not in targets]
    if not sources:
        raise ValueError("every domain is a target; nothing is left to train on")
    expressions = {
        "train": split_expression(train_split, sources),
        "iid": split_expression(test_split, sources),
    }
    expressions.update({t: split_expression(test_split, [t]) for t in targets})
    return expressions


def detection_features(class_names: Sequence[str]):
    """The TFDS features shared by COUNTS and synthetic_shifts."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict(
        {
            "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
            "image/id": tf.int64,
            "image/filename": tfds.features.Text(),
            "domain": tfds.features.ClassLabel(names=DOMAINS),
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
