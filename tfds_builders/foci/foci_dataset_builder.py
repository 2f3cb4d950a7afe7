"""FOCI: fine-grained classification as 4-way multiple choice with CLIP-mined negatives.

Every config reads an options file in FOCI's own released format,
`{label: [{"image": path, "options": [truth, neg, neg, neg], "groundtruth": label}, ...]}`,
which is also what `ood_jax.mining.foci` writes. For the five classic datasets the options are
joined with the release's own test split, so an entry whose image is not in the split, or whose
groundtruth disagrees with the release's label, fails the build; test images without options are
counted in the report and not written.

The file lists the truth first; each example's options are shuffled by a permutation drawn from a
SHA-256 of (config seed, image path), so two builds agree and `answer` is uniform over 0..3.

An options file without entries, or a build whose every image is skipped, fails naming it: TFDS
cannot write an empty `test` split. The build record identifies the source by the SHA-256 of the
options file and of the release's test list (`ood_jax.data.foci.RELEASE_TEST_FILES`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import pathlib
import posixpath
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ood_jax.data import building
from ood_jax.data.foci import (
    NUM_OPTIONS,
    OPTIONS_FILE,
    RELEASE_OPTIONS_FILE,
    RELEASE_TEST_FILES,
    RELEASE_TEST_SPLITS,
    TestSplit,
)

NOTE_WITHOUT_OPTIONS = "test images without options (not written)"

# Every order of NUM_OPTIONS items, in itertools' fixed order, indexed by a hash of the example.
_PERMUTATIONS = tuple(itertools.permutations(range(NUM_OPTIONS)))

_CITATION = r"""
@article{geigle2024foci,
  author  = {Gregor Geigle and Radu Timofte and Goran Glava\v{s}},
  title   = {African or European Swallow? Benchmarking Large Vision-Language Models for
             Fine-Grained Object Classification},
  journal = {arXiv},
  year    = {2024},
}
"""


@dataclasses.dataclass(frozen=True)
class Item:
    """One multiple-choice question: image path (relative to SRC), truth, file's options."""

    image: str
    label: str
    options: tuple[str, ...]


def shuffle_options(
    options: tuple[str, ...], label: str, seed: int, image: str
) -> tuple[tuple[str, ...], int]:
    """Options in a fixed pseudo-random order for (seed, image); returns (options, answer)."""
    digest = hashlib.sha256(f"{seed}\0{image}".encode()).digest()
    # 2**64 values over 24 orders: the bias is below 1e-17, so the answer index is uniform.
    order = _PERMUTATIONS[int.from_bytes(digest[:8], "big") % len(_PERMUTATIONS)]
    shuffled = tuple(options[i] for i in order)
    return shuffled, shuffled.index(label)


# ---------------------------------------------------------------------------------------------
# Options files
# ---------------------------------------------------------------------------------------------


def read_options(path: pathlib.Path) -> list[tuple[str, Item]]:
    """(where, item) for every entry of a FOCI-format options file, validated."""
    data = building.load_json(path)
    if not isinstance(data, dict):
        raise building.BuildError(f"{path}: expected an object {{label: [entry, ...]}}")
    entries = []
    for key, group in data.items():
        if not isinstance(group, list):
            raise building.BuildError(f"{path}: label {key!r}: expected a list of entries")
        for index, entry in enumerate(group):
            where = f"{path}: entry {index} of {key!r}"
            building.require(entry, ("image", "options", "groundtruth"), where)
            image, options, truth = entry["image"], entry["options"], entry["groundtruth"]
            if not isinstance(image, str) or not image:
                raise building.BuildError(f"{where}: 'image' must be a non-empty string")
            where = f"{where} (image {image})"
            if truth != key:
                raise building.BuildError(f"{where}: groundtruth {truth!r} differs from its key")
            _check_options(options, key, where)
            entries.append((where, Item(image, key, tuple(options))))
    return entries


def _check_options(options: Any, truth: str, where: str) -> None:
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise building.BuildError(f"{where}: 'options' must be a list of strings")
    if len(options) != NUM_OPTIONS:
        raise building.BuildError(f"{where}: {len(options)} options, expected {NUM_OPTIONS}")
    count = options.count(truth)
    if count == 0:
        raise building.BuildError(f"{where}: options {options} lack the groundtruth {truth!r}")
    if count > 1:
        raise building.BuildError(f"{where}: groundtruth {truth!r} appears {count} times")
    repeated = [o for o, n in collections.Counter(options).items() if n > 1]
    if repeated:
        raise building.BuildError(f"{where}: option {repeated[0]!r} appears more than once")


