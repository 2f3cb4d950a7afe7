"""corrupted: a prepared dataset's images under the ImageNet-C corruptions, as COCO-C does.

Michaelis et al. (2019) measure a detector's robustness by its AP on COCO's images under
Hendrycks & Dietterich's 15 corruptions at 5 severities (`imagecorruptions`); this builder
writes those images as a dataset of their own, from any dataset prepared here (COUNTS,
synthetic_shifts, FOCI, OODBench), read from its directory with TFDS alone.

    ood-jax build corrupted --dataset synthetic_shifts/tiny --data-dir D \\
        --corruptions gaussian_noise,fog --severities 1,3 [--splits test_sky,test_dim]

What is written (`ood_jax.data.corrupted` names it): config `{dataset}-{digest of the
request}`; per source split, `{split}__clean` (the source's records as they are) and one split
per corruption and severity, `{split}__{corruption}_{severity}`. The features are the
source's, so a reader (the input pipeline, the evaluators) reads them as it reads the source;
every feature but `image` is copied as read, and the image is the source's decoded as the input
pipeline decodes it (`tf.io.decode_image`, 3 channels), corrupted (`corruptions.corrupt`) and
stored as JPEG at quality 95, the quality the builders re-encode other formats at. Boxes and
labels are unchanged: the corruptions keep the image's size and move no object.

Seeds: an image's corruption is seeded from the SHA-256 of its stored bytes, the corruption
and the severity (`corruptions.seed_of`), so a rebuild is byte-identical, the same image is
corrupted alike in every record and split that holds it (an OODBench image in each of its
questions), and any two different images draw differently.

The build record names the source's directory and holds the digests of its metadata files
(dataset_info.json, features.json, and its own build record), with the request as settings: a
rebuild after the source was rebuilt or changed is refused unless --overwrite. A split's
records are read and written in blocks of `BLOCK` images (the items of a Beam build).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import pathlib
from typing import ClassVar

import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax.data import builders, building, corrupted, corruptions

JPEG_QUALITY = 95
BLOCK = 64
IMAGE = "image"
# The source's files that identify its build (its records are too large to hash).
_IDENTITY_FILES = ("dataset_info.json", "features.json", building.RECORD_FILE)


@dataclasses.dataclass(eq=False, repr=False)
class CorruptedConfig(tfds.core.BuilderConfig):
    """A `corrupted.Request` and where its source is; a config named by `config_named` (for
    reading a built dataset) has no request: everything is read from its directory."""

    dataset: str = ""
    source_dir: str = ""
    corruptions: tuple[str, ...] = ()
    severities: tuple[int, ...] = ()
    splits: tuple[str, ...] = ()

    def request(self) -> corrupted.Request:
        return corrupted.Request(self.dataset, self.corruptions, self.severities, self.splits)

    def __repr__(self) -> str:
        # TFDS logs a config it has not registered (every one of ours) by its repr.
        return f"CorruptedConfig({self.name!r})"


@functools.cache
def _source(source_dir: str) -> tfds.core.DatasetBuilder:
    return tfds.builder_from_directory(source_dir)


def _check_image_feature(source: tfds.core.DatasetBuilder, dataset: str) -> None:
    feature = source.info.features[IMAGE] if IMAGE in source.info.features else None
    if not isinstance(feature, tfds.features.Image) or feature.shape[-1] != 3:
        raise building.BuildError(
            f"--dataset {dataset}: no 3-channel '{IMAGE}' feature to corrupt (its features: "
            f"{', '.join(source.info.features)})"
        )


class Builder(builders.ReportingBuilder, tfds.core.GeneratorBasedBuilder):
    """A prepared dataset under ImageNet-C corruptions: `{split}__{corruption}_{severity}`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Initial release: imagecorruptions 1.1.2, seeded per image, JPEG quality 95.",
    }
    BUILDER_CONFIGS: ClassVar[list[CorruptedConfig]] = []

    @staticmethod
    def request_config(request: corrupted.Request, source_dir: str) -> CorruptedConfig:
        """The config that builds `request` from the prepared dataset in `source_dir`
        (DATA_DIR/NAME/CONFIG/VERSION)."""
        return CorruptedConfig(
            name=request.config_name(),
            description=f"{request.dataset} under corruptions: {json.dumps(request.settings())}",
            dataset=request.dataset,
            source_dir=os.fspath(source_dir),
            corruptions=request.corruptions,
            severities=request.severities,
            splits=request.splits,
        )

    @staticmethod
    def config_named(name: str) -> CorruptedConfig:
        """The config that reads back the dataset built as config `name`."""
        return CorruptedConfig(name=name)

    def source_path(self, source: str | None) -> str:
        del source  # The source is the prepared dataset the request names.
        return self.builder_config.source_dir

    def origin(self, source: str | None) -> building.Origin:
        src = pathlib.Path(self.source_path(source))
        files = {
            name: building.file_digest(src / name)
            for name in _IDENTITY_FILES
            if (src / name).exists()
        }
        settings = {
            **self.builder_config.request().settings(),
            "imagecorruptions": corruptions.PACKAGE_VERSION,
            "jpeg_quality": JPEG_QUALITY,
        }
        settings = json.loads(json.dumps(settings, sort_keys=True))
        digest = building.combined_digest({**files, "settings": json.dumps(settings)})
        return building.Origin(str(src), files, settings, digest)

    def _info(self) -> tfds.core.DatasetInfo:
        config = self.builder_config
        if config.source_dir:
            features = _source(config.source_dir).info.features
        elif (self.data_path / "features.json").exists():
            # Read back by name: the features are those written with the records.
            features = tfds.features.FeatureConnector.from_config(os.fspath(self.data_path))
        else:
            features = None  # not built; ood_jax.datasets says how to build it
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "A prepared dataset's images under the 15 ImageNet-C corruptions "
                "(imagecorruptions, as COCO-C): split `{split}__{corruption}_{severity}`, and "
                f"`{{split}}__clean` the source's own. {config.description or ''}"
            ),
            features=features,
        )

    def _split_generators(self, dl_manager) -> dict:
        del dl_manager  # The source is read from its directory.
        config = self.builder_config
        source = _source(config.source_dir)
        _check_image_feature(source, config.dataset)
        sizes = {split: source.info.splits[split].num_examples for split in config.splits}
        blocks = {
            split: [(start, min(start + BLOCK, size)) for start in range(0, size, BLOCK)]
            for split, size in sizes.items()
        }
        variants = [(None, None)] + [
            (name, severity) for name in config.corruptions for severity in config.severities
        ]
        self.start_progress(len(variants) * sum(map(len, blocks.values())), "blocks")
        splits = {}
        for split in config.splits:
            for name, severity in variants:
                example_fn = functools.partial(
                    block_examples,
                    source_dir=config.source_dir,
                    split=split,
                    corruption=name,
                    severity=severity,
                )
                out = corrupted.split_name(split, name, severity)
                splits[out] = self._generate_examples(out, blocks[split], example_fn)
        return splits


