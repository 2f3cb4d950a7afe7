"""`ood-jax convert cityscapes` on a tiny release in the real layout, against a hand-made truth.

Two cities in val and one in train, 64x32 PNGs, polygons with instances, groups, stuff, void
labels, a deleted object, one polygon past the image edge and one wholly outside it. The
output is read back with the oodbench source reader the builder and the miner use.
"""

from __future__ import annotations

import collections
import json
import pathlib

import pytest
from cityscapesscripts.helpers import labels as cs_labels
from PIL import Image

from ood_jax import cli
from ood_jax.data import building, conversion, convert_cityscapes, oodbench

WIDTH, HEIGHT = 64, 32


def _box(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]


# A triangle reaching past the right edge (x = 64): its part inside is a trapezoid from x = 56
# to 64 with parallel sides 16 and 8 long, so its area is (16 + 8) / 2 * 8 = 96.
PAST_EDGE = [[56, 0], [72, 8], [56, 16]]
# A right triangle wholly inside: bbox [2, 12, 8, 10], area 8 * 10 / 2 = 40.
TRIANGLE = [[2, 12], [10, 12], [2, 22]]

RELEASE = {
    "val": {
        "frankfurt/frankfurt_000000_000001": [
            ("car", _box(2, 2, 10, 8)),
            ("car", _box(12, 2, 20, 8)),
            ("car", PAST_EDGE),
            ("car", _box(30, 2, 34, 6), {"deleted": 1}),
            ("person", TRIANGLE),
            ("person", _box(20, 12, 24, 22)),
            ("road", _box(0, 24, 64, 32)),
            ("sky", _box(0, 0, 64, 2)),
            ("ego vehicle", _box(0, 28, 64, 32)),
            ("out of roi", _box(0, 0, 1, 1)),
        ],
        "frankfurt/frankfurt_000000_000002": [
            ("car", _box(2, 2, 10, 8)),
            ("cargroup", _box(12, 2, 30, 8)),
            ("person", _box(2, 10, 6, 20)),
            ("persongroup", _box(8, 10, 20, 20)),
            ("rider", _box(22, 10, 26, 20)),
            ("building", _box(30, 0, 64, 20)),
            ("static", _box(40, 20, 44, 24)),
        ],
        "lindau/lindau_000000_000003": [
            ("road", _box(0, 20, 64, 32)),
            ("polegroup", _box(10, 0, 14, 20)),
            ("license plate", _box(30, 22, 34, 24)),
            ("car", _box(100, 0, 110, 10)),  # wholly outside the image
            ("vegetation", _box(40, 0, 64, 20)),
        ],
    },
    "train": {"aachen/aachen_000000_000004": [("car", _box(2, 2, 10, 8))]},
}

# Per val image: (category, iscrowd) -> annotations.
TRUTH = {
    "frankfurt_000000_000001": {("car", 0): 3, ("person", 0): 2, ("road", 1): 1, ("sky", 1): 1},
    "frankfurt_000000_000002": {
        ("car", 0): 1,
        ("car", 1): 1,
        ("person", 0): 1,
        ("person", 1): 1,
        ("rider", 0): 1,
        ("building", 1): 1,
    },
    "lindau_000000_000003": {("road", 1): 1, ("pole", 1): 1, ("vegetation", 1): 1},
}
# Per val image: category -> AnnotatedImage.count (None: present, number unknown).
COUNTS = {
    "frankfurt_000000_000001": {"car": 3, "person": 2, "road": None, "sky": None},
    "frankfurt_000000_000002": {"car": None, "person": None, "rider": 1, "building": None},
    "lindau_000000_000003": {"road": None, "pole": None, "vegetation": None},
}
DROPPED = {"ego vehicle": 1, "license plate": 1, "out of roi": 1, "static": 1}
IGNORED = {"deleted": 1, "no area inside the image": 1}


def _polygons_path(root, split, name):
    return root / "gtFine" / split / f"{name}_gtFine_polygons.json"


def _image_path(root, split, name):
    return root / "leftImg8bit" / split / f"{name}_leftImg8bit.png"


def _object(label, polygon, fields=None):
    # The release's objects also carry an id, user, date and verified flag, which are ignored.
    return {"label": label, "polygon": polygon, "date": "01-Jan-2016 00:00:00", **(fields or {})}


