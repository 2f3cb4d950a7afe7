"""The COUNTS builder on small release trees made here: records match the source, bad input fails."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax import boxes as box_lib
from ood_jax import cli
from ood_jax import datasets
from ood_jax.data import building, counts
from ood_jax.testing import plain_tfds

# Ids are sparse and names spelled loosely, as a release may do; values are COUNTS' names.
CATEGORY_RECORDS = {
    (1, "person"): "person",
    (5, "Wine glass"): "wineglass",
    (9, "bicycle helmet"): "bicyclehelmet",
    (12, "sun_hat"): "sunhat",
    (40, "Flower-pot"): "flowerpot",
}
# How the release spells some domains.
SPELLING = {"handmade": "handmake", "snow": "Snow"}


@dataclasses.dataclass
class Expected:
    """One source image and the record the build must make of it."""

    split: str
    id: int
    file_name: str
    width: int
    height: int
    domains: tuple[str, ...]  # as the source lists them; the first is the record's `domain`
    source_bytes: bytes
    # Kept objects: absolute xyxy, COUNTS category name, area, is_crowd, annotation id.
    boxes: list[tuple[float, float, float, float]] = dataclasses.field(default_factory=list)
    labels: list[str] = dataclasses.field(default_factory=list)
    areas: list[float] = dataclasses.field(default_factory=list)
    crowd: list[bool] = dataclasses.field(default_factory=list)
    ann_ids: list[int] = dataclasses.field(default_factory=list)
    clipped: int = 0


@dataclasses.dataclass
class Source:
    root: pathlib.Path
    coco: dict[str, dict]
    expected: list[Expected]
    clipped: int
    dropped: int

    def write(self) -> pathlib.Path:
        (self.root / "annotations").mkdir(parents=True, exist_ok=True)
        for split, data in self.coco.items():
            (self.root / "annotations" / f"{split}.json").write_text(json.dumps(data))
        return self.root


def _smooth_image(rng: np.random.Generator, height: int, width: int, gray: bool) -> Image.Image:
    # Smooth content keeps JPEG error small, so decoded pixels can be compared.
    grid = rng.integers(0, 256, (4, 4, 1 if gray else 3), dtype=np.uint8)
    image = Image.fromarray(grid[..., 0] if gray else grid)
    return image.resize((width, height), Image.BILINEAR)


def _annotation_cases(width: int, height: int) -> list[tuple[list[float], dict, tuple | None]]:
    """(bbox, extra fields, expected (xyxy, area) or None when dropped); each case once."""
    return [
        ([2.5, 3.0, 10.0, 8.25], {"area": 41.0}, ((2.5, 3.0, 12.5, 11.25), 41.0)),
        ([width - 5.0, height - 6.0, 12.0, 15.0], {}, ((width - 5.0, height - 6.0, width, height), 30.0)),
        ([4.0, 4.0, 0.0, 9.0], {"area": 5.0}, None),
        ([1.0, 2.0, 6.0, 7.0], {"iscrowd": 1, "area": 12.5}, ((1.0, 2.0, 7.0, 9.0), 12.5)),
        ([-3.0, -2.0, 8.0, 8.0], {"area": 60.0}, ((0.0, 0.0, 5.0, 6.0), 60.0)),
        ([width + 5.0, 1.0, 4.0, 4.0], {}, None),
    ]  # fmt: skip


def make_source(
    root: pathlib.Path, layout: dict[str, list[str | tuple[str, ...]]], seed: int = 0
) -> Source:
    """A release tree with one image per entry of `layout` (split -> canonical domain, or a
    tuple of them for an image of several, written as the list the source field may hold).

    Every image cycles through the annotation cases (boxes past the edge, zero width, crowd,
    area != w * h, outside the image); every fifth image has none, every fourth is a PNG, and
    one is a grayscale JPEG.
    """
    rng = np.random.default_rng(seed)
    (root / "images" / "sub").mkdir(parents=True, exist_ok=True)
    categories = [{"id": cid, "name": name} for cid, name in CATEGORY_RECORDS]
    coco, expected, clipped, dropped = {}, [], 0, 0
    count, ann_id = 0, 1000
    for split, domains in layout.items():
        images, annotations = [], []
        for entry in domains:
            listed = (entry,) if isinstance(entry, str) else entry
            height, width = int(rng.integers(20, 41)), int(rng.integers(24, 49))
            png = count % 4 == 3
            file_name = f"sub/{split}_{count}.{'png' if png else 'jpg'}"
            buffer = io.BytesIO()
            image = _smooth_image(rng, height, width, gray=count == 2)
            image.save(buffer, format="PNG" if png else "JPEG", quality=90)
            (root / "images" / file_name).write_bytes(buffer.getvalue())
            # One id past int32, to show ids are kept as int64.
            image_id = 2**33 + count if count == 1 else 100 * count + 7
            images.append(
                {
                    "id": image_id,
                    "file_name": file_name,
                    "width": width,
                    "height": height,
                    "domain": (
                        SPELLING.get(entry, entry) if isinstance(entry, str) else list(entry)
                    ),
                }
            )
            record = Expected(split, image_id, file_name, width, height, listed, buffer.getvalue())
            cases = _annotation_cases(width, height)
            chosen = [] if count % 5 == 4 else [cases[(count + k) % 6] for k in range(3)]
            for k, (bbox, extra, outcome) in enumerate(chosen):
                cid, name = list(CATEGORY_RECORDS)[(count + k) % len(CATEGORY_RECORDS)]
                ann_id += 1
                annotations.append(
                    {"id": ann_id, "image_id": image_id, "category_id": cid, "bbox": bbox} | extra
                )
                if outcome is None:
                    dropped += 1
                    continue
                xyxy, area = outcome
                record.clipped += xyxy != (bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1] + bbox[3])
                record.boxes.append(xyxy)
                record.labels.append(CATEGORY_RECORDS[(cid, name)])
                record.areas.append(area)
                record.crowd.append(bool(extra.get("iscrowd", 0)))
                record.ann_ids.append(ann_id)
            expected.append(record)
            clipped += record.clipped
            count += 1
        coco[split] = {"images": images, "annotations": annotations, "categories": categories}
    return Source(root, coco, expected, clipped, dropped)


def build(source: Source | pathlib.Path, data_dir: pathlib.Path, on_error: str = "fail"):
    root = source.write() if isinstance(source, Source) else source
    return datasets.build("counts", str(data_dir), source=str(root), on_error=on_error)


# Images of several domains: two training domains (stored once, trained on once), a training and
# a target domain (never trained on), two targets (tested on under each), a target and a
# training domain in test (held out, so not in iid).
FULL_LAYOUT = {
    "train": [*counts.DOMAINS, "handmade", "snow", ("street", "road"), ("sky", "Snow")],
    "val": ["snow", "handmade", "snow"],
    "test": [*counts.DOMAINS, ("water", "sky"), ("indoor", "grass"), ("road", "street")],
}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Every domain in train and test, built once for the module."""
    tmp = tmp_path_factory.mktemp("full")
    source = make_source(tmp / "src", FULL_LAYOUT)
    builder = build(source, tmp / "data")
    return source, builder, tmp / "data"


