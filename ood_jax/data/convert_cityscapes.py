"""`ood-jax convert cityscapes`: Cityscapes' gtFine polygons as an OODBench source.

OODBench takes "images from the camera on the left side of the validation set" and "adjusted
labels to ensure that their expressions conform to natural language conventions and excluded
potentially ambiguous labels". Its Appendix A, which lists them, is not available: the table
here (`CATEGORIES`, `DROPPED`) is this project's own, and covers every label of
cityscapesscripts' table.

Input, the release layout (left camera = leftImg8bit):
  ROOT/leftImg8bit/SPLIT/CITY/CITY_SEQ_FRAME_leftImg8bit.png
  ROOT/gtFine/SPLIT/CITY/CITY_SEQ_FRAME_gtFine_polygons.json
Every image needs its polygons file and every polygons file its image. Output, the layout
`ood_jax.data.oodbench` reads and `ood-jax mine oodbench` scores:
  OUT/annotations.json      COCO instances (images, annotations, categories)
  OUT/images                a symbolic link to ROOT: file_name is leftImg8bit/SPLIT/CITY/FILE
  OUT/ood_jax_convert.json  where it came from: root, split, versions, the table, the counts

Each polygon not marked deleted becomes at most one annotation:
- a label with instances (cityscapesscripts' hasInstances: person, car, ...): an instance,
  iscrowd 0, so it is counted, one per polygon as cityscapesscripts' json2instanceImg numbers
  them;
- a group of them ("cargroup": several cars in one polygon; the single instance's name is the
  label table's `assureSingleInstanceName`): a crowd region of that category, iscrowd 1: the
  category is present, its number unknown, as with COCO's crowd regions;
- a kept label without instances (road, sky, ...): a presence region, iscrowd 1, since "Does
  this image contain a road?" has an answer and "how many roads?" has none;
- a dropped label: nothing, counted by label in the summary.
gtFine labels every pixel, so a kept category without a polygon in an image is absent from it,
which is how the reader takes an unannotated category.

bbox: the extent of the polygon's part inside the image, [x, y, w, h] in the polygons' pixel
coordinates. area: that part's area (the polygon clipped to the image, then the shoelace
formula). A polygon with no area inside the image is skipped and counted.
"""

from __future__ import annotations

import collections
import importlib.metadata
import os
import pathlib
from typing import Any

from PIL import Image

from ood_jax import __version__
from ood_jax.data import building, conversion

# Cityscapes label -> the category name a question asks about. Order gives the category ids.
# A label with instances is counted, one without is a presence region (the module docstring).
CATEGORIES = {
    "person": "person",
    "rider": "rider",  # a person riding a bicycle or motorcycle
    "car": "car",
    "truck": "truck",
    "bus": "bus",
    # Cityscapes' "vehicle on rails": in its street scenes these are trams, which nobody would
    # call a train.
    "train": "tram",
    "motorcycle": "motorcycle",
    "bicycle": "bicycle",
    "road": "road",
    "sidewalk": "sidewalk",
    "building": "building",
    "wall": "wall",  # a free-standing wall; the walls of a house are "building"
    "fence": "fence",
    "pole": "pole",
    "polegroup": "pole",  # several poles in one polygon: poles are present
    "traffic light": "traffic light",
    "traffic sign": "traffic sign",
    # Trees, hedges and bushes alike: "tree" would be false of an image with only a hedge.
    "vegetation": "vegetation",
    "sky": "sky",
}

# Cityscapes label -> why no question asks about it.
DROPPED = {
    "unlabeled": "void: no object",
    "ego vehicle": "void: the recording car's own bonnet, in nearly every image",
    "rectification border": "void: the border the image rectification leaves",
    "out of roi": "void: outside the annotated region of interest",
    "static": "void: a catch-all for unlabelled fixed things (benches, bins, ...)",
    "dynamic": "void: a catch-all for unlabelled movable things (strollers, animals, ...)",
    "ground": "void: a catch-all for flat ground that is neither road, sidewalk nor terrain",
    "parking": "ambiguous: in plain words a parking space is part of the road or sidewalk",
    "rail track": "ambiguous: tram tracks run in the road",
    "guard rail": "ambiguous: in plain words a guard rail is a kind of fence",
    "bridge": "ambiguous: a bridge seen from below is a building or a wall in plain words",
    "tunnel": "ambiguous: from the road a tunnel is a wall or building around it",
    "terrain": "ambiguous: grass, soil or sand beside the road; no plain word names all three",
    "caravan": "ambiguous: caravan, camper or trailer by dialect; too rare for its evaluation",
    "trailer": "ambiguous: a trailer of a car, truck or a caravan; too rare for its evaluation",
    "license plate": "a part of a car rather than an object of its own",
}

SPLITS = ("train", "val")
CONVERTER = "cityscapes"
IMAGE_SUFFIX = "_leftImg8bit.png"
POLYGONS_SUFFIX = "_gtFine_polygons.json"
# Skip reasons that are not a label: the summary's "ignored".
DELETED = "deleted"
NO_AREA = "no area inside the image"


