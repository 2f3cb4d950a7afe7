"""COUNTS (Li et al.): object detection under 14 natural distribution shifts, as TFDS records.

What is read from the release directory SRC (`ood-jax build counts --source SRC`):

- `SRC/annotations/{train,val,test}.json`: one COCO detection file per source split. A file that
  is absent is not built; at least one must exist.
  - `images[]`: `id`, `file_name`, `width`, `height` and `domain`: one of COUNTS' 14 domains
    (any case; the release's spelling "handmake" means "handmade"), or a list of them for an
    image in several domains (Table 6 of the paper counts ~25k such images).
  - `categories[]`: `id`, `name`. Names are matched to the paper's 35 categories (Table 7)
    ignoring case, spaces, underscores and hyphens, so "Wine glass" and "bicycle_helmet" match.
  - `annotations[]`: `id`, `image_id`, `category_id`, `bbox` (absolute `[x, y, w, h]` pixels);
    optional `area` (default: w * h of the stored, clipped box) and `iscrowd` (default 0).
- `SRC/images/<file_name>`: the image. JPEG files are stored byte for byte, other formats are
  re-encoded as JPEG. Its decoded size must match the record's `width` and `height`.

Nothing else is read. Each image is written once, into the split of its source split and its
domains (`counts.split_name`): `{split}_{domain}`, e.g. `train_snow`, for an image of one
domain, `{split}_{d1}_{d2}` (COUNTS' domain order), e.g. `test_water_sky`, for one of several.
Records carry `domain` (the first the source lists) and `domains` (all, in domain order). The
O(OD)^2 sets are unions of these splits (`counts.held_out_split_expressions`): the training
set holds every training image none of whose domains is a target, the test set of target t
every test image that carries t. TFDS cannot write a split
without examples, so only the domain sets with at least one image are declared; an
annotation file without images fails the build naming it (its source split would vanish), and
so does a split all of whose images are skipped. The build record identifies the source by the
SHA-256 of each annotation file present.

Bad input fails the build naming the file and record: malformed JSON, a missing field, an
unknown category or domain, an annotation of an unknown image, a duplicate image id, an
unreadable image or one whose size differs from its record. With `--on-error skip`, unreadable
or mis-sized images are skipped and counted instead. Boxes of non-positive size or wholly
outside the image are dropped, boxes past the edge clipped; both are counted (`builder.report`).

Assumed layout: the release's own files could not be read when this builder was written, and
the paper (and its release page) does not pin down file names, so the layout above is assumed.
If a release ships differently, rearrange it into this layout; docs/guide/datasets.md ("COUNTS:
the assumed source layout") gives the adapter to write (one annotation file with a split field per
image, per-domain folders, or domains in a separate table).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import re
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ood_jax import boxes as box_lib
from ood_jax.data import builders, building, counts

BuildError = building.BuildError
_IMAGE_FIELDS = ("id", "file_name", "width", "height", "domain")
_ANNOTATION_FIELDS = ("id", "image_id", "category_id", "bbox")
_CATEGORY_FIELDS = ("id", "name")


def _category_key(name: str) -> str:
    """The spelling-insensitive form a category name is matched by."""
    return re.sub(r"[\s_\-]+", "", name.lower())


_CATEGORY_INDEX = {_category_key(name): i for i, name in enumerate(counts.CATEGORIES)}


@dataclasses.dataclass
class _Object:
    """One annotation as read, before its box is cleaned."""

    xywh: list[float]
    label: int
    area: float | None
    is_crowd: bool
    id: int


@dataclasses.dataclass
class _ImageRecord:
    """One image record with its annotations, in file order."""

    id: int
    file_name: str
    width: int
    height: int
    domain: str  # the first the source lists
    domains: tuple[str, ...]  # all of them, in counts.DOMAINS order
    objects: list[_Object] = dataclasses.field(default_factory=list)


def _as_int(value: Any, where: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise BuildError(f"{where}: field '{field}' must be an integer, got {value!r}")
    return int(value)


def _as_number(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BuildError(f"{where}: field '{field}' must be a number, got {value!r}")
    return float(value)


def _domains(value: Any, where: str) -> list[str]:
    """An image's `domain` field, one name or a non-empty list of names, as canonical names."""
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(n, str) for n in names):
        raise BuildError(
            f"{where}: field 'domain' must be a domain name or a non-empty list of them, "
            f"got {value!r}"
        )
    try:
        return [counts.canonical_domain(n) for n in names]
    except ValueError as e:
        raise BuildError(f"{where}: {e}") from None