def _relative(image: str, where: str) -> str:
    """A path relative to SRC, normalized; fails for absolute paths or ones leaving SRC."""
    normalized = posixpath.normpath(image)
    if posixpath.isabs(normalized) or normalized.split("/")[0] == "..":
        raise building.BuildError(f"{where}: image path must be relative to the source directory")
    return normalized


def join_release(
    entries: list[tuple[str, Item]], split: TestSplit, report: building.BuildReport
) -> list[Item]:
    """Options entries checked against the release's test split; uncovered images counted."""
    items = []
    for where, item in entries:
        image = _relative(item.image, where)
        if image not in split.labels:
            raise building.BuildError(f"{where}: image is not in the test split ({split.source})")
        if split.labels[image] != item.label:
            raise building.BuildError(
                f"{where}: groundtruth {item.label!r}, but {split.source} labels it "
                f"{split.labels[image]!r}"
            )
        unknown = [o for o in item.options if o not in split.class_names]
        if unknown:
            raise building.BuildError(
                f"{where}: option {unknown[0]!r} is not a class of the release"
            )
        items.append(dataclasses.replace(item, image=image))
    covered = {item.image for item in items}
    report.notes[NOTE_WITHOUT_OPTIONS] += sum(image not in covered for image in split.labels)
    return items


def imagenet21k_items(entries: list[tuple[str, Item]]) -> list[Item]:
    # FOCI's released files hold absolute paths from the authors' machine; the last two parts
    # (<wnid>/<file>) are what identifies the image, so they are looked up under SRC/images/.
    items = []
    for where, item in entries:
        parts = [p for p in item.image.replace("\\", "/").split("/") if p not in ("", ".")]
        if len(parts) < 2 or ".." in parts[-2:]:
            raise building.BuildError(f"{where}: expected an image path ending in <wnid>/<file>")
        items.append(dataclasses.replace(item, image=f"images/{parts[-2]}/{parts[-1]}"))
    return items


def custom_items(entries: list[tuple[str, Item]]) -> list[Item]:
    return [
        dataclasses.replace(item, image=_relative(item.image, where)) for where, item in entries
    ]


def _check_unique(items: list[Item], path: pathlib.Path) -> None:
    seen: set[str] = set()
    for item in items:
        if item.image in seen:
            raise building.BuildError(f"{path}: image {item.image} has more than one entry")
        seen.add(item.image)


# ---------------------------------------------------------------------------------------------
# Builder
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class FociConfig(tfds.core.BuilderConfig):
    """A FOCI subset: the options file it reads and the seed of its option shuffle."""

    options_file: str = RELEASE_OPTIONS_FILE
    seed: int = 0


def _release_config(name: str, reads: str, example: str) -> FociConfig:
    return FociConfig(
        name=name,
        description=(
            f"{reads} Options: SRC/{RELEASE_OPTIONS_FILE}, FOCI's released "
            f"data/{name}-ViT-L-14-laion2b_s32b_b82k-4.json (or a file our miner wrote), image "
            f"paths relative to SRC as in {example}."
        ),
    )


def _imagenet21k_config(domain: str) -> FociConfig:
    return FociConfig(
        name=f"imagenet21k_{domain}",
        description=(
            f"IN-{domain.title()} (ImageNet-21k classes of the WordNet {domain} lexicographer "
            f"file). Reads SRC/{OPTIONS_FILE} (FOCI format; FOCI released "
            f"data/imagenet-6k-{domain}-ViT-L-14-laion2b_s32b_b82k-4.json) and images "
            "SRC/images/<wnid>/<file>. An entry's image is found by the last two parts of its "
            "path, so the released files, which hold absolute paths from the authors' machine, "
            "work unchanged; image/filename is images/<wnid>/<file>."
        ),
        options_file=OPTIONS_FILE,
    )