# ---------------------------------------------------------------------------------------------
# The label table
# ---------------------------------------------------------------------------------------------


def _label_table():
    """cityscapesscripts' label module: an optional dependency (the `sources` extra)."""
    try:
        from cityscapesscripts.helpers import labels
    except ImportError:
        raise building.BuildError(
            "converting Cityscapes needs cityscapesscripts: pip install 'ood-jax[sources]'"
        ) from None
    # A cityscapesscripts release with a label this table does not place would be converted
    # with that label silently lost, or fail mid-way; fail first instead.
    names = [label.name for label in labels.labels]
    unplaced = [name for name in names if (name in CATEGORIES) == (name in DROPPED)]
    if unplaced:
        raise building.BuildError(
            f"cityscapesscripts {importlib.metadata.version('cityscapesscripts')}: labels "
            f"{unplaced} are neither in convert_cityscapes.CATEGORIES nor DROPPED, or in both"
        )
    return labels


def _category_names() -> list[str]:
    """The output categories, in table order, each once."""
    return list(dict.fromkeys(CATEGORIES.values()))


def _classify(labels, name: Any, where: str) -> tuple[str, int] | None:
    """(category, iscrowd) of a polygon's label, or None when the label is dropped."""
    single = labels.assureSingleInstanceName(name) if isinstance(name, str) else None
    if single is None:
        raise building.BuildError(
            f"{where}: unknown label {name!r}, not in cityscapesscripts' label table"
        )
    if single in DROPPED:
        return None
    counted = single == name and labels.name2label[name].hasInstances
    return CATEGORIES[single], int(not counted)


# ---------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------


def _clip_half_plane(points: list, axis: int, bound: float, keep_low: bool) -> list:
    """One Sutherland-Hodgman step: the polygon's part with points[axis] <= bound (keep_low)
    or >= bound."""
    out = []
    for current, following in zip(points, points[1:] + points[:1]):
        current_in = (current[axis] <= bound) if keep_low else (current[axis] >= bound)
        following_in = (following[axis] <= bound) if keep_low else (following[axis] >= bound)
        if current_in:
            out.append(current)
        if current_in != following_in:
            t = (bound - current[axis]) / (following[axis] - current[axis])
            out.append(tuple(c + t * (f - c) for c, f in zip(current, following)))
    return out


def _clip_polygon(points: list, width: float, height: float) -> list:
    """The part of a polygon inside [0, width] x [0, height]; the image is convex, so
    clipping against its four sides in turn is exact."""
    sides = ((0, 0, False), (0, width, True), (1, 0, False), (1, height, True))
    for axis, bound, keep_low in sides:
        points = _clip_half_plane(points, axis, bound, keep_low)
    return points


def _polygon_area(points: list) -> float:
    """The shoelace formula."""
    twice = sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(points, points[1:] + points[:1]))
    return abs(twice) / 2


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _points(polygon: Any, where: str) -> list[tuple[float, float]]:
    if not isinstance(polygon, list) or not all(
        isinstance(p, list) and len(p) == 2 and _is_number(p[0]) and _is_number(p[1])
        for p in polygon
    ):
        raise building.BuildError(f"{where}.polygon: expected a list of [x, y] numbers")
    return [(p[0], p[1]) for p in polygon]


# ---------------------------------------------------------------------------------------------
# Reading the release
# ---------------------------------------------------------------------------------------------


def _check_split(root: pathlib.Path, split: str) -> None:
    if split == "test":
        raise building.BuildError(
            f"{root / 'gtFine' / 'test'}: Cityscapes' test labels are not public; "
            "convert train or val"
        )
    if split not in SPLITS:
        raise building.BuildError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def _split_files(root: pathlib.Path, split: str) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(image, polygons file) of every image of the split, sorted by image path."""
    found = {}
    for folder, suffix in (("leftImg8bit", IMAGE_SUFFIX), ("gtFine", POLYGONS_SUFFIX)):
        directory = root / folder / split
        if not directory.is_dir():
            raise building.BuildError(
                f"{directory}: not found; the root must hold the release's leftImg8bit/ and "
                "gtFine/ folders"
            )
        found[folder] = {p.name[: -len(suffix)]: p for p in directory.glob(f"*/*{suffix}")}
    images, polygons = found["leftImg8bit"], found["gtFine"]
    for stem, image in images.items():
        if stem not in polygons:
            raise building.BuildError(
                f"{image}: no polygons file "
                f"{root / 'gtFine' / split / image.parent.name / (stem + POLYGONS_SUFFIX)}"
            )
    for stem, polygon_file in polygons.items():
        if stem not in images:
            raise building.BuildError(
                f"{polygon_file}: no image "
                f"{root / 'leftImg8bit' / split / polygon_file.parent.name / (stem + IMAGE_SUFFIX)}"
            )
    if not images:
        raise building.BuildError(f"{root / 'leftImg8bit' / split}: no *{IMAGE_SUFFIX} images")
    return [(images[stem], polygons[stem]) for stem in sorted(images, key=images.__getitem__)]


def _size(record: dict, path: pathlib.Path, image: pathlib.Path) -> tuple[int, int]:
    """(width, height) from the polygons file, checked against the image's own header."""
    building.require(record, ("imgWidth", "imgHeight", "objects"), str(path))
    size = (record["imgWidth"], record["imgHeight"])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size):
        raise building.BuildError(f"{path}: imgWidth and imgHeight must be positive integers")
    try:
        with Image.open(image) as opened:  # reads the header only
            actual = opened.size
    except OSError as e:
        raise building.BuildError(f"{image}: corrupt or unreadable image ({e})") from None
    if actual != size:
        raise building.BuildError(
            f"{path}: imgWidth x imgHeight {size[0]}x{size[1]}, but its image {image} is "
            f"{actual[0]}x{actual[1]}"
        )
    return size


