"""Builds on Apache Beam (DirectRunner) write exactly what a single-process build writes.

Each builder's fixture is built twice, in this process and with `beam_runner="DirectRunner"`,
and every split's stored examples are compared in file order: TFDS orders a split's examples by
a hash of their keys, so equal files mean equal keys, equal examples and equal shards. Each
fixture holds a corrupt image and is built with on_error="skip", so the same two builds show
that the workers' skips (and dropped and clipped boxes) come back into the report and the
dataset's build record as a single-process build counts them. DirectRunner spends about half a
second per split, so the fixtures are tiny, with few splits; synthetic_shifts' 28 splits (18 s)
are left out.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from ood_jax import cli, datasets
from ood_jax.data import beam as beam_lib
from ood_jax.data import building, counts

BEAM = {"beam_runner": "DirectRunner", "beam_options": "--direct_num_workers=1"}
CORRUPT = b"\xff\xd8 not really a jpeg"


def _write_image(path: pathlib.Path, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 256, (12 + seed, 16 + seed, 3), np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG")


def _records(builder) -> dict[str, tuple[list[int], list[tf.train.Example]]]:
    """Split -> (shard lengths, its examples as stored, in file order)."""
    return {
        name: (
            list(split.shard_lengths),
            # Parsed, as a feature map's serialized order can differ between processes.
            [
                tf.train.Example.FromString(record.numpy())
                for record in tf.data.TFRecordDataset([str(p) for p in split.filepaths])
            ],
        )
        for name, split in builder.info.splits.items()
    }


def _both(tmp_path: pathlib.Path, name: str, **kwargs):
    """(single-process build, Beam build) of the same dataset into two data dirs."""
    return tuple(
        datasets.build(name, str(tmp_path / label), **kwargs, **extra)
        for label, extra in (("single", {}), ("beam", BEAM))
    )


def _assert_same_build(single, beamed) -> None:
    assert _records(beamed) == _records(single)
    assert beamed.report == single.report
    for field in ("examples_per_split", "summary", "digest", "on_error"):
        assert getattr(beamed.provenance, field) == getattr(single.provenance, field), field


# ---------------------------------------------------------------------------------------------
# COUNTS (a split per source split and domain set; boxes dropped and clipped)
# ---------------------------------------------------------------------------------------------

# Source split -> each image's domain field; every image has a box past its edge (clipped) and
# one of zero width (dropped).
COUNTS_LAYOUT = {
    "train": ["snow", "snow", "sky", ["street", "road"], "handmade"],
    "test": ["snow", "water", ["water", "sky"]],
}


def make_counts(root: pathlib.Path) -> None:
    categories = [{"id": 10 + i, "name": name} for i, name in enumerate(counts.CATEGORIES[:3])]
    image_id = 0
    for split, domains in COUNTS_LAYOUT.items():
        images, annotations = [], []
        for domain in domains:
            image_id += 1
            # Every third a PNG, which is re-encoded as JPEG.
            file_name = f"{split}/{image_id}.{'png' if image_id % 3 == 0 else 'jpg'}"
            _write_image(root / "images" / file_name, image_id)
            width, height = 16 + image_id, 12 + image_id
            images.append(
                {"id": image_id, "file_name": file_name, "width": width, "height": height}
                | {"domain": domain}
            )
            for k, bbox in enumerate([[1, 2, 5, 6], [width - 4, 3, 9, 4], [2, 2, 0, 5]]):
                annotations.append(
                    {"id": 100 * image_id + k, "image_id": image_id, "bbox": bbox}
                    | {"category_id": 10 + (image_id + k) % 3}
                )
        coco = {"images": images, "annotations": annotations, "categories": categories}
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"{split}.json").write_text(json.dumps(coco))


@pytest.fixture(scope="module")
def counts_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("counts")
    make_counts(root)
    (root / "images" / "train" / "2.jpg").write_bytes(CORRUPT)
    return root


@pytest.mark.slow
def test_counts_records_and_skips_match(counts_source, tmp_path):
    single, beamed = _both(tmp_path, "counts", source=str(counts_source), on_error="skip")
    _assert_same_build(single, beamed)
    assert [p for p, _ in beamed.report.skipped_images] == [
        str(counts_source / "images" / "train" / "2.jpg")
    ]
    assert beamed.report.clipped_boxes == 7 and sum(beamed.report.dropped_boxes.values()) == 7
    assert beamed.provenance.examples_per_split == {
        "train_snow": 1,
        "train_sky": 1,
        "train_street_road": 1,
        "train_handmade": 1,
        "test_snow": 1,
        "test_water": 1,
        "test_water_sky": 1,
    }


# ---------------------------------------------------------------------------------------------
# FOCI (food101's release layout)
# ---------------------------------------------------------------------------------------------

FOOD101 = ["apple_pie", "baby_back_ribs", "beef_carpaccio", "bibimbap"]


def make_food101(src: pathlib.Path) -> None:
    """Food-101's test list, two images per class, and a FOCI options file for them."""
    entries = {c: [f"{c}/{100 + k}" for k in range(2)] for c in FOOD101}
    (src / "meta").mkdir(parents=True)
    (src / "meta" / "test.json").write_text(json.dumps(entries))
    labels = [c.replace("_", " ") for c in FOOD101]
    options = collections.defaultdict(list)
    for k, (raw, label) in enumerate(zip(FOOD101, labels)):
        for entry in entries[raw]:
            _write_image(src / "images" / f"{entry}.jpg", len(options[label]) + 2 * k)
            negatives = [labels[(k + j) % len(labels)] for j in range(1, 4)]
            options[label].append(
                {
                    "image": f"images/{entry}.jpg",
                    "options": [label, *negatives],
                    "groundtruth": label,
                }
            )
    (src / "foci_options.json").write_text(json.dumps(options))