def _records(data_dir: pathlib.Path, split: str) -> dict[int, dict]:
    ds = tfds.load("counts", split=split, data_dir=str(data_dir), download=False)
    return {int(r["image/id"]): r for r in tfds.as_numpy(ds)}


def _check_record(record: dict, want: Expected, label_names) -> None:
    assert record["image/filename"].decode() == want.file_name
    assert counts.DOMAINS[record["domain"]] == counts.canonical_domain(want.domains[0])
    assert [counts.DOMAINS[d] for d in record["domains"]] == list(
        counts.ordered_domains(want.domains)
    )
    image = record["image"]
    assert image.shape == (want.height, want.width, 3)
    with Image.open(io.BytesIO(want.source_bytes)) as source_image:
        source_pixels = np.asarray(source_image.convert("RGB"), np.float32)
    # JPEG sources are stored as they are; PNGs are re-encoded as JPEG, which costs a little.
    tolerance = 8.0 if want.file_name.endswith(".png") else 1.5
    assert np.abs(image.astype(np.float32) - source_pixels).mean() < tolerance
    objects = record["objects"]
    yxyx = objects["bbox"].astype(np.float64).reshape(-1, 4)
    got_xyxy = box_lib.scale(box_lib.yxyx_to_xyxy(yxyx), want.height, want.width)
    np.testing.assert_allclose(got_xyxy, np.array(want.boxes).reshape(-1, 4), atol=1e-3)
    assert [label_names[i] for i in objects["label"]] == want.labels
    np.testing.assert_allclose(objects["area"], want.areas, rtol=1e-6)
    assert objects["is_crowd"].tolist() == want.crowd
    assert objects["id"].tolist() == want.ann_ids


