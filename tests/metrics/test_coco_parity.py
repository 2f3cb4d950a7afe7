"""Randomized parity of ``ood_jax.metrics.coco`` with pycocotools' COCOeval (bbox).

Every case comes from ``ood_jax.testing.coco_cases.random_case`` (crowd regions,
area != w*h, tied scores, >100 detections per image-category group, images and
categories without ground truth, exact-threshold IoUs, ...) or is built by hand
for the degenerate cases (no detections, every detection ignored, crowd-only
ground truth). All 12 summary numbers and the per-category AP must agree with
pycocotools to 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math

import numpy as np
import pytest

pytest.importorskip("pycocotools")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

from ood_jax.metrics import coco as ours  # noqa: E402
from ood_jax.testing.coco_cases import case_summary, random_case  # noqa: E402

TOL = 1e-6
STAT_NAMES = (
    "AP",
    "AP50",
    "AP75",
    "APs",
    "APm",
    "APl",
    "AR1",
    "AR10",
    "AR100",
    "ARs",
    "ARm",
    "ARl",
)
# area ranges of the 12 stats: all, small, medium, large
_AREA_RNG = {
    "all": (0.0, 1e5**2),
    "small": (0.0, 32.0**2),
    "medium": (32.0**2, 96.0**2),
    "large": (96.0**2, 1e5**2),
}
_STAT_AREA = (
    "all",
    "all",
    "all",
    "small",
    "medium",
    "large",
    "all",
    "all",
    "all",
    "small",
    "medium",
    "large",
)


# --------------------------------------------------------------------- helpers
def _copy_gt(gt: dict) -> dict:
    # pycocotools writes 'ignore' into gt annotations and 'id'/'area'/'iscrowd'/
    # 'segmentation' into detections: give it copies so our inputs stay pristine.
    return {**gt, "annotations": [dict(a) for a in gt["annotations"]]}


def pycocotools_eval(gt: dict, detections: list[dict]) -> tuple[np.ndarray, dict]:
    """Run pycocotools; return (12 stats, {category_id: AP}).

    Per-category AP is ``E.eval['precision'][:, :, k, 0, -1]`` averaged over the
    entries > -1 (area all, maxDets 100), -1.0 when there are none. An empty
    detection list (which ``loadRes`` cannot load) is evaluated through an empty
    result COCO object built by hand.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = _copy_gt(gt)
        coco_gt.createIndex()
        if detections:
            coco_dt = coco_gt.loadRes([dict(d) for d in detections])
        else:
            coco_dt = COCO()
            coco_dt.dataset = {
                "images": list(gt["images"]),
                "categories": copy.deepcopy(gt["categories"]),
                "annotations": [],
            }
            coco_dt.createIndex()
        E = COCOeval(coco_gt, coco_dt, "bbox")
        E.evaluate()
        E.accumulate()
        E.summarize()
    precision = E.eval["precision"]
    per_cat = {}
    for k, cat_id in enumerate(E.params.catIds):
        p = precision[:, :, k, 0, -1]
        p = p[p > -1]
        per_cat[int(cat_id)] = float(np.mean(p)) if p.size else -1.0
    return np.asarray(E.stats, np.float64), per_cat


def _stats_vec(stats: dict) -> np.ndarray:
    assert tuple(stats) == STAT_NAMES, f"stats keys {tuple(stats)} != {STAT_NAMES}"
    return np.array([float(stats[k]) for k in STAT_NAMES], np.float64)


def assert_stats_close(label: str, got: dict, want: np.ndarray, tol: float = TOL) -> None:
    g = _stats_vec(got)
    bad = [
        f"{n}: ours={g[i]!r} pycocotools={want[i]!r} (diff {abs(g[i] - want[i]):.3g})"
        for i, n in enumerate(STAT_NAMES)
        if not abs(g[i] - want[i]) <= tol
    ]
    assert not bad, f"[{label}] stats differ:\n  " + "\n  ".join(bad)