_CONFIGS = [
    _release_config(
        "food101",
        "Food-101 test split: SRC/meta/test.json ({class: ['class/image', ...]}; the label is "
        "the class with '_' -> ' '), images SRC/images/<entry>.jpg.",
        "'images/<class>/<image>.jpg'",
    ),
    _release_config(
        "flowers102",
        "Oxford Flowers-102 test split: SRC/setid.mat ('tstid'), SRC/imagelabels.mat ('labels', "
        "1-based, named by the CLIP-style list of 102 flower names), images "
        "SRC/jpg/image_%05d.jpg.",
        "'jpg/image_06734.jpg'",
    ),
    _release_config(
        "fgvc_aircraft",
        "FGVC-Aircraft 2013b test split, variant level: SRC/data/images_variant_test.txt "
        "('<image id> <variant>' lines), images SRC/data/images/<id>.jpg.",
        "'data/images/<id>.jpg'",
    ),
    _release_config(
        "stanford_cars",
        "Stanford Cars test split: SRC/cars_test_annos_withlabels.mat (struct array "
        "'annotations' with bbox_x1..bbox_y2, class (1-based), fname), SRC/devkit/cars_meta.mat "
        "('class_names'), images SRC/cars_test/<fname>.",
        "'cars_test/00001.jpg'",
    ),
    _release_config(
        "oxford_pet",
        "Oxford-IIIT Pet test split: SRC/annotations/test.txt ('<image> <class id> <species> "
        "<breed id>' lines), images SRC/images/<image>.jpg. The label is the image name without "
        "its trailing _<number>, split at '_' and title-cased ('american_pit_bull_terrier_12' "
        "-> 'American Pit Bull Terrier'), as torchvision and FOCI's loader name the breeds.",
        "'images/Abyssinian_201.jpg'",
    ),
    *(_imagenet21k_config(domain) for domain in ("animal", "plant", "food", "artifact")),
    FociConfig(
        name="custom",
        description=f"Any image set: SRC/{OPTIONS_FILE} (FOCI format), image paths relative to SRC.",
        options_file=OPTIONS_FILE,
    ),
]


class Builder(building.SourceBuilder, tfds.core.GeneratorBasedBuilder):
    """FOCI multiple-choice questions from a dataset's release plus an options file."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[FociConfig]] = _CONFIGS
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Pass the directory holding the release and its options file with --source; each "
        "config's description lists the files it reads."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(encoding_format="jpeg"),
                    "image/filename": tfds.features.Text(doc="Path relative to the source."),
                    "label": tfds.features.Text(),
                    "options": tfds.features.Sequence(tfds.features.Text(), length=NUM_OPTIONS),
                    "answer": tfds.features.Scalar(np.int64, doc="Index of label in options."),
                    "dataset": tfds.features.Text(doc="The config name."),
                }
            ),
            homepage="https://github.com/gregor-ge/FOCI-Benchmark",
            citation=_CITATION,
        )

    def source_files(self, src: pathlib.Path) -> list[pathlib.Path]:
        config = self.builder_config
        release = RELEASE_TEST_FILES.get(config.name, ())
        return [src / config.options_file, *(src / name for name in release)]

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
        src = self.source_dir(dl_manager)
        config = self.builder_config
        options_path = src / config.options_file
        entries = read_options(options_path)
        if not entries:
            raise building.BuildError(
                f"{options_path}: no entries, so split test would be empty; the file should "
                "map each label to its questions"
            )
        if config.name in RELEASE_TEST_SPLITS:
            items = join_release(entries, RELEASE_TEST_SPLITS[config.name](src), self.report)
        elif config.name.startswith("imagenet21k_"):
            items = imagenet21k_items(entries)
        else:
            items = custom_items(entries)
        _check_unique(items, options_path)
        self.start_progress(len(items), "images")
        return {"test": self._generate_examples(src, items)}

    def _generate_examples(
        self, src: pathlib.Path, items: list[Item]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        config = self.builder_config
        written = 0
        for item in self.track(items):
            image = building.read_image_or_skip(src / item.image, self.on_error, self.report)
            if image is None:
                continue
            written += 1
            options, answer = shuffle_options(item.options, item.label, config.seed, item.image)
            yield (
                item.image,
                {
                    "image": image.jpeg,
                    "image/filename": item.image,
                    "label": item.label,
                    "options": list(options),
                    "answer": answer,
                    "dataset": config.name,
                },
            )
        if not written:
            raise building.no_examples("test", len(items))