def _write_polygons(path, objects, width=WIDTH):
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "imgHeight": HEIGHT,
        "imgWidth": width,
        "objects": [_object(*o) for o in objects],
    }
    path.write_text(json.dumps(record))


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "cityscapes"
    for split, images in RELEASE.items():
        for name, objects in images.items():
            image = _image_path(root, split, name)
            image.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (WIDTH, HEIGHT), (90, 120, 150)).save(image)
            _write_polygons(_polygons_path(root, split, name), objects)
    return root


def _stem(file_name):
    return pathlib.PurePosixPath(file_name).name.removesuffix("_leftImg8bit.png")


def test_val_matches_the_truth(root, tmp_path):
    out = tmp_path / "out"
    summary = convert_cityscapes.convert(root, "val", out)

    coco = json.loads((out / "annotations.json").read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    assert list(names) == list(range(1, len(names) + 1))
    assert list(names.values()) == list(dict.fromkeys(convert_cityscapes.CATEGORIES.values()))
    # Only val's images, numbered in sorted file order.
    assert [(i["id"], i["file_name"]) for i in coco["images"]] == [
        (1, "leftImg8bit/val/frankfurt/frankfurt_000000_000001_leftImg8bit.png"),
        (2, "leftImg8bit/val/frankfurt/frankfurt_000000_000002_leftImg8bit.png"),
        (3, "leftImg8bit/val/lindau/lindau_000000_000003_leftImg8bit.png"),
    ]
    assert all((i["width"], i["height"]) == (WIDTH, HEIGHT) for i in coco["images"])
    stems = {i["id"]: _stem(i["file_name"]) for i in coco["images"]}
    found = {stem: collections.Counter() for stem in stems.values()}
    for a in coco["annotations"]:
        found[stems[a["image_id"]]][names[a["category_id"]], a["iscrowd"]] += 1
    assert found == TRUTH
    assert [a["id"] for a in coco["annotations"]] == list(range(1, len(coco["annotations"]) + 1))

    assert summary["images"] == 3
    assert summary["instances"] == {"person": 3, "rider": 1, "car": 4}
    assert summary["regions"] == {
        "person": 1,
        "car": 1,
        "road": 2,
        "building": 1,
        "pole": 1,
        "vegetation": 1,
        "sky": 1,
    }
    assert summary["dropped"] == DROPPED
    assert summary["ignored"] == IGNORED


def test_bbox_and_area(root, tmp_path):
    out = tmp_path / "out"
    convert_cityscapes.convert(root, "val", out)
    coco = json.loads((out / "annotations.json").read_text())
    by_corner = {tuple(a["bbox"][:2]): a for a in coco["annotations"] if a["image_id"] == 1}
    # Clipped at x = 64: the bbox ends at the edge, the area is the trapezoid's.
    assert by_corner[56, 0]["bbox"] == pytest.approx([56, 0, WIDTH - 56, 16])
    assert by_corner[56, 0]["area"] == pytest.approx((16 + 8) / 2 * (WIDTH - 56))
    assert by_corner[2, 12]["bbox"] == [2, 12, 8, 10] and by_corner[2, 12]["area"] == 8 * 10 / 2
    assert by_corner[2, 2]["bbox"] == [2, 2, 8, 6] and by_corner[2, 2]["area"] == 8 * 6


def test_reads_as_an_oodbench_source(root, tmp_path):
    out = tmp_path / "out"
    convert_cityscapes.convert(root, "val", out)
    categories, names, images = oodbench.read_annotations(out / "annotations.json")
    assert len(images) == 3
    for image in images.values():
        assert oodbench.image_path(out / "images", image).is_file()
        truth = COUNTS[_stem(image.file_name)]
        for name, category in names.items():
            assert image.presence(category) is (name in truth), (image.file_name, name)
            assert image.count(category) == truth.get(name, 0), (image.file_name, name)


def test_provenance_and_reruns(root, tmp_path):
    out = tmp_path / "out"
    summary = convert_cityscapes.convert(root, "val", out)
    record = json.loads((out / conversion.RECORD_FILE).read_text())
    assert record["root"] == str(root.resolve()) and record["split"] == "val"
    assert record["cityscapesscripts"] == "2.3.0"
    assert record["categories"] == convert_cityscapes.CATEGORIES
    assert record["dropped_labels"] == convert_cityscapes.DROPPED
    assert record["summary"] == summary
    assert (out / "images").is_symlink() and (out / "images").resolve() == root.resolve()

    before = (out / "annotations.json").read_text()
    assert convert_cityscapes.convert(root, "val", out) == summary  # the same conversion
    assert (out / "annotations.json").read_text() == before
    with pytest.raises(
        building.BuildError, match="holds a conversion with split 'val', not 'train'"
    ):
        convert_cityscapes.convert(root, "train", out)
    assert (out / "annotations.json").read_text() == before


def test_train_split_holds_only_train(root, tmp_path):
    summary = convert_cityscapes.convert(root, "train", tmp_path / "out")
    assert summary["images"] == 1 and summary["instances"] == {"car": 1}


def test_refuses_an_out_it_did_not_write(root, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "annotations.json").write_text("{}")
    with pytest.raises(
        building.BuildError, match="without ood_jax_convert.json, so not a converter's output"
    ):
        convert_cityscapes.convert(root, "val", out)


def test_table_places_every_cityscapes_label():
    names = [label.name for label in cs_labels.labels]
    categories, dropped = convert_cityscapes.CATEGORIES, convert_cityscapes.DROPPED
    assert set(categories) | set(dropped) == set(names)
    assert not set(categories) & set(dropped)
    assert all(isinstance(r, str) and r for r in dropped.values())
    assert all(n and "_" not in n and n == n.lower() for n in categories.values())
    # Every void label is dropped.
    assert {label.name for label in cs_labels.labels if label.category == "void"} <= set(dropped)


@pytest.mark.parametrize("label", ["spaceship", "skygroup"])
def test_unknown_label_names_file_and_object(root, tmp_path, label):
    path = _polygons_path(root, "val", "lindau/lindau_000000_000003")
    _write_polygons(path, [("road", _box(0, 20, 64, 32)), (label, _box(0, 0, 4, 4))])
    with pytest.raises(building.BuildError) as error:
        convert_cityscapes.convert(root, "val", tmp_path / "out")
    assert str(error.value) == (
        f"{path}: objects[1]: unknown label {label!r}, not in cityscapesscripts' label table"
    )
    assert not (tmp_path / "out").exists()


def test_image_without_polygons(root, tmp_path):
    _polygons_path(root, "val", "lindau/lindau_000000_000003").unlink()
    image = _image_path(root, "val", "lindau/lindau_000000_000003")
    with pytest.raises(building.BuildError, match=f"^{image}: no polygons file "):
        convert_cityscapes.convert(root, "val", tmp_path / "out")


def test_polygons_without_image(root, tmp_path):
    _image_path(root, "val", "lindau/lindau_000000_000003").unlink()
    polygons = _polygons_path(root, "val", "lindau/lindau_000000_000003")
    with pytest.raises(building.BuildError, match=f"^{polygons}: no image "):
        convert_cityscapes.convert(root, "val", tmp_path / "out")


def test_size_must_match_the_image(root, tmp_path):
    path = _polygons_path(root, "val", "lindau/lindau_000000_000003")
    _write_polygons(path, [("road", _box(0, 20, 64, 32))], width=WIDTH * 2)
    with pytest.raises(building.BuildError, match=f"^{path}: imgWidth x imgHeight 128x32"):
        convert_cityscapes.convert(root, "val", tmp_path / "out")


def test_test_split_is_refused(root, tmp_path):
    with pytest.raises(building.BuildError, match="test labels are not public"):
        convert_cityscapes.convert(root, "test", tmp_path / "out")


def test_command_line(root, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", "cityscapes", "--help"])
    assert "ood-jax convert cityscapes --root" in capsys.readouterr().out
    out = tmp_path / "out"
    args = cli.parse_args(["convert", "cityscapes", "--root", str(root), "--out", str(out)])
    assert args.split == "val"
    args.run(args)
    printed = capsys.readouterr().out
    assert f"cityscapes val: 3 images -> {out / 'annotations.json'}" in printed
    assert "dropped labels: ego vehicle 1, license plate 1, out of roi 1, static 1" in printed
    assert oodbench.read_annotations(out / "annotations.json")[2].keys() == {1, 2, 3}
