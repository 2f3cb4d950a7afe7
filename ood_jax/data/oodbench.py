"""OODBench's source files, read strictly: the COCO/LVIS annotations and the split list.

Shared by the `oodbench` TFDS builder (which asks its questions from them) and by
`ood_jax.mining.oodbench` (which scores the annotated image-category pairs), so both apply the
same validation, file names and presence rules. Errors name the file, record and field
(`building.BuildError`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import urllib.parse
from typing import Any

from ood_jax.data import building

# splits.jsonl's labels -> TFDS split names.
SPLITS = {"ID": "id", "OOD-S": "ood_s", "OOD-H": "ood_h"}


def category_text(name: str) -> str:
    """A category name as words: LVIS names join them with underscores ("baseball_bat")."""
    return name.replace("_", " ")


@dataclasses.dataclass
class AnnotatedImage:
    id: int
    file_name: str
    # The COCO folder coco_url names ("train2017", "val2017"): LVIS v1 val draws images from both.
    folder: str | None = None
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    crowd: set[int] = dataclasses.field(default_factory=set)
    not_exhaustive: set[int] = dataclasses.field(default_factory=set)
    # None (COCO): every unannotated category is absent; a set (LVIS): only those are.
    negatives: set[int] | None = None

    def presence(self, category: int) -> bool | None:
        """True or False, or None where the annotations do not say."""
        if category in self.counts or category in self.crowd or category in self.not_exhaustive:
            return True
        if self.negatives is None or category in self.negatives:
            return False
        return None

    def count(self, category: int) -> int | None:
        """Instances of `category`, or None where the annotations do not give the number."""
        if category in self.crowd or category in self.not_exhaustive:
            return None
        return self.counts[category]

    def annotated(self) -> list[int]:
        return sorted(set(self.counts) | self.crowd)


@dataclasses.dataclass(frozen=True)
class Instance:
    image_id: int
    category: int


def _int_id(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise building.BuildError(f"{where}: expected an integer id, got {value!r}")
    return value


def _url_path(url: Any) -> pathlib.PurePosixPath | None:
    if not isinstance(url, str):
        return None
    path = pathlib.PurePosixPath(urllib.parse.urlparse(url).path)
    return path if path.name else None


def image_path(images_dir: pathlib.Path, image: AnnotatedImage) -> pathlib.Path:
    """Where an image's file is: `images_dir/<file_name>`, or, where that is missing and
    coco_url names a folder, `images_dir/<folder>/<file_name>` (COCO's train2017/ and val2017/
    side by side, as LVIS v1 val needs both). The first when neither exists, for the error."""
    flat = images_dir / image.file_name
    if image.folder is None or flat.exists():
        return flat
    nested = images_dir / image.folder / image.file_name
    return nested if nested.exists() else flat


def read_annotations(
    path: pathlib.Path,
) -> tuple[dict[int, str], dict[str, int | None], dict[int, AnnotatedImage]]:
    """(category id -> name, name or LVIS synonym -> id, image id -> image) from the JSON.

    A synonym that two categories share maps to None; a category's own name wins over synonyms.
    """
    data = building.load_json(path)
    building.require(data, ("images", "annotations", "categories"), str(path))
    categories: dict[int, str] = {}
    names: dict[str, int | None] = {}
    synonyms: list[tuple[str, int]] = []
    for i, category in enumerate(data["categories"]):
        where = f"{path}: categories[{i}]"
        building.require(category, ("id", "name"), where)
        category_id, name = _int_id(category["id"], f"{where}.id"), category["name"]
        if not isinstance(name, str) or name in names:
            raise building.BuildError(f"{where}: missing or duplicate name {name!r}")
        categories[category_id], names[name] = name, category_id
        synonyms += [(s, category_id) for s in category.get("synonyms", ()) if s != name]
    own_names = set(names)
    for synonym, category_id in synonyms:
        if synonym not in own_names:
            names[synonym] = category_id if names.get(synonym, category_id) == category_id else None
    images: dict[int, AnnotatedImage] = {}
    for i, record in enumerate(data["images"]):
        where = f"{path}: images[{i}]"
        building.require(record, ("id",), where)
        image_id = _int_id(record["id"], f"{where}.id")
        url = _url_path(record.get("coco_url"))
        file_name = record.get("file_name") or (url.name if url else None)
        if not file_name:
            raise building.BuildError(f"{where}: neither 'file_name' nor 'coco_url' names a file")
        if image_id in images:
            raise building.BuildError(f"{where}: duplicate image id {image_id}")
        negatives = record.get("neg_category_ids")
        images[image_id] = AnnotatedImage(
            id=image_id,
            file_name=file_name,
            folder=(url.parent.name or None) if url else None,
            not_exhaustive=set(record.get("not_exhaustive_category_ids", ())),
            negatives=None if negatives is None else set(negatives),
        )
    for i, annotation in enumerate(data["annotations"]):
        where = f"{path}: annotations[{i}]"
        building.require(annotation, ("image_id", "category_id"), where)
        image = images.get(_int_id(annotation["image_id"], f"{where}.image_id"))
        category = _int_id(annotation["category_id"], f"{where}.category_id")
        if image is None:
            raise building.BuildError(f"{where}: unknown image_id {annotation['image_id']}")
        if category not in categories:
            raise building.BuildError(f"{where}: unknown category_id {category}")
        if annotation.get("iscrowd", 0):
            image.crowd.add(category)
        else:
            image.counts[category] += 1
    return categories, names, images


def read_splits(
    path: pathlib.Path, images: dict[int, AnnotatedImage], names: dict[str, int | None]
) -> dict[str, list[Instance]]:
    lines = building.read_text(path).splitlines()
    instances: dict[str, list[Instance]] = {split: [] for split in SPLITS.values()}
    first_line: dict[tuple[int, int], int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise building.BuildError(f"{path}: malformed JSON on line {number}: {e.msg}") from None
        building.require(record, ("image_id", "category", "split"), where)
        image_id, name, label = record["image_id"], record["category"], record["split"]
        if not isinstance(image_id, int) or isinstance(image_id, bool) or image_id not in images:
            raise building.BuildError(f"{where}: unknown image_id {image_id!r}")
        if not isinstance(name, str) or name not in names:
            raise building.BuildError(f"{where}: unknown category {name!r}")
        if names[name] is None:
            raise building.BuildError(f"{where}: category {name!r} is a synonym of several")
        if not isinstance(label, str) or label not in SPLITS:
            raise building.BuildError(
                f"{where}: unknown split {label!r}; expected one of {', '.join(SPLITS)}"
            )
        key = (image_id, names[name])
        if key in first_line:
            raise building.BuildError(
                f"{where}: image {image_id} with category {name!r} is already on line "
                f"{first_line[key]}"
            )
        first_line[key] = number
        instances[SPLITS[label]].append(Instance(image_id, names[name]))
    return instances