@pytest.mark.slow
def test_records_match_the_source(full):
    source, builder, data_dir = full
    label_names = builder.info.features["objects"]["label"].names
    assert label_names == list(counts.CATEGORIES)
    by_split: dict[str, list[Expected]] = {}
    for want in source.expected:
        by_split.setdefault(counts.split_name(want.split, want.domains), []).append(want)
    # Only the domain sets with images exist; TFDS cannot write an empty split.
    assert sorted(builder.info.splits.keys()) == sorted(by_split)
    checked = 0
    for split, wanted in by_split.items():
        assert builder.info.splits[split].num_examples == len(wanted)
        records = _records(data_dir, split)
        assert sorted(records) == sorted(w.id for w in wanted)
        for want in wanted:
            _check_record(records[want.id], want, label_names)
            checked += 1
    assert checked == len(source.expected) == 38
    assert {"train_street_road", "train_snow_sky", "test_water_sky"} <= set(by_split)
    assert any(w.boxes == [] for w in source.expected)


def test_jpeg_sources_are_stored_byte_for_byte(full):
    source, _, data_dir = full
    ds = tfds.load(
        "counts",
        split="train_snow",
        data_dir=str(data_dir),
        download=False,
        decoders={"image": tfds.decode.SkipDecoding()},
    )
    stored = {int(r["image/id"]): r["image"] for r in tfds.as_numpy(ds)}
    wanted = [w for w in source.expected if w.split == "train" and w.domains == ("snow",)]
    assert len(stored) == len(wanted) == 2
    for want in wanted:
        if want.file_name.endswith(".jpg"):
            assert stored[want.id] == want.source_bytes
        else:
            assert stored[want.id][:2] == b"\xff\xd8"


def test_report_counts_dropped_and_clipped_boxes(full):
    source, builder, _ = full
    assert source.clipped > 0 and source.dropped > 0
    assert builder.report.clipped_boxes == source.clipped
    assert sum(builder.report.dropped_boxes.values()) == source.dropped
    assert builder.report.dropped_boxes["non-positive width or height"] > 0
    assert builder.report.dropped_boxes["outside the image"] > 0
    assert builder.report.skipped_images == []


def test_held_out_splits_are_defined_on_images(full):
    """Train: every training image none of whose domains is a target; target t: every test
    image carrying t; iid: the test images of no target. No image is read twice."""
    source, builder, data_dir = full
    targets = set(counts.PAPER_TARGET_DOMAINS)
    expressions = counts.held_out_split_expressions(builder.info.splits.keys())
    assert set(expressions) == {"train", "iid", *targets}
    for key, expression in expressions.items():
        split = "train" if key == "train" else "test"
        wanted = {
            w.id
            for w in source.expected
            if w.split == split
            and (
                not targets & set(counts.ordered_domains(w.domains))
                if key in ("train", "iid")
                else key in counts.ordered_domains(w.domains)
            )
        }
        ds = tfds.load("counts", split=expression, data_dir=str(data_dir), download=False)
        ids = [int(r["image/id"]) for r in tfds.as_numpy(ds)]
        assert len(ids) == len(set(ids)) and set(ids) == wanted, key
    multi = {w.domains: w.id for w in source.expected if len(w.domains) > 1}
    train_ids = set(_records(data_dir, expressions["train"]))
    assert multi[("street", "road")] in train_ids and multi[("sky", "Snow")] not in train_ids
    assert multi[("water", "sky")] in set(_records(data_dir, expressions["water"]))
    assert multi[("water", "sky")] in set(_records(data_dir, expressions["sky"]))
    assert multi[("indoor", "grass")] not in set(_records(data_dir, expressions["iid"]))
    assert multi[("road", "street")] in set(_records(data_dir, expressions["iid"]))


