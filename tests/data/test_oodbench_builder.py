"""The OODBench builder on tiny COCO and LVIS release trees, read back with plain TFDS.

Expected answers are computed here from the annotation tables, not with the builder's code.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax import datasets
from ood_jax.data import building
from ood_jax.data import oodbench as oodbench_source
from tfds_builders.oodbench import oodbench_dataset_builder as oodbench

CATEGORIES = {1: "cat", 2: "dog", 3: "traffic light", 4: "zebra", 5: "person"}
# image id -> {category id: non-crowd instances}; (image, category) pairs with a crowd box.
INSTANCES = {
    1: {1: 2, 2: 1},
    2: {1: 3, 2: 3},
    3: {1: 1},
    4: {2: 2, 3: 1, 5: 2},
    5: {4: 4, 1: 1},
    6: {},
}
CROWD = {(4, 5)}
SPLIT_LINES = [
    (1, "cat", "ID"),
    (1, "zebra", "ID"),
    (6, "dog", "ID"),
    (2, "dog", "ID"),
    (2, "cat", "OOD-S"),
    (3, "cat", "OOD-S"),
    (4, "person", "OOD-S"),
    (5, "dog", "OOD-S"),
    (4, "traffic light", "OOD-H"),
    (5, "zebra", "OOD-H"),
    (3, "dog", "OOD-H"),
]
TFDS_SPLIT = {"ID": "id", "OOD-S": "ood_s", "OOD-H": "ood_h"}


def _write_image(path: pathlib.Path, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    height, width = 24 + 2 * seed, 32 + seed
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG")
    return height, width


def _write_splits(root: pathlib.Path, lines) -> None:
    text = "".join(
        json.dumps({"image_id": i, "category": c, "split": s}) + "\n" for i, c, s in lines
    )
    (root / "splits.jsonl").write_text(text)


@pytest.fixture
def coco_source(tmp_path) -> pathlib.Path:
    root = tmp_path / "coco"
    images, annotations = [], []
    for image_id, counts in INSTANCES.items():
        file_name = f"{image_id:06d}.jpg"
        height, width = _write_image(root / "images" / file_name, image_id)
        images.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
        for category, n in counts.items():
            for _ in range(n):
                box = [1.0, 2.0, 5.0, 6.0]
                annotations.append({"image_id": image_id, "category_id": category, "bbox": box})
    for image_id, category in sorted(CROWD):
        annotations.append(
            {"image_id": image_id, "category_id": category, "bbox": [0, 0, 9, 9], "iscrowd": 1}
        )
    for i, annotation in enumerate(annotations):
        annotation.setdefault("iscrowd", 0)
        annotation["id"] = i + 1
    categories = [{"id": k, "name": v, "supercategory": "x"} for k, v in CATEGORIES.items()]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    _write_splits(root, SPLIT_LINES)
    return root


def _build(source: pathlib.Path, data_dir: pathlib.Path, config: str | None = None, **kwargs):
    return datasets.build("oodbench", str(data_dir), source=str(source), config=config, **kwargs)


def _read(data_dir: pathlib.Path, config: str) -> dict[str, list[dict]]:
    builder = tfds.builder_from_directory(str(data_dir / "oodbench" / config / "1.0.0"))
    return {
        split: list(tfds.as_numpy(builder.as_dataset(split=split)))
        for split in ("id", "ood_s", "ood_h")
    }


def _count(image_id: int, category: int) -> int:
    """Instances, or -1 where a crowd box makes the number unknown."""
    if (image_id, category) in CROWD:
        return -1
    return INSTANCES[image_id].get(category, 0)


def _present(image_id: int, category: int) -> bool:
    return category in INSTANCES[image_id] or (image_id, category) in CROWD


def test_yes_no_records_match_annotations(coco_source, tmp_path):
    builder = _build(coco_source, tmp_path / "data")
    records = _read(tmp_path / "data", "default")
    ids = {name: k for k, name in CATEGORIES.items()}
    for split, tfds_split in TFDS_SPLIT.items():
        expected = collections.Counter()
        for image_id, name, line_split in SPLIT_LINES:
            if line_split != split:
                continue
            present, count = _present(image_id, ids[name]), _count(image_id, ids[name])
            expected[(image_id, name, f"Does this image contain a {name}? (yes or no)",
                      "yes" if present else "no", count, "existential")] += 1  # fmt: skip
            expected[(image_id, name, f"Does this image not contain a {name}? (yes or no)",
                      "no" if present else "yes", count, "negated existential")] += 1  # fmt: skip
        got = collections.Counter(
            (
                int(r["image/id"]),
                r["category"].decode(),
                r["question"].decode(),
                ["no", "yes"][r["answer"]],
                int(r["count"]),
                r["kind"].decode(),
            )
            for r in records[tfds_split]
        )
        assert got == expected, split
        for r in records[tfds_split]:
            source = np.asarray(Image.open(coco_source / "images" / f"{r['image/id']:06d}.jpg"))
            assert r["image"].shape == source.shape
            assert np.abs(r["image"].astype(int) - source).mean() < 2.0

    # Each instance gives one yes and one no.
    for split_records in records.values():
        by_instance = collections.defaultdict(list)
        for r in split_records:
            by_instance[(int(r["image/id"]), r["category"])].append(int(r["answer"]))
        assert all(sorted(answers) == [0, 1] for answers in by_instance.values())
    all_answers = [int(r["answer"]) for rs in records.values() for r in rs]
    assert all_answers.count(0) == all_answers.count(1) == len(SPLIT_LINES)
    assert builder.report.notes[oodbench.UNDEFINED_COUNT] == 1
    assert not builder.report.skipped_images


def test_bap_questions(coco_source, tmp_path):
    builder = _build(coco_source, tmp_path / "data", config="bap")
    records = _read(tmp_path / "data", "bap")
    ids = {name: k for k, name in CATEGORIES.items()}
    levels = ["existential", "counting", "logical"]
    expected_images = {"id": {1, 2}, "ood_s": {2, 4}, "ood_h": {4, 5}}
    skipped_counting = skipped_logical = 0
    for split, split_records in records.items():
        samples = collections.defaultdict(list)
        for r in split_records:
            samples[int(r["image/id"])].append(
                (levels[r["level"]], r["question"].decode(), r["answer"].decode(),
                 [c.decode() for c in r["categories"]])
            )  # fmt: skip
        assert set(samples) == expected_images[split]
        for image_id, questions in samples.items():
            instance_names = {
                c for i, c, s in SPLIT_LINES if i == image_id and TFDS_SPLIT[s] == split
            }
            pair = sorted(q[3][0] for q in questions if q[0] == "existential")
            assert len(set(pair)) == 2 and set(pair) & instance_names
            assert all(_present(image_id, ids[name]) for name in pair)
            # Records come back shuffled; only the logical question says which one is A.
            order = [q[3] for q in questions if q[0] == "logical"]
            if order:
                assert sorted(order[0]) == pair and order[0][0] in instance_names
                pair = order[0]
            expected = set()
            for name in pair:
                expected.add(("existential", f"Is there a {name} in the image?", "yes", (name,)))
                count = _count(image_id, ids[name])
                if count < 0:
                    skipped_counting += 1
                    continue
                question = f"How many {name} are there in the image?"
                expected.add(("counting", question, str(count), (name,)))
            counts = [_count(image_id, ids[name]) for name in pair]
            if min(counts) < 0:
                skipped_logical += 1
            else:
                question = (
                    f"Is the number of {pair[0]} in the image greater than the number of "
                    f"{pair[1]}? Answer with 'yes' or 'no'"
                )
                answer = "yes" if counts[0] > counts[1] else "no"
                expected.add(("logical", question, answer, tuple(pair)))
            assert {(q[0], q[1], q[2], tuple(q[3])) for q in questions} == expected
    # Pairs the image fixes: A must be the instance's category.
    logical = {
        (split, int(r["image/id"])): (r["question"].decode(), r["answer"].decode())
        for split, rs in records.items()
        for r in rs
        if r["level"] == 2
    }
    question = (
        "Is the number of cat in the image greater than the number of dog? "
        "Answer with 'yes' or 'no'"
    )
    assert logical[("id", 1)] == (question, "yes")
    assert logical[("id", 2)][1] == logical[("ood_s", 2)][1] == "no"  # a 3-3 tie
    assert logical[("ood_h", 5)][1] == "yes"
    notes = builder.report.notes
    assert notes[oodbench.FEW_CATEGORIES] == 3  # image 6 in ID, image 3 in OOD-S and OOD-H
    assert notes[oodbench.NO_PRESENT_INSTANCE] == 1  # image 5 in OOD-S: its dog is absent
    assert notes[oodbench.SKIPPED_COUNTING] == skipped_counting >= 1
    assert notes[oodbench.SKIPPED_LOGICAL] == skipped_logical >= 1

    # The seeded pair choice is the same in a second build.
    _build(coco_source, tmp_path / "again", config="bap")
    again = _read(tmp_path / "again", "bap")
    for split in records:
        first = sorted((int(r["image/id"]), r["question"]) for r in records[split])
        assert sorted((int(r["image/id"]), r["question"]) for r in again[split]) == first


def test_lvis_source(tmp_path):
    root = tmp_path / "lvis"
    categories = [
        {"id": 1, "name": "baseball_bat", "synonyms": ["baseball_bat"]},
        {"id": 2, "name": "apple", "synonyms": ["apple", "pome"]},
        {"id": 3, "name": "banana", "synonyms": ["banana"]},
        {"id": 4, "name": "kite", "synonyms": ["kite"]},
    ]
    url = "http://images.cocodataset.org/val2017/{:012d}.jpg"
    images = [
        {"id": 101, "coco_url": url.format(101), "neg_category_ids": [4],
         "not_exhaustive_category_ids": [2]},
        {"id": 102, "coco_url": url.format(102), "neg_category_ids": [1],
         "not_exhaustive_category_ids": []},
    ]  # fmt: skip
    for image in images:
        _write_image(root / "images" / f"{image['id']:012d}.jpg", image["id"] % 7)
    annotations = [
        {"id": 1, "image_id": 101, "category_id": 1, "bbox": [1, 1, 3, 3]},
        {"id": 2, "image_id": 101, "category_id": 1, "bbox": [2, 2, 3, 3]},
        {"id": 3, "image_id": 101, "category_id": 2, "bbox": [4, 4, 3, 3]},
        {"id": 4, "image_id": 102, "category_id": 3, "bbox": [1, 1, 3, 3]},
        {"id": 5, "image_id": 102, "category_id": 3, "bbox": [2, 2, 3, 3]},
        {"id": 6, "image_id": 102, "category_id": 3, "bbox": [3, 3, 3, 3]},
    ]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    _write_splits(
        root,
        [
            (101, "baseball_bat", "ID"),  # present, 2
            (101, "kite", "OOD-S"),  # verified absent
            (101, "banana", "OOD-H"),  # unverified: skipped
            (102, "baseball_bat", "OOD-S"),  # verified absent
            (102, "banana", "OOD-H"),  # present, 3
            (101, "pome", "OOD-H"),  # a synonym of apple: present, not exhaustively annotated
        ],
    )
    builder = _build(root, tmp_path / "data")
    records = _read(tmp_path / "data", "default")
    got = {
        split: {
            (int(r["image/id"]), r["category"].decode(), int(r["count"]), int(r["answer"]))
            for r in rs
            if r["kind"] == b"existential"
        }
        for split, rs in records.items()
    }
    assert got == {
        "id": {(101, "baseball_bat", 2, 1)},
        "ood_s": {(101, "kite", 0, 0), (102, "baseball_bat", 0, 0)},
        "ood_h": {(102, "banana", 3, 1), (101, "apple", -1, 1)},
    }
    questions = {r["question"].decode() for rs in records.values() for r in rs}
    assert "Does this image contain a baseball bat? (yes or no)" in questions
    assert builder.report.notes[oodbench.UNKNOWN_PRESENCE] == 1


def test_lvis_images_from_both_coco_folders(tmp_path):
    # LVIS v1 val takes images from COCO train2017 and val2017: SRC/images/ may hold the two
    # folders side by side, found through each image's coco_url; a flat file still comes first.
    root = tmp_path / "lvis"
    categories = [{"id": 1, "name": "kite", "synonyms": ["kite"]}]
    url = "http://images.cocodataset.org/{}/{:012d}.jpg"
    folders = {201: "train2017", 202: "val2017", 203: "val2017"}
    images = [
        {
            "id": i,
            "coco_url": url.format(f, i),
            "neg_category_ids": [],
            "not_exhaustive_category_ids": [],
        }
        for i, f in folders.items()
    ]
    _write_image(root / "images" / "train2017" / f"{201:012d}.jpg", 1)
    _write_image(root / "images" / "val2017" / f"{202:012d}.jpg", 2)
    _write_image(root / "images" / f"{203:012d}.jpg", 3)  # flat
    _write_image(root / "images" / "train2017" / f"{203:012d}.jpg", 4)  # not this one
    annotations = [
        {"id": k, "image_id": i, "category_id": 1, "bbox": [1, 1, 3, 3]}
        for k, i in enumerate(folders, start=1)
    ]
    data = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations.json").write_text(json.dumps(data))
    _, _, read = oodbench_source.read_annotations(root / "annotations.json")
    paths = {i: oodbench_source.image_path(root / "images", read[i]) for i in folders}
    assert paths == {
        201: root / "images" / "train2017" / f"{201:012d}.jpg",
        202: root / "images" / "val2017" / f"{202:012d}.jpg",
        203: root / "images" / f"{203:012d}.jpg",
    }
    _write_splits(root, [(201, "kite", "ID"), (202, "kite", "OOD-S"), (203, "kite", "OOD-H")])
    _build(root, tmp_path / "data")
    records = _read(tmp_path / "data", "default")
    assert {int(r["image/id"]) for rs in records.values() for r in rs} == set(folders)


def _replace_line(number: int, text: str):
    def edit(root: pathlib.Path) -> None:
        lines = (root / "splits.jsonl").read_text().splitlines()
        lines[number - 1] = text
        (root / "splits.jsonl").write_text("\n".join(lines) + "\n")

    return edit


def _line(image_id, category, split) -> str:
    return json.dumps({"image_id": image_id, "category": category, "split": split})


@pytest.mark.parametrize(
    "edit, message",
    [
        (_replace_line(3, _line(999, "dog", "ID")), r"splits.jsonl: line 3: unknown image_id 999"),
        (_replace_line(2, _line(1, "unicorn", "ID")), r"splits.jsonl: line 2: unknown category"),
        (_replace_line(5, _line(2, "cat", "OOD-X")), r"splits.jsonl: line 5: unknown split 'OOD-X'"),
        (_replace_line(4, _line(1, "cat", "OOD-H")), r"line 4: image 1 .* already on line 1"),
        (_replace_line(2, '{"image_id": 1,'), r"splits.jsonl: malformed JSON on line 2"),
        (lambda root: (root / "annotations.json").write_text('{"images": ['),
         r"annotations.json: malformed JSON"),
    ],
)  # fmt: skip
def test_bad_source_names_the_place(coco_source, tmp_path, edit, message):
    edit(coco_source)
    with pytest.raises(building.BuildError, match=message):
        _build(coco_source, tmp_path / "data")
    assert not (tmp_path / "data" / "oodbench" / "default" / "1.0.0").exists()


def test_split_without_questions_fails_naming_it(coco_source, tmp_path):
    # Image 6 has no annotated category, so BAP asks nothing about it: OOD-H gets no question.
    _write_splits(coco_source, [(1, "cat", "ID"), (2, "dog", "OOD-S"), (6, "dog", "OOD-H")])
    message = r"split ood_h would be empty: none of its 1 instances in .*splits.jsonl gives"
    with pytest.raises(building.BuildError, match=message):
        _build(coco_source, tmp_path / "data", config="bap")
    _write_splits(coco_source, [(1, "cat", "ID"), (6, "dog", "OOD-H")])
    with pytest.raises(building.BuildError, match=r"split ood_s would be empty: .* no line with"):
        _build(coco_source, tmp_path / "data", config="bap")
    assert not (tmp_path / "data" / "oodbench" / "bap" / "1.0.0").exists()


def test_split_whose_every_image_is_skipped_fails(coco_source, tmp_path):
    (coco_source / "images" / "000004.jpg").unlink()
    (coco_source / "images" / "000005.jpg").unlink()
    _write_splits(coco_source, [(1, "cat", "ID"), (2, "cat", "OOD-S"), (4, "dog", "OOD-H")])
    with pytest.raises(building.BuildError, match=r"split ood_h: every image was skipped \(1\)"):
        _build(coco_source, tmp_path / "data", on_error="skip")


def test_corrupt_image_fails_or_is_skipped(coco_source, tmp_path):
    (coco_source / "images" / "000002.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (coco_source / "images" / "000005.jpg").unlink()
    with pytest.raises(building.BuildError, match=r"00000[25]\.jpg"):
        _build(coco_source, tmp_path / "failed")
    builder = _build(coco_source, tmp_path / "data", on_error="skip")
    # Image 2 is in two splits and image 5 in two: each is counted once.
    skipped = sorted(pathlib.Path(path).name for path, _ in builder.report.skipped_images)
    assert skipped == ["000002.jpg", "000005.jpg"]
    records = _read(tmp_path / "data", "default")
    written = {int(r["image/id"]) for rs in records.values() for r in rs}
    assert written == {1, 3, 4, 6}