@pytest.fixture(scope="module")
def food101(tmp_path_factory):
    src = tmp_path_factory.mktemp("food101")
    make_food101(src)
    (src / "images" / "bibimbap" / "101.jpg").write_bytes(CORRUPT)
    return src


def test_foci_records_and_skips_match(food101, tmp_path):
    single, beamed = _both(tmp_path, "foci", source=str(food101), config="food101", on_error="skip")
    _assert_same_build(single, beamed)
    assert [p for p, _ in beamed.report.skipped_images] == [
        str(food101 / "images/bibimbap/101.jpg")
    ]
    assert beamed.info.splits["test"].num_examples == 7


def test_cli_fails_naming_the_image_in_one_line(food101, tmp_path, capsys):
    argv = ["build", "foci", "--config", "food101", "--source", str(food101)]
    argv += ["--data-dir", str(tmp_path), "--beam-runner", "DirectRunner"]
    with pytest.raises(SystemExit) as failed:
        cli.main([*argv, "--beam-options=--direct_num_workers=1"])
    line = str(failed.value)
    assert line.startswith("error: ") and "\n" not in line
    assert f"{food101 / 'images/bibimbap/101.jpg'}: corrupt or unreadable image" in line
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "foci" / "food101" / "1.0.0").exists()


# ---------------------------------------------------------------------------------------------
# OODBench (COCO annotations, three splits)
# ---------------------------------------------------------------------------------------------

CATEGORIES = {1: "cat", 2: "dog", 3: "zebra"}
INSTANCES = {1: {1: 2, 2: 1}, 2: {1: 3, 2: 3}, 3: {1: 1}, 4: {2: 2, 3: 1}, 5: {3: 4, 1: 1}}
SPLIT_LINES = [
    (1, "cat", "ID"),
    (2, "dog", "ID"),
    (2, "cat", "OOD-S"),
    (3, "cat", "OOD-S"),
    (4, "zebra", "OOD-H"),
    (5, "dog", "OOD-H"),
    (3, "dog", "OOD-H"),
]


def make_oodbench(root: pathlib.Path) -> None:
    images, annotations = [], []
    for image_id, instances in INSTANCES.items():
        file_name = f"{image_id:06d}.jpg"
        _write_image(root / "images" / file_name, image_id)
        images.append({"id": image_id, "file_name": file_name, "height": 1, "width": 1})
        for category, n in instances.items():
            annotations += [
                {"image_id": image_id, "category_id": category, "bbox": [1, 2, 5, 6], "iscrowd": 0}
            ] * n
    annotations = [{**a, "id": i + 1} for i, a in enumerate(annotations)]
    categories = [{"id": k, "name": v} for k, v in CATEGORIES.items()]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    lines = [json.dumps({"image_id": i, "category": c, "split": s}) for i, c, s in SPLIT_LINES]
    (root / "splits.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def oodbench_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("oodbench")
    make_oodbench(root)
    # In splits ood_s and ood_h: skipped in both, counted once.
    (root / "images" / "000003.jpg").write_bytes(CORRUPT)
    return root


@pytest.mark.slow
def test_oodbench_records_and_skips_match(oodbench_source, tmp_path):
    single, beamed = _both(tmp_path, "oodbench", source=str(oodbench_source), on_error="skip")
    _assert_same_build(single, beamed)
    assert [p for p, _ in beamed.report.skipped_images] == [
        str(oodbench_source / "images" / "000003.jpg")
    ]
    assert beamed.provenance.examples_per_split == {"id": 4, "ood_s": 2, "ood_h": 4}


@pytest.mark.slow
def test_split_whose_every_image_is_skipped_fails_naming_it(tmp_path):
    src = tmp_path / "src"
    make_oodbench(src)
    for image_id in (3, 4, 5):  # every image of ood_h
        (src / "images" / f"{image_id:06d}.jpg").unlink()
    with pytest.raises(building.BuildError, match=r"split ood_h: every image was skipped \(3\)"):
        datasets.build("oodbench", str(tmp_path / "data"), source=str(src), on_error="skip", **BEAM)
    assert not (tmp_path / "data" / "oodbench" / "default" / "1.0.0").exists()


def test_beam_options_need_a_runner(tmp_path):
    with pytest.raises(building.BuildError, match="--beam-options needs --beam-runner"):
        datasets.build("synthetic_shifts", str(tmp_path), config="tiny", beam_options="--a=b")


def test_beam_options_are_flags():
    options = beam_lib.options("--direct_num_workers=3 --job_name='a b'").get_all_options()
    assert (options["direct_num_workers"], options["job_name"]) == (3, "a b")