def _list_field(data: Any, field: str, path: pathlib.Path) -> list:
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected a COCO object at the top level")
    if not isinstance(data.get(field), list):
        raise BuildError(f"{path}: missing list field '{field}'")
    return data[field]


def parse_annotation_file(path: pathlib.Path) -> list[_ImageRecord]:
    """Validates one COCO file and returns its images, each with its objects, in file order."""
    data = building.load_json(path)
    labels = {}
    for i, category in enumerate(_list_field(data, "categories", path)):
        where = f"{path}: categories[{i}]"
        building.require(category, _CATEGORY_FIELDS, where)
        key = _category_key(str(category["name"]))
        if key not in _CATEGORY_INDEX:
            raise BuildError(
                f"{where}: unknown category {category['name']!r}; COUNTS has "
                f"{', '.join(counts.CATEGORIES)}"
            )
        labels[_as_int(category["id"], where, "id")] = _CATEGORY_INDEX[key]

    images: dict[int, _ImageRecord] = {}
    for i, image in enumerate(_list_field(data, "images", path)):
        where = f"{path}: images[{i}]"
        building.require(image, _IMAGE_FIELDS, where)
        image_id = _as_int(image["id"], where, "id")
        if image_id in images:
            raise BuildError(f"{where}: duplicate image id {image_id}")
        listed = _domains(image["domain"], f"{where} (id {image_id})")
        images[image_id] = _ImageRecord(
            id=image_id,
            file_name=str(image["file_name"]),
            width=_as_int(image["width"], where, "width"),
            height=_as_int(image["height"], where, "height"),
            domain=listed[0],
            domains=counts.ordered_domains(listed),
        )

    for i, annotation in enumerate(_list_field(data, "annotations", path)):
        where = f"{path}: annotations[{i}]"
        building.require(annotation, _ANNOTATION_FIELDS, where)
        image_id = _as_int(annotation["image_id"], where, "image_id")
        if image_id not in images:
            raise BuildError(f"{where}: image_id {image_id} is not in the file's images")
        category_id = _as_int(annotation["category_id"], where, "category_id")
        if category_id not in labels:
            raise BuildError(f"{where}: category_id {category_id} is not in the file's categories")
        bbox = annotation["bbox"]
        if not isinstance(bbox, list) or len(bbox) != 4:
            raise BuildError(f"{where}: field 'bbox' must be [x, y, w, h], got {bbox!r}")
        area = annotation.get("area")
        images[image_id].objects.append(
            _Object(
                xywh=[_as_number(v, where, "bbox") for v in bbox],
                label=labels[category_id],
                area=None if area is None else _as_number(area, where, "area"),
                is_crowd=bool(_as_int(annotation.get("iscrowd", 0), where, "iscrowd")),
                id=_as_int(annotation["id"], where, "id"),
            )
        )
    return list(images.values())


def _annotation_files(src: pathlib.Path) -> dict[str, pathlib.Path]:
    """Source split -> its COCO file, for the files present."""
    files = {s: src / "annotations" / f"{s}.json" for s in counts.SOURCE_SPLITS}
    return {s: path for s, path in files.items() if path.is_file()}


