"""OODBench: yes/no questions on ID, OOD-S and OOD-H image-category instances, and BAP questions.

Source layout (`--source SRC`):

    SRC/annotations.json  COCO or LVIS instances JSON (images, annotations, categories)
    SRC/images/<file_name>  LVIS images without "file_name" use the last part of "coco_url";
                          where SRC/images/<name> is missing, SRC/images/<folder>/<name> with
                          coco_url's folder (LVIS v1 val takes images from COCO's train2017/ and
                          val2017/, which may sit side by side under SRC/images/)
    SRC/splits.jsonl      {"image_id": int, "category": name, "split": "ID" | "OOD-S" | "OOD-H"}

Splits: `id`, `ood_s`, `ood_h`. Answers come from the annotations, never from splits.jsonl.
Every split must get questions: an empty splits.jsonl, a split label it never uses, or a split
none of whose instances gives a question fails the build naming the split (TFDS cannot write an
empty split, and a dataset missing one would look finished). The build record identifies the
source by the SHA-256 of annotations.json and splits.jsonl.

Config `default`: every instance gives two questions with opposite answers, as the paper does to
balance labels (data-construction paragraph, Fig. 4). The wording is the paper's and its released
code's, "(yes or no)" included, and "[class]" is filled in literally, so "a" is never "an".

Config `bap`: the Basic-to-Advanced Progression questions. Per split and image, one test sample:
category A is drawn from the image's instance categories that are present, and B from the image's
other annotated categories (the paper pairs each image with two distinct labels), by a choice
seeded with the split and image id. It asks existential and counting questions for A and for B,
then the logical one "A greater than B?" (a tie is "no": not greater). Images with fewer than two
annotated categories are not used, as in the paper.

Counts: a crowd annotation (COCO) or a category LVIS marks not exhaustively annotated stands for
an unknown number of instances, so its count is undefined: `count` is -1 in `default`, and `bap`
skips the counting and logical questions that need it (counted in the build report). LVIS is
federated: a category neither annotated nor listed in the image's "neg_category_ids" has no known
answer, so such instances are skipped and counted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import random
from typing import ClassVar

import tensorflow as tf
import tensorflow_datasets as tfds

from ood_jax import prompts
from ood_jax.data import builders, building, oodbench
from ood_jax.data.oodbench import category_text

SPLITS = oodbench.SPLITS

LEVELS = ("existential", "counting", "logical")

UNKNOWN_PRESENCE = "instances skipped: category neither annotated nor verified absent (LVIS)"
UNDEFINED_COUNT = "yes/no instances with count -1: crowd or non-exhaustive annotation"
FEW_CATEGORIES = "bap images skipped: fewer than two annotated categories"
NO_PRESENT_INSTANCE = "bap images skipped: no instance category is present in the image"
SKIPPED_COUNTING = "bap counting questions skipped: count undefined (crowd or non-exhaustive)"
SKIPPED_LOGICAL = "bap logical questions skipped: a count is undefined (crowd or non-exhaustive)"


@dataclasses.dataclass
class _Source:
    images_dir: pathlib.Path
    categories: dict[int, str]
    images: dict[int, oodbench.AnnotatedImage]
    instances: dict[str, list[oodbench.Instance]]  # TFDS split -> instances in file order


@dataclasses.dataclass(frozen=True)
class _ImageQuestions:
    """One image of a split with the (key, example without the image) of its questions."""

    image: oodbench.AnnotatedImage
    questions: list[tuple[str, dict]]


def image_examples(
    item: _ImageQuestions,
    report: building.BuildReport,
    *,
    images_dir: pathlib.Path,
    on_error: str,
) -> list[tuple[str, dict]]:
    """An image's questions with the image, read once for all of them, or none if it is
    skipped (`building.ExampleFn`)."""
    image_id = item.image.id
    path = oodbench.image_path(images_dir, item.image)
    encoded = building.read_image_or_skip(path, on_error, report)
    if encoded is None:
        return []
    return [
        (f"{image_id}/{key}", {**example, "image": encoded.jpeg, "image/id": image_id})
        for key, example in item.questions
    ]


def _by_image(instances: list[oodbench.Instance]) -> dict[int, list[oodbench.Instance]]:
    groups: dict[int, list[oodbench.Instance]] = collections.defaultdict(list)
    for instance in instances:
        groups[instance.image_id].append(instance)
    return groups


def _bap(level: str, question: str, answer: str, categories: list[str]) -> dict:
    return {"level": level, "question": question, "answer": answer, "categories": categories}


def _empty_split(
    splits_path: pathlib.Path, label: str, split: str, instances: int
) -> building.BuildError:
    if not instances:
        why = f"{splits_path} has no line with split {label!r}"
    else:
        why = f"none of its {instances} instances in {splits_path} gives a question"
    return building.BuildError(f"split {split} would be empty: {why} (see the build report)")


class Builder(builders.SourceBuilder, tfds.core.GeneratorBasedBuilder):
    """OODBench from COCO/LVIS annotations and the ID / OOD-S / OOD-H instance list."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Yes/no questions and BAP questions."}
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        tfds.core.BuilderConfig(name="default", description="Two yes/no questions per instance."),
        tfds.core.BuilderConfig(
            name="bap", description="Existential, counting and logical questions (BAP metric)."
        ),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        common = {
            "image": tfds.features.Image(encoding_format="jpeg"),
            "image/id": tf.int64,
            "question": tfds.features.Text(),
        }
        if self.builder_config.name == "bap":
            features = {
                **common,
                "level": tfds.features.ClassLabel(names=LEVELS),
                "answer": tfds.features.Text(),
                "categories": tfds.features.Sequence(tfds.features.Text()),
            }
        else:
            features = {
                **common,
                "category": tfds.features.Text(),
                "answer": tfds.features.ClassLabel(names=["no", "yes"]),
                "count": tf.int32,
                "kind": tfds.features.Text(),
            }
        return self.dataset_info_from_configs(
            description=__doc__, features=tfds.features.FeaturesDict(features)
        )

    def source_files(self, src: pathlib.Path) -> list[pathlib.Path]:
        return [src / "annotations.json", src / "splits.jsonl"]

    def _split_generators(self, dl_manager) -> dict:
        root = self.source_dir(dl_manager)
        categories, names, images = oodbench.read_annotations(root / "annotations.json")
        splits_path = root / "splits.jsonl"
        instances = oodbench.read_splits(splits_path, images, names)
        if not any(instances.values()):
            raise building.BuildError(
                f"{splits_path}: no instances, so every split would be empty; it should hold "
                '{"image_id", "category", "split"} lines'
            )
        source = _Source(root / "images", categories, images, instances)
        plan = self._bap_questions if self.builder_config.name == "bap" else self._yes_no_questions
        questions = {split: plan(source, split) for split in SPLITS.values()}
        for label, split in SPLITS.items():
            if not questions[split]:
                raise _empty_split(splits_path, label, split, len(instances[split]))
        self.start_progress(sum(len(q) for q in questions.values()), "images")
        # An image in several splits is read in each; skipped, it counts once (`BuildReport.skip`).
        example_fn = functools.partial(
            image_examples, images_dir=source.images_dir, on_error=self.on_error
        )
        return {
            split: self._generate_examples(
                split,
                [_ImageQuestions(source.images[i], q) for i, q in questions[split].items()],
                example_fn,
            )
            for split in SPLITS.values()
        }

    def _yes_no_questions(self, source: _Source, split: str) -> dict[int, list[tuple[str, dict]]]:
        """Image id -> (key, example without the image) of the split's yes/no questions."""
        questions = {}
        for image_id, group in _by_image(source.instances[split]).items():
            image = source.images[image_id]
            examples = []
            for instance in group:
                present = image.presence(instance.category)
                if present is None:
                    self.report.notes[UNKNOWN_PRESENCE] += 1
                    continue
                count = image.count(instance.category)
                if count is None:
                    self.report.notes[UNDEFINED_COUNT] += 1
                name = source.categories[instance.category]
                for kind, template, answer in (
                    ("existential", prompts.OODBENCH_PRESENCE_QUESTION, present),
                    ("negated existential", prompts.OODBENCH_ABSENCE_QUESTION, not present),
                ):
                    example = {
                        "category": name,
                        "question": template.format(category=category_text(name)),
                        "answer": "yes" if answer else "no",
                        "count": -1 if count is None else count,
                        "kind": kind,
                    }
                    examples.append((f"{instance.category}/{kind}", example))
            if examples:
                questions[image_id] = examples
        return questions

    def _bap_pair(
        self, image: oodbench.AnnotatedImage, group: list[oodbench.Instance], split: str
    ) -> tuple[int, int] | None:
        """The test sample's (A, B), or None (counted) when the image gives none."""
        annotated = image.annotated()
        if len(annotated) < 2:
            self.report.notes[FEW_CATEGORIES] += 1
            return None
        candidates = sorted({i.category for i in group if i.category in annotated})
        if not candidates:
            self.report.notes[NO_PRESENT_INSTANCE] += 1
            return None
        # Seeded by a string, which `random` hashes with SHA-512: the same on every machine.
        rng = random.Random(f"oodbench-bap/{split}/{image.id}")
        first = rng.choice(candidates)
        return first, rng.choice([c for c in annotated if c != first])

    def _bap_questions(self, source: _Source, split: str) -> dict[int, list[tuple[str, dict]]]:
        """Image id -> (key, example without the image) of the split's BAP test samples."""
        questions = {}
        for image_id, group in _by_image(source.instances[split]).items():
            image = source.images[image_id]
            pair = self._bap_pair(image, group, split)
            if pair is None:
                continue
            names = [source.categories[c] for c in pair]
            counts = [image.count(c) for c in pair]
            examples = []
            for category, name, count in zip(pair, names, counts):
                question = prompts.BAP_EXISTENTIAL_QUESTION.format(category=category_text(name))
                examples.append(
                    (f"existential/{category}", _bap("existential", question, "yes", [name]))
                )
                if count is None:
                    self.report.notes[SKIPPED_COUNTING] += 1
                    continue
                question = prompts.BAP_COUNTING_QUESTION.format(category=category_text(name))
                examples.append(
                    (f"counting/{category}", _bap("counting", question, str(count), [name]))
                )
            if None in counts:
                self.report.notes[SKIPPED_LOGICAL] += 1
            else:
                question = prompts.BAP_LOGICAL_QUESTION.format(
                    first=category_text(names[0]), second=category_text(names[1])
                )
                answer = "yes" if counts[0] > counts[1] else "no"
                examples.append(
                    (f"logical/{pair[0]}/{pair[1]}", _bap("logical", question, answer, names))
                )
            questions[image_id] = examples
        return questions