def assert_per_cat_close(label: str, got: dict, want: dict, tol: float = TOL) -> None:
    got = {int(k): float(v) for k, v in got.items()}
    assert set(got) == set(want), (
        f"[{label}] per-category keys: ours {sorted(got)} vs pycocotools {sorted(want)}"
    )
    bad = [
        f"category {c}: ours={got[c]!r} pycocotools={want[c]!r}"
        for c in sorted(want)
        if not abs(got[c] - want[c]) <= tol
    ]
    assert not bad, f"[{label}] per-category AP differs:\n  " + "\n  ".join(bad)


def check_parity(label: str, gt: dict, dets: list[dict]) -> None:
    want_stats, want_cat = pycocotools_eval(gt, dets)
    res = ours.evaluate_detailed(gt, dets)
    assert_stats_close(label, res.stats, want_stats)
    assert_per_cat_close(label, res.per_category_ap, want_cat)


def expected_without_true_positives(gt: dict) -> tuple[np.ndarray, dict]:
    """COCOeval's result when no detection can count (no detections at all, or
    every detection ignored): a stat is 0 when its area range holds a non-crowd
    gt (of any category), else -1; a category's AP is 0 when it has a non-crowd
    gt, else -1."""
    regular = [a for a in gt["annotations"] if not a["iscrowd"]]
    stats = []
    for rng_name in _STAT_AREA:
        lo, hi = _AREA_RNG[rng_name]
        stats.append(0.0 if any(lo <= a["area"] <= hi for a in regular) else -1.0)
    with_gt = {a["category_id"] for a in regular}
    per_cat = {c["id"]: (0.0 if c["id"] in with_gt else -1.0) for c in gt["categories"]}
    return np.array(stats), per_cat