def test_split_names_read_back():
    for split in counts.SOURCE_SPLITS:
        for domains in (("sky",), ("water", "sky"), tuple(counts.DOMAINS)):
            name = counts.split_name(split, domains)
            assert counts.parse_split_name(name) == (split, counts.ordered_domains(domains))
    assert counts.parse_split_name("train_sky_water") is None  # not in domain order
    assert counts.parse_split_name("train_sky_sky") is None
    assert counts.parse_split_name("iid") is None
    with pytest.raises(ValueError, match="no test image carries sky"):
        counts.held_out_split_expressions(["train_dim", "test_dim"], targets=["sky"])


@pytest.mark.parametrize(
    "value, message",
    [([], "non-empty list"), (["sky", 3], "non-empty list"), (["sky", "moon"], "'moon'")],
)
def test_bad_domain_lists_fail_naming_the_image(tmp_path, value, message):
    source = make_source(tmp_path / "src", {"train": ["sky"]})
    source.coco["train"]["images"][0]["domain"] = value
    with pytest.raises(building.BuildError, match=rf"train.json: images\[0\] .*{message}"):
        build(source, tmp_path / "data")


@pytest.mark.slow
def test_readable_without_ood_jax(full, tmp_path):
    """The records open with plain TFDS in a process that never imports our code."""
    source, builder, _ = full
    got = plain_tfds.detection_records(builder.data_dir, cwd=tmp_path)
    assert len(got) == len(source.expected)
    for want in source.expected:
        record = got[str(want.id)]
        assert record["split"] == counts.split_name(want.split, want.domains)
        assert record["shape"] == [want.height, want.width, 3]
        assert record["labels"] == want.labels


def _assert_nothing_finished(data_dir: pathlib.Path) -> None:
    assert not (data_dir / "counts" / "1.1.0").exists()
    assert list(data_dir.rglob("dataset_info.json")) == []
    leftovers = [p for p in data_dir.rglob("*") if "1.1.0" in p.name]
    assert all("incomplete" in p.name for p in leftovers), leftovers
    with pytest.raises(OSError, match="Could not read dataset info"):
        tfds.builder_from_directory(str(data_dir / "counts" / "1.1.0"))


SMALL_LAYOUT = {"val": ["snow", "dim", "snow"], "test": ["snow", "handmade"]}


def test_corrupt_image_fails_naming_it_and_leaves_no_dataset(tmp_path):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    # The last image of the last split, so some records are written before the failure.
    bad = source.expected[-1]
    (source.root / "images" / bad.file_name).write_bytes(b"not an image at all")
    with pytest.raises(building.BuildError, match=f"{bad.file_name}: corrupt or unreadable"):
        build(source, tmp_path / "data")
    _assert_nothing_finished(tmp_path / "data")


def test_corrupt_image_is_skipped_and_counted(tmp_path):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    bad = source.expected[0]
    (source.root / "images" / bad.file_name).write_bytes(b"\xff\xd8\xff\xe0 truncated")
    builder = build(source, tmp_path / "data", on_error="skip")
    assert [p for p, _ in builder.report.skipped_images] == [
        str(source.root / "images" / bad.file_name)
    ]
    assert builder.info.splits["val_snow"].num_examples == 1
    assert set(_records(tmp_path / "data", "val_snow")) == {source.expected[2].id}


def test_missing_image_fails_naming_it(tmp_path):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    (source.root / "images" / source.expected[1].file_name).unlink()
    with pytest.raises(building.BuildError, match=f"{source.expected[1].file_name}: image file"):
        build(source, tmp_path / "data")
    _assert_nothing_finished(tmp_path / "data")


def test_size_mismatch_fails_or_is_skipped(tmp_path):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    source.coco["val"]["images"][0]["width"] += 3
    name = source.expected[0].file_name
    with pytest.raises(building.BuildError, match=f"{name}: decoded size .* differs"):
        build(source, tmp_path / "data")
    builder = build(source, tmp_path / "skip", on_error="skip")
    assert [p for p, _ in builder.report.skipped_images] == [str(source.root / "images" / name)]
    assert builder.info.splits["val_snow"].num_examples == 1


