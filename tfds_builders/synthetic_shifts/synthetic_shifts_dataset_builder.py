"""synthetic_shifts: a small, fully synthetic stand-in for COUNTS, rendered procedurally.

Nothing is read: `ood_jax.data.synthetic_render` draws 8 classes of textured shapes in COUNTS'
14 domains (appearance shifts of background, objects or the whole image), so detection code
can be trained and tested on CPU without the real release. The images are synthetic; they are
not COUNTS images and do not claim to look like them.

Records have COUNTS' features (`counts.detection_features`) with the synthetic class names, and
the splits `train_{domain}` and `test_{domain}` for all 14 domains, so the same split
expressions (`counts.held_out_split_expressions`) select held-out domains. Configs:

- `tiny`: 8 train + 4 test images per domain, 96-128 px (for tests).
- `demo`: 160 train + 40 test images per domain, 128-160 px (2,800 images).

A config's output is a pure function of its seed: split `s` renders with seed `2 * seed + s`
(train 0, test 1), so train and test never share an image. The build record holds the config's
settings (`SyntheticConfig`'s fields): a rebuild whose config renders otherwise is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax.data import builders, building, counts, synthetic_render

SPLITS = ("train", "test")
JPEG_QUALITY = 90
# Annotation ids pack (split, domain, example index, object index) into disjoint bit fields.
_OBJECT_BITS = 4
_INDEX_BITS = 31
_DOMAIN_BITS = 4


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
    """How many images of which size to render per domain, and from which seed."""

    train_per_domain: int = 8
    test_per_domain: int = 4
    size_range: tuple[int, int] = (96, 128)
    seed: int = 0


# The fields a config adds to TFDS's BuilderConfig: what its images are rendered from.
_SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(SyntheticConfig)
    if f.name not in {g.name for g in dataclasses.fields(tfds.core.BuilderConfig)}
)


def _object_ids(split_index: int, domain_index: int, index: int, count: int) -> np.ndarray:
    if count > 1 << _OBJECT_BITS:
        raise ValueError(f"at most {1 << _OBJECT_BITS} objects per image, got {count}")
    image = ((split_index << _DOMAIN_BITS | domain_index) << _INDEX_BITS) | index
    return (image << _OBJECT_BITS) + np.arange(count, dtype=np.int64)


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


class Builder(builders.ReportingBuilder, tfds.core.GeneratorBasedBuilder):
    """Synthetic shapes in COUNTS' 14 domains: splits `train_{domain}`, `test_{domain}`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Initial release: synthetic_render images, configs tiny and demo.",
    }
    BUILDER_CONFIGS: ClassVar[list[SyntheticConfig]] = [
        SyntheticConfig(
            name="tiny",
            description="Synthetic, for tests: 8 train + 4 test images per domain, 96-128 px.",
            train_per_domain=8,
            test_per_domain=4,
            size_range=(96, 128),
            seed=0,
        ),
        SyntheticConfig(
            name="demo",
            description="Synthetic: 160 train + 40 test images per domain, 128-160 px.",
            train_per_domain=160,
            test_per_domain=40,
            size_range=(128, 160),
            seed=1,
        ),
    ]

    def origin(self, source: str | None) -> building.Origin:
        del source  # Nothing is read.
        config = self.builder_config
        return building.Origin.of_settings(
            {"config": config.name, **{name: getattr(config, name) for name in _SETTINGS}}
        )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Synthetic stand-in for COUNTS, rendered procedurally (not real images): "
                f"{len(synthetic_render.CLASS_NAMES)} classes of textured shapes in COUNTS' "
                "14 domains. Split `{split}_{domain}` holds one domain of the train or test split."
            ),
            features=counts.detection_features(synthetic_render.CLASS_NAMES),
        )

    def _split_generators(self, dl_manager) -> dict:
        del dl_manager  # Nothing is downloaded or read.
        config = self.builder_config
        sizes = {"train": config.train_per_domain, "test": config.test_per_domain}
        self.start_progress(sum(sizes.values()) * len(counts.DOMAINS), "images")
        splits = {}
        for split in SPLITS:
            for domain in counts.DOMAINS:
                name = counts.split_name(split, domain)
                example_fn = functools.partial(
                    rendered_example,
                    split=split,
                    domain=domain,
                    seed=config.seed,
                    size_range=tuple(config.size_range),
                )
                splits[name] = self._generate_examples(name, range(sizes[split]), example_fn)
        return splits


def rendered_example(
    index: int,
    report: building.BuildReport,
    *,
    split: str,
    domain: str,
    seed: int,
    size_range: tuple[int, int],
) -> list[tuple[int, dict]]:
    """Example `index` of a split's domain, rendered on its own (`building.ExampleFn`)."""
    split_index, domain_index = SPLITS.index(split), counts.DOMAINS.index(domain)
    example = synthetic_render.split_example(2 * seed + split_index, domain, index, size_range)
    height, width = example["image"].shape[:2]
    bbox, kept = building.clean_boxes(example["boxes"], height, width, report)
    ids = _object_ids(split_index, domain_index, index, len(kept))
    record = {
        "image": _jpeg(example["image"]),
        "image/id": int(example["image/id"]),
        "image/filename": f"synthetic/{split}/{domain}/{index}.jpg",
        "domain": domain,
        "objects": {
            "bbox": bbox,
            "label": example["labels"][kept].astype(np.int64),
            "area": example["area"][kept].astype(np.float32),
            "is_crowd": example["is_crowd"][kept].astype(bool),
            "id": ids[kept],
        },
    }
    return [(int(example["image/id"]), record)]