def block_examples(
    block: tuple[int, int],
    report: building.BuildReport,
    *,
    source_dir: str,
    split: str,
    corruption: str | None,
    severity: int | None,
) -> list[tuple[int, dict]]:
    """Records [start, stop) of a source split, their images corrupted unless `corruption` is
    None, keyed by their index in the split (`building.ExampleFn`)."""
    del report  # Nothing is skipped, dropped or clipped: records are copied.
    start, stop = block
    source = _source(source_dir)
    records = source.as_dataset(
        split=f"{split}[{start}:{stop}]",
        decoders={IMAGE: tfds.decode.SkipDecoding()},
        shuffle_files=False,
    )
    examples = []
    for index, record in enumerate(tfds.as_numpy(records), start):
        if corruption is not None:
            record[IMAGE] = corrupted_jpeg(
                record[IMAGE], corruption, severity, where=f"{split}[{index}]"
            )
        examples.append((index, record))
    return examples


def corrupted_jpeg(encoded: bytes, corruption: str, severity: int, where: str) -> bytes:
    """An encoded image, decoded as the input pipeline decodes it, corrupted and re-encoded."""
    pixels = tf.io.decode_image(encoded, channels=3, expand_animations=False).numpy()
    seed = corruptions.seed_of(hashlib.sha256(encoded).hexdigest(), corruption, severity)
    try:
        out = corruptions.corrupt(pixels, corruption, severity, seed)
    except ValueError as e:
        raise building.BuildError(f"record {where}: {e}") from None
    buffer = io.BytesIO()
    Image.fromarray(out).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()