def test_split_whose_every_image_is_skipped_fails_naming_it(tmp_path):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    (source.root / "images" / source.expected[1].file_name).unlink()
    with pytest.raises(building.BuildError, match="split val_dim: every image was skipped"):
        build(source, tmp_path / "data", on_error="skip")


def test_malformed_json_fails_naming_file_and_reason(tmp_path):
    root = make_source(tmp_path / "src", SMALL_LAYOUT).write()
    (root / "annotations" / "test.json").write_text('{"images": [')
    with pytest.raises(building.BuildError, match=r"test\.json: malformed JSON: .* line 1"):
        build(root, tmp_path / "data")
    _assert_nothing_finished(tmp_path / "data")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda c: c["categories"].append({"id": 77, "name": "toaster"}),
            r"val\.json: categories\[5\]: unknown category 'toaster'",
        ),
        (
            lambda c: c["images"][2].update(domain="underwater"),
            r"val\.json: images\[2\] \(id 207\): unknown domain 'underwater'",
        ),
        (
            lambda c: c["annotations"][1].update(image_id=123456),
            r"val\.json: annotations\[1\]: image_id 123456 is not in the file's images",
        ),
        (
            lambda c: c["annotations"][0].update(category_id=3),
            r"val\.json: annotations\[0\]: category_id 3 is not in the file's categories",
        ),
        (
            lambda c: c["images"][0].pop("file_name"),
            r"val\.json: images\[0\]: missing field 'file_name'",
        ),
        (
            lambda c: c["annotations"][2].update(bbox=[1, 2, 3]),
            r"val\.json: annotations\[2\]: field 'bbox' must be \[x, y, w, h\]",
        ),
        (
            lambda c: c["images"][1].update(id=c["images"][0]["id"]),
            r"val\.json: images\[1\]: duplicate image id",
        ),
    ],
    ids=["category", "domain", "image_id", "category_id", "field", "bbox", "duplicate"],
)
def test_bad_annotations_fail_naming_the_record(tmp_path, mutate, message):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    mutate(source.coco["val"])
    with pytest.raises(building.BuildError, match=message):
        build(source, tmp_path / "data")
    _assert_nothing_finished(tmp_path / "data")


def test_no_annotation_file_fails(tmp_path):
    (tmp_path / "src" / "annotations").mkdir(parents=True)
    with pytest.raises(building.BuildError, match="none of train.json, val.json, test.json"):
        build(tmp_path / "src", tmp_path / "data")


def test_cli_prints_splits_and_report(tmp_path, capsys):
    source = make_source(tmp_path / "src", SMALL_LAYOUT)
    (source.root / "images" / source.expected[0].file_name).write_bytes(b"garbage")
    source.write()
    argv = ["build", "counts", "--source", str(source.root), "--data-dir", str(tmp_path / "d")]
    cli.main([*argv, "--on-error", "skip"])
    printed = capsys.readouterr().out
    assert "examples written: 4 in 4 splits" in printed
    for line in ("val_snow: 1", "val_dim: 1", "test_snow: 1", "test_handmade: 1"):
        assert f"  {line}\n" in printed
    assert "images skipped: 1" in printed
    # The skipped image's boxes are never read, so its clipped boxes are not counted.
    assert source.expected[0].clipped > 0
    clipped = source.clipped - source.expected[0].clipped
    assert f"boxes clipped to the image: {clipped}\n" in printed
    with pytest.raises(SystemExit, match=f"error: .*{source.expected[0].file_name}: corrupt"):
        cli.main([*argv[:-1], str(tmp_path / "d2")])


def test_oodg_reads_every_image_carrying_a_domain(full):
    """`ood-jax mine oodg --domains` draws from the images carrying a domain, however many
    others they carry; an image of several counts as the first asked for."""
    from ood_jax.mining import oodg

    source, builder, _ = full
    records = oodg.read_records(builder, "test", ["sky", "water"])
    carrying = {
        w.id: w for w in source.expected if w.split == "test" and {"sky", "water"} & set(w.domains)
    }
    assert sorted(r.image_id for r in records) == sorted(carrying)
    for record in records:
        domains = counts.ordered_domains(carrying[record.image_id].domains)
        assert record.split == counts.split_name("test", domains)
        assert record.domain == next(d for d in ("water", "sky") if d in domains)