class Builder(builders.SourceBuilder, tfds.core.GeneratorBasedBuilder):
    """COUNTS: one split per (source split, domain), e.g. `train_snow`."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Initial release: COCO files per source split, one TFDS split per domain.",
        "1.1.0": "Images of several domains: a `domains` feature; one split per domain set.",
    }

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "COUNTS: Common Objects UNder disTribution Shifts. Real images of 35 object "
                "categories in 14 domains, with image-level domain labels and object boxes. "
                "Split `{split}_{domain}` holds the images of one domain in one source split, "
                "`{split}_{d1}_{d2}...` those of exactly these domains."
            ),
            features=counts.detection_features(counts.CATEGORIES, several_domains=True),
            homepage="https://huggingface.co/datasets/jianshengli/COUNTS",
        )

    def source_files(self, src: pathlib.Path) -> list[pathlib.Path]:
        return list(_annotation_files(src).values())

    def _split_generators(self, dl_manager) -> dict:
        src = self.source_dir(dl_manager)
        annotations = src / "annotations"
        files = _annotation_files(src)
        if not files:
            raise BuildError(
                f"{annotations}: none of {', '.join(f'{s}.json' for s in counts.SOURCE_SPLITS)}"
                " found"
            )
        # Parse every file before writing anything, so bad annotations fail the build at once.
        by_split = collections.defaultdict(list)
        for split, path in files.items():
            records = parse_annotation_file(path)
            if not records:
                raise BuildError(
                    f"{path}: no images, so every {split}_* split would be empty; add its "
                    f"images or remove the file to build without a {split} split"
                )
            for record in records:
                by_split[counts.split_name(split, record.domains)].append(record)
        self.start_progress(sum(len(records) for records in by_split.values()), "images")
        example_fn = functools.partial(
            image_example, images_dir=annotations.parent / "images", on_error=self.on_error
        )
        return {
            name: self._generate_examples(name, records, example_fn)
            for name, records in by_split.items()
        }


def image_example(
    record: _ImageRecord, report: building.BuildReport, *, images_dir: pathlib.Path, on_error: str
) -> list[tuple[int, dict]]:
    """An image record's one (key, example), or none if its image is skipped
    (`building.ExampleFn`)."""
    path = images_dir / record.file_name
    image = building.read_image_or_skip(path, on_error, report)
    if image is None:
        return []
    if (image.height, image.width) != (record.height, record.width):
        reason = (
            f"decoded size {image.width}x{image.height} differs from the annotation's "
            f"width x height {record.width}x{record.height} (image id {record.id})"
        )
        if on_error == "fail":
            raise BuildError(f"{path}: {reason}")
        report.skip(path, reason)
        return []
    return [(record.id, _example(record, image, report))]


def _example(
    record: _ImageRecord, image: building.EncodedImage, report: building.BuildReport
) -> dict:
    xywh = np.array([o.xywh for o in record.objects], np.float64).reshape(-1, 4)
    bbox, kept = building.clean_boxes(xywh, record.height, record.width, report)
    kept_objects = [o for o, k in zip(record.objects, kept) if k]
    # Boxes past the edge are stored clipped, so the default area is the clipped box's.
    clipped = box_lib.clip_xyxy(
        box_lib.xywh_to_xyxy(xywh[kept]), max_x=record.width, max_y=record.height
    )
    sizes = box_lib.xyxy_to_xywh(clipped)
    box_areas = sizes[:, 2] * sizes[:, 3]
    return {
        "image": image.jpeg,
        "image/id": record.id,
        "image/filename": record.file_name,
        "domain": record.domain,
        "domains": list(record.domains),
        "objects": {
            "bbox": bbox,
            "label": np.array([o.label for o in kept_objects], np.int64),
            "area": np.array(
                [a if o.area is None else o.area for o, a in zip(kept_objects, box_areas)],
                np.float32,
            ),
            "is_crowd": np.array([o.is_crowd for o in kept_objects], bool),
            "id": np.array([o.id for o in kept_objects], np.int64),
        },
    }