# ------------------------------------------------------- randomized small cases
def _random_kwargs(seed: int) -> dict:
    r = np.random.default_rng(10_000 + seed)
    return dict(
        num_images=int(r.integers(20, 46)),
        num_categories=int(r.integers(2, 10)),
        gt_per_image=float(r.uniform(2, 9)),
        dets_per_image=int(r.integers(10, 61)),
        crowd_fraction=float(r.choice([0.0, 0.03, 0.1])),
        tie_fraction=float(r.choice([0.05, 0.1, 0.3, 0.6])),
        tie_decimals=int(r.choice([1, 2, 2])),
        empty_image_fraction=float(r.choice([0.0, 0.1, 0.3])),
        unused_category_fraction=float(r.choice([0.0, 0.1, 0.3])),
        detection_only_category_fraction=float(r.choice([0.0, 0.1, 0.3])),
        big_group_fraction=float(r.choice([0.0, 0.05, 0.15])),
        snap_fraction=float(r.choice([0.0, 0.1, 0.5])),
        exact_iou_fraction=float(r.choice([0.0, 0.03, 0.2])),
        equal_iou_fraction=float(r.choice([0.0, 0.02, 0.1])),
        area_scale=[(0.3, 1.0), (0.05, 2.0)][int(r.integers(2))],
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_parity_random(seed):
    kw = _random_kwargs(seed)
    gt, dets = random_case(seed, **kw)
    check_parity(f"seed={seed} {kw}", gt, dets)


EMPHASIS = {
    "crowd_regions": dict(crowd_fraction=0.3, num_images=30),
    "area_not_wh": dict(area_scale=(0.05, 3.0), boundary_area_fraction=0.3),
    "area_on_thresholds": dict(boundary_area_fraction=0.8, snap_fraction=0.5),
    "tied_scores": dict(tie_fraction=1.0, tie_decimals=1),
    "tied_scores_duplicates": dict(tie_fraction=0.5, tie_decimals=1, duplicate_det_fraction=0.25),
    "over_100_dets_per_group": dict(big_group_fraction=0.6, dets_per_image=60),
    "images_without_gt": dict(empty_image_fraction=0.6),
    "categories_without_gt": dict(
        num_categories=12, unused_category_fraction=0.25, detection_only_category_fraction=0.25
    ),
    "exact_iou_thresholds": dict(exact_iou_fraction=0.6, snap_fraction=0.7),
    "duplicate_gt_boxes": dict(duplicate_gt_fraction=0.3, snap_fraction=0.5),
    "equal_iou_twins": dict(equal_iou_fraction=0.4),
    "wrong_categories": dict(wrong_category_fraction=0.7),
    "few_dets_per_image": dict(dets_per_image=4, copies_per_gt=0.3),
    "many_categories": dict(num_categories=30, num_images=20, gt_per_image=12),
    "single_image": dict(num_images=1, dets_per_image=150, big_group_fraction=1.0),
    "single_category": dict(num_categories=1),
    "clean": dict(
        crowd_fraction=0.0,
        tie_fraction=0.0,
        empty_image_fraction=0.0,
        unused_category_fraction=0.0,
        detection_only_category_fraction=0.0,
        big_group_fraction=0.0,
        snap_fraction=0.0,
        exact_iou_fraction=0.0,
        equal_iou_fraction=0.0,
        boundary_area_fraction=0.0,
        duplicate_gt_fraction=0.0,
        duplicate_det_fraction=0.0,
        shuffle=False,
    ),
    "everything_at_once": dict(
        num_images=60,
        num_categories=10,
        crowd_fraction=0.15,
        tie_fraction=0.5,
        tie_decimals=1,
        empty_image_fraction=0.2,
        unused_category_fraction=0.2,
        detection_only_category_fraction=0.2,
        big_group_fraction=0.2,
        snap_fraction=0.3,
        exact_iou_fraction=0.2,
        equal_iou_fraction=0.1,
        boundary_area_fraction=0.1,
        duplicate_gt_fraction=0.1,
        duplicate_det_fraction=0.1,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EMPHASIS))
def test_parity_emphasis(name):
    kw = dict(num_images=40, dets_per_image=40)
    kw.update(EMPHASIS[name])
    gt, dets = random_case(1000 + sorted(EMPHASIS).index(name), **kw)
    check_parity(f"{name} {kw}", gt, dets)


def test_emphasis_cases_have_their_feature():
    """Guard against the generator silently losing the features the cases target."""

    def summ(name):
        kw = dict(num_images=40, dets_per_image=40)
        kw.update(EMPHASIS[name])
        return case_summary(*random_case(1000 + sorted(EMPHASIS).index(name), **kw))

    assert summ("crowd_regions")["crowd"] >= 20
    assert summ("area_not_wh")["area_range_differs_from_box"] >= 20
    assert summ("area_on_thresholds")["area_on_threshold"] >= 20
    assert summ("tied_scores")["tied_scores"] >= 500
    assert summ("over_100_dets_per_group")["groups_over_100"] >= 10
    assert summ("images_without_gt")["images_without_gt"] >= 20
    s = summ("categories_without_gt")
    assert s["categories_without_gt"] >= 4 and s["categories_without_gt_with_dets"] >= 2
    s = summ("everything_at_once")
    assert (
        not s["image_ids_sorted"]
        and not s["category_ids_contiguous"]
        and not s["category_ids_sorted"]
    )
    assert s["images_without_gt_or_dets"] >= 1


# ------------------------------------------------------------ degenerate cases
def test_no_detections():
    gt, _ = random_case(7, num_images=25, num_categories=6, crowd_fraction=0.1)
    want_stats, want_cat = expected_without_true_positives(gt)
    # known pycocotools semantics, checked explicitly ...
    res = ours.evaluate_detailed(gt, [])
    assert_stats_close("no detections (explicit)", res.stats, want_stats, tol=0.0)
    assert_per_cat_close("no detections (explicit)", res.per_category_ap, want_cat, tol=0.0)
    assert 0.0 in want_stats and -1.0 in want_cat.values()
    # ... and against pycocotools fed an empty result object (loadRes([]) raises)
    pc_stats, pc_cat = pycocotools_eval(gt, [])
    np.testing.assert_array_equal(pc_stats, want_stats)
    assert pc_cat == want_cat
    assert_stats_close("no detections", ours.evaluate(gt, []), pc_stats)


def test_no_detections_through_arrays():
    gt, _ = random_case(8, num_images=10, num_categories=4)
    want_stats, want_cat = expected_without_true_positives(gt)
    n, q = 3, 5
    image_ids = np.array([im["id"] for im in gt["images"][:n]], np.int64)
    boxes = np.tile(np.array([10.0, 10.0, 50.0, 40.0]), (n, q, 1))
    scores = np.full((n, q), 0.5)
    labels = np.full((n, q), gt["categories"][0]["id"], np.int64)
    res = ours.evaluate_arrays(gt, image_ids, boxes, scores, labels, np.zeros((n, q), bool))
    assert_stats_close("arrays, all padding", res.stats, want_stats, tol=0.0)
    assert_per_cat_close("arrays, all padding", res.per_category_ap, want_cat, tol=0.0)


def test_no_ground_truth_annotations():
    gt, dets = random_case(9, num_images=10, num_categories=4, dets_per_image=20)
    gt = {**gt, "annotations": []}
    pc_stats, pc_cat = pycocotools_eval(gt, dets)
    assert set(pc_stats.tolist()) == {-1.0} and set(pc_cat.values()) == {-1.0}
    check_parity("no gt annotations", gt, dets)
    res = ours.evaluate_detailed(gt, [])
    assert_stats_close("no gt annotations, no detections", res.stats, pc_stats, tol=0.0)


def _all_ignored_case(seed: int) -> tuple[dict, list[dict]]:
    """Regular objects on the left of each image, a crowd region on the right, and
    every detection strictly inside a crowd region of its category: every
    detection is matched to a crowd gt, hence ignored, in every area range."""
    r = np.random.default_rng(seed)
    cat_ids = [9, 2, 5]  # category 5: crowd regions only (no non-crowd gt)
    images = [
        {"id": 1000 - 37 * i, "width": 640, "height": 480, "file_name": f"{i}.jpg"}
        for i in range(15)
    ]
    anns, dets = [], []
    for im in images:
        for c in cat_ids:
            if c != 5:
                for _ in range(int(r.integers(1, 4))):
                    w, h = r.uniform(4, 140), r.uniform(4, 140)
                    x, y = r.uniform(0, 250 - min(w, 249)), r.uniform(0, 480 - h)
                    area = w * h * r.uniform(0.3, 1.0)
                    anns.append(
                        dict(
                            image_id=im["id"],
                            category_id=c,
                            bbox=[x, y, w, h],
                            area=area,
                            iscrowd=0,
                        )
                    )
            cx, cy = r.uniform(300, 400), r.uniform(0, 200)
            cw, ch = r.uniform(100, 640 - cx), r.uniform(100, 480 - cy)
            anns.append(
                dict(
                    image_id=im["id"],
                    category_id=c,
                    bbox=[cx, cy, cw, ch],
                    area=cw * ch * 0.7,
                    iscrowd=1,
                )
            )
            for _ in range(int(r.integers(2, 40))):
                w, h = cw * r.uniform(0.05, 0.95), ch * r.uniform(0.05, 0.95)
                x, y = cx + r.uniform(0.01, 0.99) * (cw - w), cy + r.uniform(0.01, 0.99) * (ch - h)
                dets.append(
                    dict(
                        image_id=im["id"],
                        category_id=c,
                        bbox=[x, y, w, h],
                        score=round(float(r.random()), 1),
                    )
                )
    order = r.permutation(len(anns))
    anns = [dict(anns[i], id=k + 1) for k, i in enumerate(order)]
    dets = [dets[i] for i in r.permutation(len(dets))]
    cats = [{"id": c, "name": f"c{c}"} for c in cat_ids]
    return {"images": images, "categories": cats, "annotations": anns}, dets


def test_every_detection_ignored():
    gt, dets = _all_ignored_case(3)
    want_stats, want_cat = expected_without_true_positives(gt)
    pc_stats, pc_cat = pycocotools_eval(gt, dets)
    np.testing.assert_allclose(
        pc_stats, want_stats, atol=0, rtol=0
    )  # the construction does what it says
    assert pc_cat == want_cat
    res = ours.evaluate_detailed(gt, dets)
    assert_stats_close("every detection ignored", res.stats, pc_stats)
    assert_per_cat_close("every detection ignored", res.per_category_ap, pc_cat)


def test_crowd_only_ground_truth():
    gt, dets = random_case(11, num_images=20, num_categories=4, dets_per_image=30)
    gt = {**gt, "annotations": [dict(a, iscrowd=1) for a in gt["annotations"]]}
    want_stats, want_cat = expected_without_true_positives(gt)
    assert set(want_stats.tolist()) == {-1.0}
    check_parity("crowd-only gt", gt, dets)


def test_annotation_id_zero():
    """pycocotools records a match by the gt's id, so a detection matched to the
    annotation with id 0 reads as unmatched (a false positive) in accumulate."""
    gt, dets = random_case(13, num_images=20, num_categories=4, dets_per_image=30)
    anns = sorted(gt["annotations"], key=lambda a: a["iscrowd"])  # id 0 goes to a non-crowd gt
    target = anns[0]
    gt = {**gt, "annotations": [dict(a, id=k) for k, a in enumerate(anns)]}
    dets = dets + [
        {
            "image_id": target["image_id"],
            "category_id": target["category_id"],
            "bbox": list(target["bbox"]),
            "score": 1.0,
        }
    ]
    check_parity("annotation id 0", gt, dets)


def test_evaluate_matches_detailed_and_does_not_mutate_inputs():
    gt, dets = random_case(
        5, num_images=30, num_categories=5, dets_per_image=40, crowd_fraction=0.1
    )
    gt0, dets0 = copy.deepcopy(gt), copy.deepcopy(dets)
    s = ours.evaluate(gt, dets)
    d = ours.evaluate_detailed(gt, dets)
    assert gt == gt0 and dets == dets0, "evaluate must not modify its inputs"
    assert tuple(s) == STAT_NAMES and tuple(ours.STAT_NAMES) == STAT_NAMES
    assert all(isinstance(v, float) for v in s.values())
    np.testing.assert_array_equal(_stats_vec(s), _stats_vec(d.stats))


# -------------------------------------------------------------- evaluate_arrays
def _pack(gt: dict, dets: list[dict], seed: int):
    """Pack detections into [N, Q] arrays, one row per image (rows in random order,
    within-row order = list order, so tie order is preserved). Padding slots hold
    plausible, high-scoring boxes that must be dropped by the valid mask."""
    r = np.random.default_rng(seed)
    by_img: dict = {im["id"]: [] for im in gt["images"]}
    for d in dets:
        by_img[d["image_id"]].append(d)
    img_ids = list(by_img)
    img_ids = [img_ids[i] for i in r.permutation(len(img_ids))]
    n, q = len(img_ids), max(1, max(len(v) for v in by_img.values()))
    boxes = np.empty((n, q, 4))
    boxes[..., :2] = r.uniform(0, 300, (n, q, 2))
    boxes[..., 2:] = r.uniform(5, 200, (n, q, 2))
    scores = np.ones((n, q))
    some_cat = gt["annotations"][0]["category_id"]
    labels = np.full((n, q), some_cat, np.int64)
    valid = np.zeros((n, q), bool)
    for i, im in enumerate(img_ids):
        for j, d in enumerate(by_img[im]):
            boxes[i, j] = d["bbox"]
            scores[i, j] = d["score"]
            labels[i, j] = d["category_id"]
            valid[i, j] = True
    return np.array(img_ids, np.int64), boxes, scores, labels, valid


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_evaluate_arrays_matches_evaluate(seed):
    gt, dets = random_case(
        200 + seed,
        num_images=25,
        num_categories=5,
        dets_per_image=30,
        tie_fraction=0.5,
        big_group_fraction=0.1,
    )
    image_ids, boxes, scores, labels, valid = _pack(gt, dets, seed)
    assert not valid.all()
    want = ours.evaluate_detailed(gt, dets)
    got = ours.evaluate_arrays(gt, image_ids, boxes, scores, labels, valid)
    np.testing.assert_allclose(_stats_vec(got.stats), _stats_vec(want.stats), atol=TOL, rtol=0)
    assert_per_cat_close(f"evaluate_arrays seed={seed}", got.per_category_ap, want.per_category_ap)

    # valid=None: every slot counts, same as the flattened list (row-major order)
    flat = [
        {
            "image_id": int(image_ids[i]),
            "category_id": int(labels[i, j]),
            "bbox": boxes[i, j].tolist(),
            "score": float(scores[i, j]),
        }
        for i in range(boxes.shape[0])
        for j in range(boxes.shape[1])
    ]
    want_all = ours.evaluate_detailed(gt, flat)
    got_all = ours.evaluate_arrays(gt, image_ids, boxes, scores, labels)
    np.testing.assert_allclose(
        _stats_vec(got_all.stats), _stats_vec(want_all.stats), atol=TOL, rtol=0
    )
    assert_per_cat_close(
        f"evaluate_arrays valid=None seed={seed}", got_all.per_category_ap, want_all.per_category_ap
    )
    # and the padding really matters (so the mask test above is meaningful)
    assert np.abs(_stats_vec(want_all.stats) - _stats_vec(want.stats)).max() > 1e-3


# -------------------------------------------------------------------- bad input
_BAD = {
    "unknown_image_id": lambda d, gt: d.update(image_id=max(i["id"] for i in gt["images"]) + 1000),
    "unknown_category_id": lambda d, gt: d.update(
        category_id=max(c["id"] for c in gt["categories"]) + 1000
    ),
    "nan_score": lambda d, gt: d.update(score=math.nan),
    "inf_score": lambda d, gt: d.update(score=math.inf),
    "inf_box": lambda d, gt: d.update(bbox=[d["bbox"][0], math.inf, d["bbox"][2], d["bbox"][3]]),
    "nan_box": lambda d, gt: d.update(bbox=[math.nan, d["bbox"][1], d["bbox"][2], d["bbox"][3]]),
    "zero_width": lambda d, gt: d.update(bbox=[d["bbox"][0], d["bbox"][1], 0.0, d["bbox"][3]]),
    "negative_height": lambda d, gt: d.update(
        bbox=[d["bbox"][0], d["bbox"][1], d["bbox"][2], -3.0]
    ),
}


@pytest.mark.parametrize("kind", sorted(_BAD))
def test_bad_detection_raises_with_index(kind):
    gt, dets = random_case(3, num_images=6, num_categories=3, dets_per_image=10)
    assert len(dets) > 20
    dets = [dict(d) for d in dets]
    _BAD[kind](dets[17], gt)
    with pytest.raises(ValueError, match=r"(?<!\d)17(?!\d)"):
        ours.evaluate(gt, dets)
    with pytest.raises(ValueError, match=r"(?<!\d)17(?!\d)"):
        ours.evaluate_detailed(gt, dets)


@pytest.mark.parametrize(
    "kind", ["unknown_image_id", "unknown_category_id", "nan_score", "inf_box", "zero_width"]
)
def test_bad_arrays_raise(kind):
    gt, dets = random_case(4, num_images=6, num_categories=3, dets_per_image=10)
    image_ids, boxes, scores, labels, valid = _pack(gt, dets, 0)
    i, j = np.argwhere(valid)[3]
    if kind == "unknown_image_id":
        image_ids[i] = max(im["id"] for im in gt["images"]) + 1000
    elif kind == "unknown_category_id":
        labels[i, j] = max(c["id"] for c in gt["categories"]) + 1000
    elif kind == "nan_score":
        scores[i, j] = np.nan
    elif kind == "inf_box":
        boxes[i, j, 0] = np.inf
    else:
        boxes[i, j, 2] = 0.0
    with pytest.raises(ValueError):
        ours.evaluate_arrays(gt, image_ids, boxes, scores, labels, valid)


# ------------------------------------------------------------------- generator
def test_generator_deterministic_and_adversarial():
    a = random_case(123, num_images=200, num_categories=12)
    b = random_case(123, num_images=200, num_categories=12)
    assert a == b
    assert random_case(124, num_images=200, num_categories=12) != a
    gt, dets = a
    s = case_summary(gt, dets)
    assert s["crowd"] > 0 and s["groups_over_100"] > 0 and s["tied_scores"] > 0
    assert s["images_without_gt"] > 0 and s["images_without_gt_or_dets"] > 0
    assert s["categories_without_gt"] >= 2 and s["categories_without_gt_with_dets"] >= 1
    assert s["area_ne_wh"] > 0.9 * s["annotations"] and s["area_range_differs_from_box"] > 0
    assert s["area_on_threshold"] > 0
    assert (
        not s["image_ids_sorted"]
        and not s["category_ids_contiguous"]
        and not s["category_ids_sorted"]
    )
    assert [a["id"] for a in gt["annotations"]] == list(range(1, len(gt["annotations"]) + 1))
    for d in dets:
        assert d["bbox"][2] > 0 and d["bbox"][3] > 0 and 0 <= d["score"] <= 1
    for im in gt["images"]:
        assert {"id", "width", "height", "file_name"} <= set(im)
