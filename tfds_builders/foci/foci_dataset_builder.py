"""FOCI: fine-grained classification as 4-way multiple choice with CLIP-mined negatives.

Every config reads an options file in FOCI's own released format,
`{label: [{"image": path, "options": [truth, neg, neg, neg], "groundtruth": label}, ...]}`,
which is also what `ood_jax.mining.foci` writes, under any one of the names `options_files`
gives (FOCI's released name, what our miner writes, options.json). For the five classic
datasets and the sets of FOCI's appendix D (ImageNet-1k, -A, -R, -Sketch, GeoDE) the options
are joined with the release's own test split, so an entry whose image is not in the split, or
whose groundtruth disagrees with the release's label, fails the build; test images without
options are counted in the report and not written. Besides `test`, ImageNet-1k writes FOCI's
Table 3 halves and GeoDE one split per region (Table 7), each repeating test's examples.

A custom set is built under a name of its own (`custom_config`), which becomes its config name
and each record's `dataset`, so several live side by side in one data dir.

The file lists the truth first; each example's options are shuffled by a permutation drawn from a
SHA-256 of (config seed, image path), so two builds agree and `answer` is uniform over 0..3.

An options file without entries, or a build whose every image is skipped, fails naming it: TFDS
cannot write an empty split. The build record identifies the source by the SHA-256 of the
options file and of the release's test list (`ood_jax.data.foci.release_files`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import pathlib
import posixpath
import re
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ood_jax.data import builders, building
from ood_jax.data.foci import (
    IMAGENET_CLASS_NAMES_FILE,
    IMAGENET_FOLDERS,
    IMAGENET_HALVES,
    IMAGENET_VAL_SOLUTION,
    NUM_OPTIONS,
    OPTIONS_FILE,
    RELEASE_OPTIONS_FILE,
    RELEASE_TEST_SPLITS,
    TestSplit,
    region_split,
    release_files,
    released_options_file,
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
        image = split.aliases.get(image, image)
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


# Where ImageNet-21k's <wnid>/<file> images may sit under SRC: our layout, or the processed
# release's own train and val folders (FOCI does not say which it drew from, so both).
IMAGENET21K_FOLDERS = ("images", "imagenet21k_train", "imagenet21k_val")


def imagenet21k_items(entries: list[tuple[str, Item]], src: pathlib.Path) -> list[Item]:
    # FOCI's released files hold absolute paths from the authors' machine; the last two parts
    # (<wnid>/<file>) are what identifies the image, so they are looked up under SRC's folders.
    folders = [name for name in IMAGENET21K_FOLDERS if (src / name).is_dir()] or ["images"]
    items = []
    for where, item in entries:
        parts = [p for p in item.image.replace("\\", "/").split("/") if p not in ("", ".")]
        if len(parts) < 2 or ".." in parts[-2:]:
            raise building.BuildError(f"{where}: expected an image path ending in <wnid>/<file>")
        candidates = [f"{folder}/{parts[-2]}/{parts[-1]}" for folder in folders]
        # An image in none of them is reported missing under the first folder there is.
        found = next((c for c in candidates if (src / c).is_file()), candidates[0])
        items.append(dataclasses.replace(item, image=found))
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
    """A FOCI subset: how its images are found (`layout`: release, imagenet21k or custom) and
    the seed of its option shuffle."""

    layout: str = "release"
    seed: int = 0


def options_files(config: FociConfig) -> tuple[str, ...]:
    """The names in SRC the options may have; a build reads the one there is. FOCI's released
    file under its released name, what `ood-jax mine foci` writes, and options.json."""
    released = released_options_file(config.name) if config.layout != CUSTOM else None
    mined = (RELEASE_OPTIONS_FILE,) if config.layout == "release" else ()
    return (*((released,) if released else ()), *mined, OPTIONS_FILE)


def _options_note(name: str, layout: str = "release") -> str:
    names = options_files(FociConfig(name=name, layout=layout))
    return (
        f"Options (FOCI format, image paths relative to the set's root): one of "
        f"{', '.join(f'SRC/{n}' for n in names)}; FOCI released the first as data/{names[0]}, "
        f"and `ood-jax mine foci --dataset {name} --source SRC --scorer CLIP_DIR` writes "
        f"SRC/{names[-2] if layout == 'release' else names[-1]}."
    )


def _release_config(name: str, reads: str, example: str) -> FociConfig:
    return FociConfig(
        name=name,
        description=f"{reads} {_options_note(name)} Image paths as in {example}.",
    )


_IMAGENET_NAMES = (
    "Class names: the wording FOCI uses, OpenAI CLIP's list (FOCI's loaders.py "
    "openai_en_classes, open_clip's IMAGENET_CLASSNAMES), shipped with ood-jax, each class "
    "asked about named by the options' groundtruth; or, to name them otherwise, "
    f"SRC/{IMAGENET_CLASS_NAMES_FILE}: 1000 distinct names one per line in class-index order "
    "(the WordNet ids' order in TFDS's imagenet2012 labels.txt, tench first)."
)


def _imagenet_config(name: str, reads: str) -> FociConfig:
    return FociConfig(
        name=name,
        description=(
            f"{reads} {_IMAGENET_NAMES} {_options_note(name)} An entry's image "
            "<wnid>/<file> is found under the set's folder; image/filename is its path "
            "relative to SRC."
        ),
    )


def _imagenet21k_config(domain: str) -> FociConfig:
    name = f"imagenet21k_{domain}"
    return FociConfig(
        name=name,
        description=(
            f"IN-{domain.title()} (ImageNet-21k classes of the WordNet {domain} lexicographer "
            "file). Images SRC/images/<wnid>/<file>, or the processed release's own "
            "SRC/imagenet21k_train/<wnid>/ and SRC/imagenet21k_val/<wnid>/ (both are read). "
            f"{_options_note(name, 'imagenet21k')} An entry's image is found by the last two "
            "parts of its path, so the released files, which hold absolute paths from the "
            "authors' machine, work unchanged; image/filename is <folder>/<wnid>/<file>, the "
            "folder it was found in."
        ),
        layout="imagenet21k",
    )


CUSTOM = "custom"
_CUSTOM_DESCRIPTION = (
    f"Any image set: SRC/{OPTIONS_FILE} (FOCI format), image paths relative to SRC. Build one "
    "under its own name with --config custom --name NAME (DATA_DIR/foci/NAME/1.0.0, and NAME "
    "is each record's `dataset`), so several live side by side in one data dir."
)


def _custom(name: str) -> FociConfig:
    return FociConfig(name=name, description=_CUSTOM_DESCRIPTION, layout=CUSTOM)


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
        "('class_names'), images SRC/cars_test/<fname>: the files torchvision's StanfordCars "
        "reads (under its stanford_cars/ folder) and FOCI's DATA.md points to (pytorch/vision "
        "issue 7545), as the original site is offline. The popular Kaggle mirror has "
        "cars_test/ and devkit/ but its devkit/cars_test_annos.mat lacks the test labels "
        "('class'): cars_test_annos_withlabels.mat must come from elsewhere.",
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
    # FOCI's appendix D (Tables 3, 6 and 7).
    _imagenet_config(
        "imagenet_1k",
        "ImageNet-1k validation split (FOCI's IN-1k, Table 6): images SRC/val/<wnid>/*.JPEG, or "
        f"flat SRC/val/<ImageId>.JPEG labelled by SRC/{IMAGENET_VAL_SOLUTION} (Kaggle's "
        "layout; its first WordNet id per row). Splits: test (every image), and FOCI's Table 3 "
        f"halves {IMAGENET_HALVES[0]} (classes 0, 2, 4, ... of the class-index order, the "
        f"classes FOCI trained on) and {IMAGENET_HALVES[1]} (classes 1, 3, ...), as its "
        "evaluation notebook splits them; the halves repeat test's examples.",
    ),
    _imagenet_config(
        "imagenet_a",
        "ImageNet-A (FOCI's IN-adversarial): images SRC/imagenet-a/<wnid>/*.jpg (the release's "
        "200 classes; the classes are the folders present).",
    ),
    _imagenet_config(
        "imagenet_r",
        "ImageNet-R (FOCI's IN-rendition): images SRC/imagenet-r/<wnid>/*.jpg (the release's "
        "200 classes; the classes are the folders present).",
    ),
    _imagenet_config(
        "imagenet_sketch",
        "ImageNet-Sketch (FOCI's IN-sketch): images SRC/sketch/<wnid>/*.JPEG (all 1000 classes).",
    ),
    _release_config(
        "geode",
        "GeoDE (FOCI's Table 7): SRC/index.csv (columns file_path, object, region; the label is "
        "object with '_' -> ' ', as FOCI's loader), images SRC/images/<file_path>. Splits: test "
        "(every image, Table 7's All) and one per region, named by its region in lowercase "
        f"words joined by '_' ('{region_split('WestAsia')}'), repeating test's examples.",
        "'images/<file_path>'",
    ),
    _custom(CUSTOM),
]
_NAMED = {config.name: config for config in _CONFIGS}
# A custom set's name is a directory and a TFDS config name: one plain lowercase word.
_CUSTOM_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def custom_config(name: str) -> FociConfig:
    """The config of the custom set `name` (`--config custom --name NAME`); "custom" itself is
    the registered config. It is rebuilt from the name alone, as a custom set differs from
    `custom` only in its name, so reading one needs nothing stored besides the records."""
    if name == CUSTOM:
        return _NAMED[CUSTOM]
    if not _CUSTOM_NAME.match(name):
        raise building.BuildError(
            f"--name {name!r}: a custom set's name must be one lowercase word of letters, "
            "digits and '_' that starts with a letter, e.g. imagenet_v2"
        )
    if name in _NAMED:
        raise building.BuildError(
            f"--name {name}: that is foci's config {name}; build it with --config {name}, or "
            "give the custom set another name"
        )
    return _custom(name)


class Builder(builders.SourceBuilder, tfds.core.GeneratorBasedBuilder):
    """FOCI multiple-choice questions from a dataset's release plus an options file."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[FociConfig]] = _CONFIGS
    # `ood_jax.datasets` builds and loads sets under names of their own through these.
    CUSTOM_CONFIG = CUSTOM
    custom_config = staticmethod(custom_config)
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
        release = release_files(config.name, src) if config.layout == "release" else []
        return [self._options_path(src), *release]

    def _options_path(self, src: pathlib.Path) -> pathlib.Path:
        config = self.builder_config
        names = options_files(config)
        found = [src / name for name in names if (src / name).exists()]
        if not found:
            mine = config.name if config.layout != CUSTOM else CUSTOM
            raise building.BuildError(
                f"{src}: no options file for foci/{config.name}; expected one of "
                f"{', '.join(names)} (FOCI format), or mine one with `ood-jax mine foci "
                f"--dataset {mine} --source {src} --scorer CLIP_DIR`"
            )
        if len(found) > 1:
            raise building.BuildError(
                f"{src}: {found[0].name} and {found[1].name} are both options files for "
                f"foci/{config.name}; keep the one to build from"
            )
        return found[0]

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        src = self.source_dir(dl_manager)
        config = self.builder_config
        options_path = self._options_path(src)
        entries = read_options(options_path)
        if not entries:
            raise building.BuildError(
                f"{options_path}: no entries, so split test would be empty; the file should "
                "map each label to its questions"
            )
        groups: dict[str, str] = {}
        if config.layout == "release":
            read = RELEASE_TEST_SPLITS[config.name]
            if config.name in IMAGENET_FOLDERS:  # the options name the classes they ask about
                split = read(src, {item.image: item.label for _, item in entries}, options_path)
            else:
                split = read(src)
            items, groups = join_release(entries, split, self.report), split.groups
        elif config.layout == "imagenet21k":
            items = imagenet21k_items(entries, src)
        else:
            items = custom_items(entries)
        _check_unique(items, options_path)
        grouped = collections.defaultdict(list)
        for item in items:
            if item.image in groups:
                grouped[groups[item.image]].append(item)
        self.start_progress(len(items) + sum(map(len, grouped.values())), "images")
        example_fn = functools.partial(
            question, src=src, on_error=self.on_error, seed=config.seed, dataset=config.name
        )
        # A group repeats test's images; one skipped is counted once (`BuildReport.skip`).
        return {
            name: self._generate_examples(name, members, example_fn)
            for name, members in [("test", items), *sorted(grouped.items())]
        }


def question(
    item: Item,
    report: building.BuildReport,
    *,
    src: pathlib.Path,
    on_error: str,
    seed: int,
    dataset: str,
) -> list[tuple[str, dict[str, Any]]]:
    """An item's one (key, example), or none if its image is skipped (`building.ExampleFn`)."""
    image = building.read_image_or_skip(src / item.image, on_error, report)
    if image is None:
        return []
    options, answer = shuffle_options(item.options, item.label, seed, item.image)
    example = {
        "image": image.jpeg,
        "image/filename": item.image,
        "label": item.label,
        "options": list(options),
        "answer": answer,
        "dataset": dataset,
    }
    return [(item.image, example)]