def _annotations(labels, path: pathlib.Path, image: pathlib.Path, skipped: collections.Counter):
    """(width, height, [(category, iscrowd, bbox, area)]) of one polygons file; what it skips
    is counted in `skipped` by label (dropped) or by reason (DELETED, NO_AREA)."""
    record = building.load_json(path)
    width, height = _size(record, path, image)
    if not isinstance(record["objects"], list):
        raise building.BuildError(f"{path}: 'objects' must be a list")
    found = []
    for i, obj in enumerate(record["objects"]):
        where = f"{path}: objects[{i}]"
        building.require(obj, (), where)
        if obj.get("deleted"):
            skipped[DELETED] += 1
            continue
        building.require(obj, ("label", "polygon"), where)
        kept = _classify(labels, obj["label"], where)
        points = _points(obj["polygon"], where)
        if kept is None:
            skipped[obj["label"]] += 1
            continue
        inside = _clip_polygon(points, width, height)
        area = _polygon_area(inside)
        if area <= 0:
            skipped[NO_AREA] += 1
            continue
        xs, ys = [p[0] for p in inside], [p[1] for p in inside]
        bbox = [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]
        found.append((*kept, bbox, area))
    return width, height, found


def _coco(labels, root: pathlib.Path, split: str) -> tuple[dict, dict]:
    """(COCO instances dict, summary) of a split."""
    category_ids = {name: i for i, name in enumerate(_category_names(), start=1)}
    supercategories = {
        category: labels.name2label[label].category for label, category in CATEGORIES.items()
    }
    coco = {
        "images": [],
        "annotations": [],
        "categories": [
            {"id": i, "name": name, "supercategory": supercategories[name]}
            for name, i in category_ids.items()
        ],
    }
    skipped = collections.Counter()
    tally = {0: collections.Counter(), 1: collections.Counter()}  # by iscrowd
    images_with = collections.Counter()
    for image_id, (image, polygons) in enumerate(_split_files(root, split), start=1):
        width, height, found = _annotations(labels, polygons, image, skipped)
        file_name = image.relative_to(root).as_posix()
        coco["images"].append(
            {"id": image_id, "file_name": file_name, "width": width, "height": height}
        )
        for category, iscrowd, bbox, area in found:
            coco["annotations"].append(
                {
                    "id": len(coco["annotations"]) + 1,
                    "image_id": image_id,
                    "category_id": category_ids[category],
                    "bbox": bbox,
                    "area": area,
                    "iscrowd": iscrowd,
                }
            )
            tally[iscrowd][category] += 1
        images_with.update({category for category, *_ in found})
    if not coco["annotations"]:
        raise building.BuildError(
            f"{root / 'gtFine' / split}: no polygon of a kept label in any of "
            f"{len(coco['images'])} images, so nothing to ask about"
        )

    def ordered(counter):
        return {name: counter[name] for name in category_ids if counter[name]}

    summary = {
        "split": split,
        "images": len(coco["images"]),
        "instances": ordered(tally[0]),
        "regions": ordered(tally[1]),
        "images_per_category": ordered(images_with),
        "dropped": {k: n for k, n in sorted(skipped.items()) if k not in (DELETED, NO_AREA)},
        "ignored": {k: skipped[k] for k in (DELETED, NO_AREA) if skipped[k]},
    }
    return coco, summary


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def convert(root: str | os.PathLike, split: str, out: str | os.PathLike) -> dict:
    """Converts a split of the Cityscapes release at `root` into an OODBench source at `out`
    (the module docstring); returns the summary: images, instances and regions per category,
    images per category, dropped labels and ignored polygons, counted."""
    root, out = pathlib.Path(root).resolve(), pathlib.Path(out)
    _check_split(root, split)
    labels = _label_table()
    identity = {"converter": CONVERTER, "root": str(root), "split": split}
    conversion.claim(out, identity, root)
    coco, summary = _coco(labels, root, split)
    record = {
        **identity,
        "ood_jax": __version__,
        "cityscapesscripts": importlib.metadata.version("cityscapesscripts"),
        "categories": CATEGORIES,
        "dropped_labels": DROPPED,
        "summary": summary,
    }
    conversion.write(out, root, record, coco)
    return summary
