"""Ids as pycocotools reads them (issue 16): string ids ordered as strings, float ids as
numbers, integral floats as the integers they equal, repeated annotation ids refused, and one
line naming the record, the field and the id for every id pycocotools only reads by accident.

Numbers are checked against pycocotools itself (COCO + loadRes + COCOeval on the same dicts),
the 12 stats to 1e-6 as in tests/metrics/test_coco_parity.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re

import numpy as np
import pytest

pytest.importorskip("pycocotools")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

from ood_jax import cli  # noqa: E402
from ood_jax.metrics import coco as ours  # noqa: E402
from ood_jax.testing.coco_cases import random_case  # noqa: E402

TOL = 1e-6


def pycocotools_stats(gt: dict, dets: list[dict]) -> np.ndarray:
    # pycocotools writes into the dicts it is given: it gets copies.
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = copy.deepcopy(gt)
        coco_gt.createIndex()
        E = COCOeval(coco_gt, coco_gt.loadRes(copy.deepcopy(dets)), "bbox")
        E.evaluate()
        E.accumulate()
        E.summarize()
    return np.asarray(E.stats, np.float64)


def our_stats(gt, dets) -> np.ndarray:
    stats = ours.evaluate(gt, dets)
    return np.array([stats[k] for k in ours.STAT_NAMES])


def assert_parity(gt: dict, dets: list[dict]) -> np.ndarray:
    got, want = our_stats(gt, dets), pycocotools_stats(gt, dets)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    return got


def relabel(gt: dict, dets: list[dict], image=None, category=None, annotation=None):
    """The case with every image, category and annotation id passed through a function."""
    image, category, annotation = (f or (lambda i: i) for f in (image, category, annotation))
    return (
        {
            "images": [dict(im, id=image(im["id"])) for im in gt["images"]],
            "categories": [dict(c, id=category(c["id"])) for c in gt["categories"]],
            "annotations": [
                dict(
                    a,
                    id=annotation(a["id"]),
                    image_id=image(a["image_id"]),
                    category_id=category(a["category_id"]),
                )
                for a in gt["annotations"]
            ],
        },
        [
            dict(d, image_id=image(d["image_id"]), category_id=category(d["category_id"]))
            for d in dets
        ],
    )


def _tied_case(seed: int) -> tuple[dict, list[dict]]:
    # Scores rounded to one decimal tie across images, so the image order shows in AP.
    return random_case(
        seed, num_images=30, num_categories=4, dets_per_image=20, tie_fraction=0.8, tie_decimals=1
    )


def _one_box(image_id, box, ann_id=1, category_id=1) -> dict:
    return dict(
        id=ann_id,
        image_id=image_id,
        category_id=category_id,
        bbox=box,
        area=box[2] * box[3],
        iscrowd=0,
    )


# ------------------------------------------------------------------ string ids
def _tie_across_two_images(first, second) -> tuple[dict, list[dict]]:
    """Image `first` holds one object, found with score 0.5; image `second` none, a false
    positive with the same score: AP is 1 when `first` comes first in the image order, else 0.5."""
    box = [10.0, 10.0, 50.0, 50.0]
    gt = {
        "images": [{"id": first}, {"id": second}],
        "categories": [{"id": 1, "name": "a"}],
        "annotations": [_one_box(first, box)],
    }
    dets = [
        {"image_id": first, "category_id": 1, "bbox": box, "score": 0.5},
        {"image_id": second, "category_id": 1, "bbox": box, "score": 0.5},
    ]
    return gt, dets


def test_string_image_ids_order_as_strings():
    numeric, strings = _tie_across_two_images(2, 10), _tie_across_two_images("2", "10")
    assert pycocotools_stats(*numeric)[0] == pytest.approx(1.0, abs=0.01)
    assert pycocotools_stats(*strings)[0] == pytest.approx(0.5, abs=0.01)  # "10" < "2"
    assert_parity(*numeric)
    assert_parity(*strings)
    assert ours.GroundTruth.from_coco(strings[0]).image_ids.tolist() == ["10", "2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, image",
    [
        ("decimal", str),  # widths 1 to 4: "10" < "9"
        ("prefixed", lambda i: f"img_{i}"),
        ("reversed", lambda i: str(i)[::-1]),  # order unrelated to the number
        ("zero_padded", lambda i: f"{i:06d}"),  # string order is numeric order
    ],
)
def test_string_image_ids_random(name, image):
    differs = 0.0
    for seed in range(4):
        gt, dets = _tied_case(400 + seed)
        numeric = our_stats(gt, dets)
        ids = [im["id"] for im in gt["images"]]
        got = assert_parity(*relabel(gt, dets, image=image))
        if name == "zero_padded":
            np.testing.assert_array_equal(got, numeric)
        else:
            assert sorted(ids, key=image) != sorted(ids)
        differs = max(differs, np.abs(got - numeric).max())
    if name != "zero_padded":
        assert differs > 1e-3, "no case where the string order changes the numbers"


def test_string_category_and_annotation_image_ids():
    gt, dets = _tied_case(410)
    gt, dets = relabel(gt, dets, image=lambda i: f"{i}", category=lambda c: f"cat{c}")
    assert_parity(gt, dets)
    result = ours.evaluate_detailed(gt, dets)
    assert set(result.per_category_ap) == {c["id"] for c in gt["categories"]}


def test_string_image_ids_through_arrays_and_saved_matches():
    gt, dets = relabel(*_tied_case(420), image=str)
    by_image: dict = {}
    for d in dets:
        by_image.setdefault(d["image_id"], []).append(d)
    rows = sorted(by_image)
    q = max(map(len, by_image.values()))
    boxes, scores = np.ones((len(rows), q, 4)), np.zeros((len(rows), q))
    labels = np.full((len(rows), q), gt["categories"][0]["id"])
    valid = np.zeros((len(rows), q), bool)
    for i, image_id in enumerate(rows):
        for j, d in enumerate(by_image[image_id]):
            boxes[i, j], scores[i, j], labels[i, j], valid[i, j] = (
                d["bbox"],
                d["score"],
                d["category_id"],
                True,
            )
    got = ours.evaluate_arrays(gt, np.array(rows), boxes, scores, labels, valid)
    want = ours.evaluate_detailed(gt, dets)
    np.testing.assert_allclose(
        list(got.stats.values()), list(want.stats.values()), atol=TOL, rtol=0
    )

    buffer = io.BytesIO()
    np.savez(buffer, **want.matches.arrays())
    buffer.seek(0)
    with np.load(buffer) as saved:
        back = ours.Matches.from_saved(dict(saved), "matches.npz")
    assert (
        back.image_ids.tolist()
        == want.matches.image_ids.tolist()
        == sorted(im["id"] for im in gt["images"])
    )
    assert back.ground_truth == want.matches.ground_truth


# ------------------------------------------------------------------- float ids
def test_float_ids_hand_case():
    box = [10.0, 10.0, 50.0, 50.0]
    gt = {
        "images": [{"id": 1.25}, {"id": 1.75}],
        "categories": [{"id": 1, "name": "a"}],
        "annotations": [_one_box(1.25, box, ann_id=1), _one_box(1.75, box, ann_id=0.5)],
    }
    dets = [
        {"image_id": 1.25, "category_id": 1, "bbox": box, "score": 0.9},
        {"image_id": 1.75, "category_id": 1, "bbox": box, "score": 0.8},
    ]
    # Two images, and the annotation with id 0.5 is matched (only id 0 reads as unmatched).
    np.testing.assert_allclose(assert_parity(gt, dets)[:3], 1.0)
    assert ours.GroundTruth.from_coco(gt).image_ids.tolist() == [1.25, 1.75]


@pytest.mark.parametrize("seed", range(3))
def test_float_ids_random(seed):
    gt, dets = _tied_case(430 + seed)
    # Fractional image and annotation ids (the first annotation's is 0.5), integral floats
    # that equal the ints of the category ids elsewhere, and an annotation id 0.0 on a
    # matched object, which pycocotools reads as unmatched.
    gt, dets = relabel(
        gt,
        dets,
        image=lambda i: i / 4,
        annotation=lambda a: a - 0.5,
        category=float,
    )
    gt["categories"][0]["id"] = int(gt["categories"][0]["id"])
    anns = gt["annotations"]
    matched = next(a for a in anns if not a["iscrowd"])
    matched["id"] = 0.0
    dets.append(
        dict(
            image_id=matched["image_id"],
            category_id=matched["category_id"],
            bbox=matched["bbox"],
            score=1.0,
        )
    )
    assert any(im["id"] % 1 for im in gt["images"])
    assert_parity(gt, dets)


# ---------------------------------------------------------- repeated annotation ids
def as_pycocotools_reads(gt: dict) -> dict:
    """The ground truth pycocotools evaluates for `gt` with repeated annotation ids, with ids
    made unique: COCOeval._prepare collects the annotations' ids image by image (sorted
    images, file order within one) and loadAnns returns the last annotation with each id, so
    every annotation is replaced by the last one sharing its id."""
    anns = gt["annotations"]
    last = {a["id"]: a for a in anns}
    rank = {i: r for r, i in enumerate(sorted({im["id"] for im in gt["images"]}))}
    slots = sorted(range(len(anns)), key=lambda k: (rank[anns[k]["image_id"]], k))
    return {**gt, "annotations": [dict(last[anns[k]["id"]], id=n + 1) for n, k in enumerate(slots)]}


def test_repeated_annotation_ids_hand_case():
    gt = {
        "images": [{"id": 1}, {"id": 2}],
        "categories": [{"id": 1, "name": "a"}],
        "annotations": [
            _one_box(1, [10, 10, 50, 50], ann_id=1),
            _one_box(2, [100, 100, 50, 50], ann_id=1),
        ],
    }
    dets = [
        {"image_id": 1, "category_id": 1, "bbox": [10, 10, 50, 50], "score": 0.9},
        {"image_id": 2, "category_id": 1, "bbox": [100, 100, 50, 50], "score": 0.8},
    ]
    # pycocotools evaluates image 2's box twice and image 1's not at all: AP 0.25, not 1.
    want = pycocotools_stats(gt, dets)
    assert want[0] == pytest.approx(0.2525, abs=1e-4)
    np.testing.assert_allclose(our_stats(as_pycocotools_reads(gt), dets), want, atol=TOL, rtol=0)
    with pytest.raises(ValueError) as error:
        ours.evaluate(gt, dets)
    assert str(error.value).startswith(
        "annotation 1: id 1 is also the id of annotation 0 (ids used more than once: 1);"
        " pycocotools would evaluate the last annotation of each id once for every annotation"
        " with that id and drop the others; give each annotation its own id"
    )


@pytest.mark.parametrize("kind", ["per_image_from_1", "random_repeats", "int_and_float"])
def test_repeated_annotation_ids_random(kind):
    gt, dets = _tied_case(
        {"per_image_from_1": 440, "random_repeats": 441, "int_and_float": 442}[kind]
    )
    anns = [dict(a) for a in gt["annotations"]]
    r = np.random.default_rng(7)
    if kind == "per_image_from_1":  # a converter numbering every image's objects from 1
        count: dict = {}
        for a in anns:
            count[a["image_id"]] = a["id"] = count.get(a["image_id"], 0) + 1
    elif kind == "random_repeats":
        for a in anns:
            a["id"] = int(r.integers(1, len(anns) // 2))
    else:  # 7 and 7.0 are one dict key
        anns[5]["id"] = float(anns[2]["id"])
    gt = {**gt, "annotations": anns}
    want = pycocotools_stats(gt, dets)
    np.testing.assert_allclose(our_stats(as_pycocotools_reads(gt), dets), want, atol=TOL, rtol=0)
    unique = {**gt, "annotations": [dict(a, id=k + 1) for k, a in enumerate(anns)]}
    if kind != "int_and_float":  # what pycocotools reports is not the ground truth's AP
        assert np.abs(our_stats(unique, dets) - want).max() > 1e-3
    # 7.0 is named 7, the int it equals
    repeats = [k for k, a in enumerate(anns) if a["id"] in {b["id"] for b in anns[:k]}]
    repeated = sorted({int(anns[k]["id"]) for k in repeats})
    first = repeats[0]
    original = next(k for k, a in enumerate(anns) if a["id"] == anns[first]["id"])
    with pytest.raises(ValueError) as error:
        ours.evaluate(gt, dets)
    message = str(error.value)
    assert "\n" not in message
    shown = ", ".join(map(str, repeated[:5])) + (
        f", ... ({len(repeated)} in all)" if len(repeated) > 5 else ""
    )
    assert message.startswith(
        f"annotation {first}: id {int(anns[first]['id'])} is also the id of annotation {original}"
        f" (ids used more than once: {shown}); pycocotools would"
    ), message


# --------------------------------------------------------------------- errors
def _gt_and_dets():
    gt, dets = random_case(3, num_images=6, num_categories=3, dets_per_image=10)
    return copy.deepcopy(gt), [dict(d) for d in dets]


def _set(records, index, **fields):
    records[index] = {**records[index], **fields}


_BAD_DETECTIONS = {
    "no_bbox": (lambda d: d[17].pop("bbox"), r"detection 17: missing field 'bbox'"),
    "no_image_id": (lambda d: d[17].pop("image_id"), r"detection 17: missing field 'image_id'"),
    "string_among_numbers": (
        lambda d: _set(d, 17, image_id="abc"),
        r"detection 17: image_id 'abc' is a string but detection 0's is a number \(\d+\);"
        r" give every image_id as a number or every one as a string",
    ),
    "number_among_strings": (
        lambda d: [_set(d, i, image_id=str(x["image_id"])) for i, x in enumerate(d) if i != 17],
        r"detection 17: image_id \d+ is a number but detection 0's is a string \('\d+'\);"
        r" give every image_id as a number or every one as a string",
    ),
    "all_strings_for_numbers": (
        lambda d: [_set(d, i, image_id=str(x["image_id"])) for i, x in enumerate(d)],
        r"detection 0: image_id '\d+' is not in the ground truth, whose ids are numbers"
        r" \(e\.g\. \d+; \d+ detections affected\)",
    ),
    "none": (
        lambda d: _set(d, 17, category_id=None),
        r"detection 17: category_id None is not a number or a string",
    ),
    "list": (
        lambda d: _set(d, 17, category_id=[1]),
        r"detection 17: category_id \[1\] is not a number or a string",
    ),
    "nan": (
        lambda d: _set(d, 17, image_id=float("nan")),
        r"detection 17: image_id nan is not a finite number",
    ),
    "fraction_not_in_gt": (
        lambda d: _set(d, 17, image_id=d[17]["image_id"] + 0.5),
        r"detection 17: image_id \d+\.5 is not in the ground truth \(1 detections affected\)",
    ),
    "score_string": (
        lambda d: _set(d, 17, score="high"),
        r"detection 17: field 'score' is 'high', expected a number",
    ),
}


@pytest.mark.parametrize("kind", sorted(_BAD_DETECTIONS))
def test_bad_detection_message(kind):
    gt, dets = _gt_and_dets()
    mutate, pattern = _BAD_DETECTIONS[kind]
    mutate(dets)
    with pytest.raises(ValueError) as error:
        ours.evaluate(gt, dets)
    assert "\n" not in str(error.value)
    assert re.fullmatch(pattern, str(error.value)), str(error.value)


_BAD_GROUND_TRUTH = {
    "image_string_among_numbers": (
        lambda g: _set(g["images"], 3, id="abc"),
        r"image 3: id 'abc' is a string but image 0's is a number \(\d+\); give every id as a number"
        r" or every one as a string",
    ),
    "image_nan": (
        lambda g: _set(g["images"], 3, id=float("nan")),
        r"image 3: id nan is not a finite number",
    ),
    "image_no_id": (lambda g: g["images"][2].pop("id"), r"image 2: missing field 'id'"),
    "image_huge": (
        lambda g: _set(g["images"], 2, id=2**64),
        r"image 2: id 18446744073709551616 is outside the int64 range",
    ),
    "category_string_among_numbers": (
        lambda g: _set(g["categories"], 1, id="person"),
        r"category 1: id 'person' is a string but category 0's is a number \(\d+\); .*",
    ),
    "category_no_id": (lambda g: g["categories"][1].pop("id"), r"category 1: missing field 'id'"),
    "category_twice": (
        lambda g: _set(g["categories"], 1, id=g["categories"][0]["id"]),
        r"category 1: id \d+ is also the id of category 0 \(ids used more than once: \d+\); give each its own id",
    ),
    "annotation_string_id": (
        lambda g: _set(g["annotations"], 4, id="a7"),
        r"annotation 4: id 'a7' is not a number",
    ),
    "annotation_image_id_string": (
        lambda g: _set(g["annotations"], 4, image_id="x"),
        r"annotation 4: image_id 'x' is a string but annotation 0's is a number \(\d+\); .*",
    ),
    "annotation_image_id_unknown": (
        lambda g: _set(g["annotations"], 4, image_id=0.5),
        r"annotation 4: image_id 0\.5 is not in the ground truth \(1 annotations affected\)",
    ),
    "annotation_no_bbox": (
        lambda g: g["annotations"][4].pop("bbox"),
        r"annotation 4: missing field 'bbox'",
    ),
    "annotation_id_twice": (
        lambda g: _set(g["annotations"], 5, id=g["annotations"][2]["id"]),
        r"annotation 5: id 3 is also the id of annotation 2 \(ids used more than once: 3\); pycocotools .*",
    ),
}


@pytest.mark.parametrize("kind", sorted(_BAD_GROUND_TRUTH))
def test_bad_ground_truth_message(kind):
    gt, dets = _gt_and_dets()
    mutate, pattern = _BAD_GROUND_TRUTH[kind]
    mutate(gt)
    with pytest.raises(ValueError) as error:
        ours.GroundTruth.from_coco(gt)
    assert "\n" not in str(error.value)
    assert re.fullmatch(pattern, str(error.value)), str(error.value)


def test_pycocotools_drops_detections_whose_ids_are_of_the_other_kind():
    """Why a detection naming category 1 where the ground truth has "1" is an error here:
    pycocotools looks it up under the other key and scores nothing, silently."""
    gt, dets = _tie_across_two_images(1, 2)
    gt = {
        **gt,
        "categories": [{"id": "1", "name": "a"}],
        "annotations": [dict(gt["annotations"][0], category_id="1")],
    }
    assert set(pycocotools_stats(gt, dets)[:3]) == {0.0}
    with pytest.raises(
        ValueError,
        match=r"^detection 0: category_id 1 is not in the ground truth, whose ids are strings",
    ):
        ours.evaluate(gt, dets)
    assert_parity(gt, [dict(d, category_id="1") for d in dets])


def test_cli_names_the_file_at_fault(tmp_path):
    gt, dets = _gt_and_dets()
    gt_path, det_path = tmp_path / "gt.json", tmp_path / "dets.json"
    gt["annotations"][4]["id"] = gt["annotations"][3]["id"]
    gt_path.write_text(json.dumps(gt))
    del dets[17]["bbox"]
    det_path.write_text(json.dumps(dets))
    with pytest.raises(
        SystemExit, match=rf"^error: {re.escape(str(gt_path))}: annotation 4: id 4 is also"
    ):
        cli.main(["coco-eval", "--gt", str(gt_path), "--detections", str(det_path)])
    gt["annotations"][4]["id"] = 5
    gt_path.write_text(json.dumps(gt))
    with pytest.raises(
        SystemExit,
        match=rf"^error: {re.escape(str(det_path))}: detection 17: missing field 'bbox'$",
    ):
        cli.main(["coco-eval", "--gt", str(gt_path), "--detections", str(det_path)])
