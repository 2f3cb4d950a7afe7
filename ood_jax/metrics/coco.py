"""COCO bounding-box evaluation with pycocotools' exact semantics, vectorized in numpy.

`evaluate(gt, detections)` returns the twelve numbers of `COCOeval(..., 'bbox').stats`, every
rule and quirk of cocoeval.py included, without per-detection Python loops. Ids are compared and
ordered as pycocotools does; input it cannot sort, or reads only by accident, is an error naming
the record, the field and the id. Every result carries the per-image matching (`Matches`), so
statistics over images (`metrics.bootstrap`) need not match again. The semantics in full:
docs/guide/coco-evaluation.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from typing import Any, Mapping, Sequence

import numpy as np

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

IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
RECALL_THRESHOLDS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)
MAX_DETS = (1, 10, 100)
AREA_RANGES = {
    "all": (0.0, 1e5**2),
    "small": (0.0, 32.0**2),
    "medium": (32.0**2, 96.0**2),
    "large": (96.0**2, 1e5**2),
}
# What each of STAT_NAMES averages: (AP or AR, IoU threshold or None for all, area, maxDets).
_STAT_SPECS = (
    (True, None, "all", 100),
    (True, 0.5, "all", 100),
    (True, 0.75, "all", 100),
    (True, None, "small", 100),
    (True, None, "medium", 100),
    (True, None, "large", 100),
    (False, None, "all", 1),
    (False, None, "all", 10),
    (False, None, "all", 100),
    (False, None, "small", 100),
    (False, None, "medium", 100),
    (False, None, "large", 100),
)
_AREA_LO = np.array([lo for lo, _ in AREA_RANGES.values()])
_AREA_HI = np.array([hi for _, hi in AREA_RANGES.values()])


@dataclasses.dataclass(frozen=True)
class GroundTruth:
    """A COCO ground-truth file as arrays; parse once, evaluate many times."""

    image_ids: np.ndarray  # [I] unique image ids in pycocotools' order (int64, float64 or str)
    category_ids: np.ndarray  # [K] the same for category ids
    category_names: tuple[str, ...]
    # Annotations ordered by (image, category) group, file order inside a group.
    image_index: np.ndarray  # [G]
    category_index: np.ndarray  # [G]
    boxes: np.ndarray  # [G, 4] absolute xywh, float64
    area: np.ndarray  # [G] the annotation's `area` field
    is_crowd: np.ndarray  # [G] bool
    annotation_ids: np.ndarray  # [G] unique, int64 or float64

    @classmethod
    def from_coco(cls, gt: Mapping[str, Any]) -> "GroundTruth":
        for field in ("images", "annotations", "categories"):
            if field not in gt:
                raise ValueError(f"ground truth has no '{field}' list")
        images, categories, anns = gt["images"], gt["categories"], gt["annotations"]
        try:
            image_ids = [im["id"] for im in images]
        except (KeyError, TypeError) as e:
            raise ValueError(_malformed(images, "image", ("id",), e)) from None
        try:
            category_ids = [c["id"] for c in categories]
            category_names = [str(c.get("name", c["id"])) for c in categories]
        except (KeyError, TypeError) as e:
            raise ValueError(_malformed(categories, "category", ("id",), e)) from None
        n = len(anns)
        try:
            ann_image = [a["image_id"] for a in anns]
            ann_category = [a["category_id"] for a in anns]
            ann_ids = [a["id"] for a in anns]
            boxes = _boxes_array([a["bbox"] for a in anns], "annotation")
            area = np.fromiter(
                (a.get("area", a["bbox"][2] * a["bbox"][3]) for a in anns), np.float64, n
            )
            crowd = np.fromiter((bool(a.get("iscrowd", 0)) for a in anns), bool, n)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                _malformed(anns, "annotation", ("image_id", "category_id", "bbox", "id"), e)
            ) from None
        return cls.from_arrays(
            image_ids=image_ids,
            categories=list(zip(category_ids, category_names)),
            annotation_image_ids=ann_image,
            annotation_category_ids=ann_category,
            boxes=boxes,
            area=area,
            is_crowd=crowd,
            annotation_ids=ann_ids,
        )

    @classmethod
    def from_arrays(
        cls,
        *,
        image_ids: np.ndarray,
        categories: Sequence[tuple[Any, str]],
        annotation_image_ids: np.ndarray,
        annotation_category_ids: np.ndarray,
        boxes: np.ndarray,
        area: np.ndarray,
        is_crowd: np.ndarray,
        annotation_ids: np.ndarray,
    ) -> "GroundTruth":
        """The ground truth from arrays, one row per annotation (boxes absolute xywh), as a
        dataset reader has them: no COCO dicts in between. `categories` is (id, name) pairs."""
        image_ids = np.unique(_ids(image_ids, "image", "id"))
        category_ids = _ids([c for c, _ in categories], "category", "id")
        category_order = np.argsort(category_ids, kind="stable")
        category_ids = category_ids[category_order]
        _check_unique(category_ids, category_order, "category", "give each its own id")
        boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
        area = np.asarray(area, np.float64)
        # pycocotools writes a matched annotation's id into a float array: numbers only.
        annotation_ids = _ids(annotation_ids, "annotation", "id", numbers_only=True)
        by_id = np.argsort(annotation_ids, kind="stable")
        _check_unique(
            annotation_ids[by_id],
            by_id,
            "annotation",
            "pycocotools would evaluate the last annotation of each id once for every annotation"
            " with that id and drop the others; give each annotation its own id (e.g. number"
            " them 1, 2, ... in file order)",
        )
        image_index = _index_of(
            _ids(annotation_image_ids, "annotation", "image_id"),
            image_ids,
            "annotation",
            "image_id",
        )
        category_index = _index_of(
            _ids(annotation_category_ids, "annotation", "category_id"),
            category_ids,
            "annotation",
            "category_id",
        )
        _check_finite_positive(boxes, "annotation", area)
        order = np.argsort(image_index * len(category_ids) + category_index, kind="stable")
        return cls(
            image_ids=image_ids,
            category_ids=category_ids,
            category_names=tuple(categories[i][1] for i in category_order),
            image_index=image_index[order],
            category_index=category_index[order],
            boxes=boxes[order],
            area=area[order],
            is_crowd=np.asarray(is_crowd, bool)[order],
            annotation_ids=annotation_ids[order],
        )

    @property
    def group_key(self) -> np.ndarray:
        return self.image_index * len(self.category_ids) + self.category_index

    def digest(self) -> str:
        """sha256 of everything evaluation reads: two evaluations are comparable image by image
        only on ground truth with the same digest."""
        h = hashlib.sha256()
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            h.update(field.name.encode())
            if isinstance(value, np.ndarray):
                h.update(str(value.dtype).encode() + str(value.shape).encode())
                h.update(np.ascontiguousarray(value).tobytes())
            else:
                h.update(repr(value).encode())
        return h.hexdigest()


# The ground truth's ids as it has them (`_ids`); saved narrowed when they are integers.
_ID_FIELDS = ("image_ids", "category_ids")
_INDEX_FIELDS = (
    "num_positive",
    "image",
    "category",
    "rank",
    "candidate",
)


def _narrow(values: np.ndarray) -> np.ndarray:
    """Integers in the narrowest signed dtype holding them (int8 .. int64)."""
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if not values.size or (values.min() >= info.min and values.max() <= info.max):
            return values.astype(dtype)
    return values.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Matches:
    """What the matching decided, per image: all that accumulate needs, kept so that AP can be
    recomputed for any reweighting of the images (a bootstrap) without matching again.

    Detections are the ones evaluation keeps (the maxDets[-1] best of each (image, category))
    in accumulate order: category, descending score, image, rank. A detection is a true
    positive, a false positive or ignored at each (IoU threshold, area range); only the
    candidates (detections overlapping some ground truth of their group at IoU >= 0.5) can be
    true positives or ignored through a match, every other one is a false positive unless it
    lies outside the area range.
    """

    image_ids: np.ndarray  # [I] sorted, as GroundTruth.image_ids
    category_ids: np.ndarray  # [K] sorted
    num_positive: np.ndarray  # [I, K, A] non-ignored ground truth of each image (npig's terms)
    image: np.ndarray  # [D] image index of each detection
    category: np.ndarray  # [D] category index, ascending
    score: np.ndarray  # [D] float64
    rank: np.ndarray  # [D] rank in its (image, category) by descending score, stable
    out_of_range: np.ndarray  # [D, A] w*h outside the area range
    candidate: np.ndarray  # [C] ascending positions into the detections
    tp: np.ndarray  # [C, T, A] true positive
    fp: np.ndarray  # [C, T, A] false positive (neither: ignored)
    ground_truth: str = ""  # GroundTruth.digest() of what was matched against

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields as arrays (for np.savez), indices in the narrowest dtype that holds them;
        `from_saved` reads them back."""
        out = {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in _INDEX_FIELDS + tuple(n for n in _ID_FIELDS if out[n].dtype.kind == "i"):
            out[name] = _narrow(out[name])
        return out

    @classmethod
    def from_saved(cls, arrays: Mapping[str, np.ndarray], source: str) -> "Matches":
        """The inverse of `arrays`, checking what it reads; `source` names it in errors."""
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in arrays:
                raise ValueError(f"{source}: missing field '{field.name}'")
            values[field.name] = np.asarray(arrays[field.name])
        values["ground_truth"] = str(values["ground_truth"])
        for name in _ID_FIELDS:
            if values[name].dtype.kind not in "iufU":
                raise ValueError(f"{source}: field '{name}' is {values[name].dtype}, not ids")
            if values[name].dtype.kind in "iu":
                values[name] = values[name].astype(np.int64)
        for name in _INDEX_FIELDS:
            if values[name].dtype.kind not in "iu":
                raise ValueError(f"{source}: field '{name}' is {values[name].dtype}, not integers")
            values[name] = values[name].astype(np.int64)
        for name in ("out_of_range", "tp", "fp"):
            if values[name].dtype != bool:
                raise ValueError(f"{source}: field '{name}' is {values[name].dtype}, not bool")
        if values["score"].dtype != np.float64:
            raise ValueError(f"{source}: field 'score' is {values['score'].dtype}, not float64")
        matches = cls(**values)
        matches.check(source)
        return matches

    def check(self, source: str) -> None:
        """Shapes that agree with each other, or ValueError naming `source` and the field."""
        num_i, num_k, num_d, num_c = (
            len(self.image_ids),
            len(self.category_ids),
            len(self.image),
            len(self.candidate),
        )
        num_t, num_a = len(IOU_THRESHOLDS), len(AREA_RANGES)
        expected = {
            "num_positive": (num_i, num_k, num_a),
            "category": (num_d,),
            "score": (num_d,),
            "rank": (num_d,),
            "out_of_range": (num_d, num_a),
            "tp": (num_c, num_t, num_a),
            "fp": (num_c, num_t, num_a),
        }
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"{source}: field '{name}' has shape {getattr(self, name).shape}, "
                    f"expected {shape}"
                )
        if num_d and not (0 <= self.image.min() and self.image.max() < num_i):
            raise ValueError(f"{source}: field 'image' holds an index outside [0, {num_i})")
        if num_d and not (0 <= self.category.min() and self.category.max() < num_k):
            raise ValueError(f"{source}: field 'category' holds an index outside [0, {num_k})")
        if num_c and not (
            np.all(np.diff(self.candidate) > 0)
            and self.candidate[0] >= 0
            and self.candidate[-1] < num_d
        ):
            raise ValueError(f"{source}: field 'candidate' is not ascending positions < {num_d}")
        if np.any(self.tp & self.fp):
            raise ValueError(f"{source}: fields 'tp' and 'fp' are both set for a detection")


@dataclasses.dataclass(frozen=True)
class CocoEvalResult:
    stats: dict[str, float]
    per_category_ap: dict[Any, float]  # category id -> AP@[.5:.95], -1 without ground truth
    precision: np.ndarray  # [T, R, K, A] at maxDets=100 (pycocotools' eval['precision'][..., -1])
    recall: np.ndarray  # [T, K, A, M]
    category_names: tuple[str, ...] = ()
    matches: Matches | None = None  # the per-image matching the numbers come from

    def table(self) -> str:
        return format_table(self.stats)


def evaluate(
    gt: Mapping[str, Any] | GroundTruth, detections: Sequence[Mapping[str, Any]]
) -> dict[str, float]:
    """The twelve COCO bbox numbers, keyed by `STAT_NAMES`, equal to pycocotools'."""
    return evaluate_detailed(gt, detections).stats


def evaluate_detailed(
    gt: Mapping[str, Any] | GroundTruth, detections: Sequence[Mapping[str, Any]]
) -> CocoEvalResult:
    gt = gt if isinstance(gt, GroundTruth) else GroundTruth.from_coco(gt)
    n = len(detections)
    try:
        image_id = list(map(operator.itemgetter("image_id"), detections))
        category_id = list(map(operator.itemgetter("category_id"), detections))
        score = np.fromiter(map(operator.itemgetter("score"), detections), np.float64, n)
        boxes = list(map(operator.itemgetter("bbox"), detections))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            _malformed(detections, "detection", ("image_id", "category_id", "score", "bbox"), e)
        ) from None
    return _evaluate(
        gt,
        _ids(image_id, "detection", "image_id"),
        _ids(category_id, "detection", "category_id"),
        _boxes_array(boxes, "detection"),
        score,
    )


def evaluate_arrays(
    gt: Mapping[str, Any] | GroundTruth, image_ids, boxes, scores, labels, valid=None
) -> CocoEvalResult:
    """Evaluates padded model outputs without building detection dicts.

    Args:
      gt: COCO ground truth (dict or parsed `GroundTruth`).
      image_ids: [N] COCO image id of each row.
      boxes: [N, Q, 4] absolute COCO [x, y, w, h].
      scores: [N, Q].
      labels: [N, Q] COCO category ids.
      valid: optional [N, Q] bool; False entries are padding and not detections.
    """
    gt = gt if isinstance(gt, GroundTruth) else GroundTruth.from_coco(gt)
    boxes = np.asarray(boxes, np.float64)
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels)
    image_ids = np.asarray(image_ids)
    if (
        boxes.ndim != 3
        or boxes.shape[-1] != 4
        or scores.shape != boxes.shape[:2]
        or labels.shape != scores.shape
    ):
        raise ValueError(
            f"expected boxes [N,Q,4], scores and labels [N,Q]; got {boxes.shape}, "
            f"{scores.shape}, {labels.shape}"
        )
    if image_ids.shape != scores.shape[:1]:
        raise ValueError(f"image_ids has shape {image_ids.shape}, expected ({scores.shape[0]},)")
    valid = np.ones(scores.shape, bool) if valid is None else np.asarray(valid, bool)
    image_id = np.broadcast_to(image_ids[:, None], scores.shape)[valid]
    return _evaluate(
        gt,
        _ids(image_id, "detection", "image_id"),
        _ids(labels[valid], "detection", "category_id"),
        boxes[valid],
        scores[valid],
    )


def format_table(stats: Mapping[str, float]) -> str:
    """The summary in pycocotools' layout."""
    lines = []
    for name, (is_ap, iou, area, max_dets) in zip(STAT_NAMES, _STAT_SPECS):
        title, kind = ("Average Precision", "AP") if is_ap else ("Average Recall", "AR")
        iou_text = "0.50:0.95" if iou is None else f"{iou:0.2f}"
        lines.append(
            f" {title:<18} ({kind}) @[ IoU={iou_text:<9} | area={area:>6s} | "
            f"maxDets={max_dets:>3d} ] = {stats[name]:0.3f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Input checks.


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _malformed(records: Sequence[Any], what: str, fields: Sequence[str], error: Exception) -> str:
    """The message for the first record that lacks one of `fields` or holds a non-number in one
    that is not an id (`_ids` checks those; bbox: a list of numbers)."""
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            return f"{what} {i}: expected an object, got {type(record).__name__}"
        for field in fields:
            if field not in record:
                return f"{what} {i}: missing field '{field}'"
            value = record[field]
            ok = (
                field in ("id", "image_id", "category_id")
                or (field == "bbox" and isinstance(value, list) and all(map(_number, value)))
                or _number(value)
            )
            if not ok:
                return f"{what} {i}: field '{field}' is {value!r}, expected a number"
    return f"{what}s: malformed field ({error!r})"


def _ids(values, what: str, field: str, numbers_only: bool = False) -> np.ndarray:
    """Each record's `field` (`values`, a list or array) as pycocotools compares and orders it:
    integers and floats equal to one as int64 (3.0 is the dict key 3), other numbers as float64,
    strings as str. Anything else, NaN, and a mix of numbers and strings (which pycocotools
    cannot sort) raise, naming the first record at fault."""
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):  # ragged: some value is a sequence
        array = np.empty(0, object)
    kind = array.dtype.kind if array.ndim == 1 else "O"
    if kind == "U" and not numbers_only:
        # A list that mixes numbers and strings reads as strings; the first record sets the kind.
        if isinstance(values, np.ndarray):
            return array
        first = isinstance(values[0], str)
        other = next((i for i, v in enumerate(values) if isinstance(v, str) != first), None)
        if other is None:
            return array
        kinds = ("a number", "a string") if first else ("a string", "a number")
        raise ValueError(
            f"{what} {other}: {field} {values[other]!r} is {kinds[0]} but {what} 0's is"
            f" {kinds[1]} ({values[0]!r}); give every {field} as a number or every one as a string"
        )
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(array))
        if len(bad):
            raise ValueError(f"{what} {bad[0]}: {field} {values[bad[0]]!r} is not a finite number")
        integral = np.abs(array).max(initial=0) < 2**63 and np.all(array == np.floor(array))
        return array.astype(np.int64) if integral else array
    if kind in "iu" and (kind == "i" or array.max(initial=0) < 2**63):
        return array.astype(np.int64, copy=False)
    expected = "a number" if numbers_only else "a number or a string"
    for i, v in enumerate(values):
        if isinstance(v, str) and not numbers_only:
            continue
        if not _number(v):
            raise ValueError(f"{what} {i}: {field} {v!r} is not {expected}")
        if isinstance(v, (int, np.integer)) and not -(2**63) <= v < 2**63:
            raise ValueError(f"{what} {i}: {field} {v!r} is outside the int64 range")
    raise ValueError(f"{what}s: {field} values of kind {array.dtype} are not ids")


def _check_unique(sorted_ids: np.ndarray, order: np.ndarray, what: str, why: str) -> None:
    """A repeated id is an error naming its first repeat, the record it repeats and the others,
    and `why` it matters; `order` (stable) sorts the records into `sorted_ids`."""
    repeat = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1]) + 1
    if not len(repeat):
        return
    first = repeat[np.argmin(order[repeat])]
    value = sorted_ids[first]
    original = order[np.searchsorted(sorted_ids, value)]
    ids = np.unique(sorted_ids[repeat]).tolist()
    shown = ", ".join(map(repr, ids[:5])) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")
    raise ValueError(
        f"{what} {order[first]}: id {value.item()!r} is also the id of {what} {original}"
        f" (ids used more than once: {shown}); {why}"
    )


def _boxes_array(boxes: list, what: str) -> np.ndarray:
    if not boxes:
        return np.zeros((0, 4))
    try:
        array = np.array(boxes, dtype=np.float64).reshape(len(boxes), -1)
    except (ValueError, TypeError):
        array = None
    if array is None or array.shape[1] != 4:
        index = next((i for i, b in enumerate(boxes) if np.shape(b) != (4,)), 0)
        raise ValueError(f"{what} {index}: bbox must be [x, y, w, h], got {boxes[index]!r}")
    return array


def _index_of(ids: np.ndarray, known: np.ndarray, what: str, field: str) -> np.ndarray:
    """Positions of `ids` in the sorted `known` (both from `_ids`); an id not there raises."""
    if not len(ids):
        return np.zeros(0, np.int64)
    if not len(known):
        bad = np.arange(len(ids))
    elif (ids.dtype.kind == "U") != (known.dtype.kind == "U"):
        # pycocotools' dicts tell 1 from "1"; say which one the ground truth holds.
        kind = "strings" if known.dtype.kind == "U" else "numbers"
        raise ValueError(
            f"{what} 0: {field} {ids[0].item()!r} is not in the ground truth, whose ids are"
            f" {kind} (e.g. {known[0].item()!r}; {len(ids)} {what}s affected)"
        )
    else:
        index = np.searchsorted(known, ids).clip(0, len(known) - 1)
        bad = np.flatnonzero(known[index] != ids)
    if len(bad):
        raise ValueError(
            f"{what} {bad[0]}: {field} {ids[bad[0]].item()!r} is not in the ground truth"
            f" ({len(bad)} {what}s affected)"
        )
    return index


def _check_finite_positive(boxes: np.ndarray, what: str, values: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(boxes).all(1) | ~np.isfinite(values))
    if len(bad):
        raise ValueError(
            f"{what} {bad[0]}: non-finite bbox or {'area' if what == 'annotation' else 'score'}"
            f" ({len(bad)} {what}s affected)"
        )
    bad = np.flatnonzero((boxes[:, 2] <= 0) | (boxes[:, 3] <= 0))
    if len(bad):
        raise ValueError(
            f"{what} {bad[0]}: bbox {boxes[bad[0]].tolist()} has non-positive width or height"
            f" ({len(bad)} {what}s affected)"
        )


# ----------------------------------------------------------------------------------------
# The evaluation proper.


def _evaluate(gt: GroundTruth, image_id, category_id, boxes, score) -> CocoEvalResult:
    matches = _match(gt, image_id, category_id, boxes, score)
    precision, recall = _accumulate(
        matches.num_positive.sum(0, dtype=np.int64),
        matches.category,
        matches.rank,
        matches.out_of_range,
        matches.candidate,
        tp=matches.tp,
        fp=matches.fp,
    )
    stats = _summarize(precision, recall)
    per_category = {}
    for k, category in enumerate(gt.category_ids):
        p = precision[:, :, k, 0]
        per_category[category.item()] = float(np.mean(p[p > -1])) if (p > -1).any() else -1.0
    return CocoEvalResult(
        stats=stats,
        per_category_ap=per_category,
        precision=precision,
        recall=recall,
        category_names=gt.category_names,
        matches=matches,
    )


def _match(gt: GroundTruth, image_id, category_id, boxes, score) -> Matches:
    """evaluateImg for every image: the kept detections in accumulate order and their outcome."""
    image_index = _index_of(image_id, gt.image_ids, "detection", "image_id")
    category_index = _index_of(category_id, gt.category_ids, "detection", "category_id")
    _check_finite_positive(boxes, "detection", score)

    num_categories = len(gt.category_ids)
    num_a = len(AREA_RANGES)

    # Detections in (group, descending score) order, stable for ties; keep maxDets[-1] per group.
    key = image_index * num_categories + category_index
    order = np.lexsort((-score, key))
    key = key[order]
    rank = np.arange(len(key)) - np.searchsorted(key, key, side="left")
    within = rank < MAX_DETS[-1]
    keep, rank, d_key = order[within], rank[within], key[within]
    d_image, d_category = image_index[keep], category_index[keep]
    d_boxes, d_score = boxes[keep], score[keep]
    d_area = d_boxes[:, 2] * d_boxes[:, 3]

    g_ignore = (
        gt.is_crowd[:, None] | (gt.area[:, None] < _AREA_LO) | (gt.area[:, None] > _AREA_HI)
    )  # [G, A]
    d_out_of_range = (d_area[:, None] < _AREA_LO) | (d_area[:, None] > _AREA_HI)  # [D, A]
    # pycocotools' npig, kept per image so that a bootstrap can reweight images.
    num_positive = np.zeros((len(gt.image_ids), num_categories, num_a), np.int32)
    np.add.at(num_positive, (gt.image_index, gt.category_index), ~g_ignore)

    # pycocotools concatenates images in id order, each sorted by score, then sorts stably by
    # score; the curves are built in that order, one segment per category.
    acc_order = np.lexsort((rank, d_image, -d_score, d_category))
    position = np.empty_like(acc_order)
    position[acc_order] = np.arange(len(acc_order))

    dets, match = _greedy_match(d_key, d_boxes, gt.group_key, gt.boxes, gt.is_crowd, g_ignore)
    by_position = np.argsort(position[dets])
    dets, match = dets[by_position], match[by_position]
    has_match = match >= 0
    matched_gt = np.where(has_match, match, 0)
    if len(gt.annotation_ids):
        # pycocotools records a match by the ground truth's id, so a match to id 0 reads as none.
        matched = has_match & (gt.annotation_ids[matched_gt] != 0)
        ignored = has_match & g_ignore[matched_gt, np.arange(num_a)]
    else:
        matched, ignored = has_match, np.zeros_like(has_match)
    ignored |= ~matched & d_out_of_range[dets][:, None, :]
    return Matches(
        image_ids=gt.image_ids,
        category_ids=gt.category_ids,
        num_positive=num_positive,
        image=d_image[acc_order],
        category=d_category[acc_order],
        score=d_score[acc_order],
        rank=rank[acc_order],
        out_of_range=d_out_of_range[acc_order],
        candidate=position[dets],
        tp=matched & ~ignored,
        fp=~matched & ~ignored,
        ground_truth=gt.digest(),
    )


def _pair_iou(d: np.ndarray, g: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    """IoU of aligned xywh pairs in pycocotools' bbIou arithmetic (same operations, same order)."""
    w = np.minimum(d[:, 2] + d[:, 0], g[:, 2] + g[:, 0]) - np.maximum(d[:, 0], g[:, 0])
    h = np.minimum(d[:, 3] + d[:, 1], g[:, 3] + g[:, 1]) - np.maximum(d[:, 1], g[:, 1])
    inter = w * h
    d_area = d[:, 2] * d[:, 3]
    union = np.where(crowd, d_area, d_area + g[:, 2] * g[:, 3] - inter)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((w > 0) & (h > 0), inter / union, 0.0)


def _greedy_match(d_key, d_boxes, g_key, g_boxes, g_crowd, g_ignore) -> np.ndarray:
    """pycocotools' evaluateImg matching for every group, threshold and area range at once.

    Detections arrive sorted by group and descending score. Returns the detections that overlap
    some ground truth enough to match ([C] indices) and, for each of them, the matched ground
    truth per threshold and area range ([C, T, A], -1 for none); all others match nothing.
    """
    num_t, num_a = len(IOU_THRESHOLDS), g_ignore.shape[1]

    # All (detection, ground truth) pairs inside each group; ground truth in file order.
    g_begin = np.searchsorted(g_key, d_key, side="left")
    g_count = np.searchsorted(g_key, d_key, side="right") - g_begin
    pair_det = np.repeat(np.arange(len(d_key)), g_count)
    pair_gt = (
        np.arange(len(pair_det))
        - np.repeat(np.cumsum(g_count) - g_count, g_count)
        + np.repeat(g_begin, g_count)
    )
    iou = _pair_iou(d_boxes[pair_det], g_boxes[pair_gt], g_crowd[pair_gt])

    # A pair below the lowest threshold can never match, so it cannot affect any other pair.
    candidate = iou >= IOU_THRESHOLDS[0]
    pair_det, pair_gt, iou = pair_det[candidate], pair_gt[candidate], iou[candidate]
    dets = np.unique(pair_det)
    match = -np.ones((len(dets), num_t, num_a), np.int64)
    if not len(dets):
        return dets, match

    # Step s handles the s-th detection (among those with candidate pairs) of every group.
    step_of_det = np.arange(len(dets)) - np.searchsorted(d_key[dets], d_key[dets], side="left")
    pair_step = step_of_det[np.searchsorted(dets, pair_det)]
    by_step = np.argsort(pair_step, kind="stable")
    pair_det, pair_gt, iou, pair_step = (
        pair_det[by_step],
        pair_gt[by_step],
        iou[by_step],
        pair_step[by_step],
    )
    step_bounds = np.searchsorted(pair_step, np.arange(pair_step[-1] + 2))

    taken = np.zeros((len(g_key), num_t, num_a), bool)
    thresholds = IOU_THRESHOLDS[None, :, None]
    for s in range(len(step_bounds) - 1):
        lo, hi = step_bounds[s], step_bounds[s + 1]
        det, g, pair_iou = pair_det[lo:hi], pair_gt[lo:hi], iou[lo:hi, None, None]
        first = np.flatnonzero(
            np.r_[True, det[1:] != det[:-1]]
        )  # each detection's pairs are contiguous
        det_of_pair = np.cumsum(np.r_[True, det[1:] != det[:-1]]) - 1

        eligible = (~taken[g] | g_crowd[g, None, None]) & (pair_iou >= thresholds)  # [P, T, A]
        regular = eligible & ~g_ignore[g][:, None, :]
        # Non-ignored ground truth wins over ignored; among the winners the highest IoU, and the
        # last one in file order on a tie.
        has_regular = np.logical_or.reduceat(regular, first, axis=0)
        pool = regular | (eligible & ~has_regular[det_of_pair])
        best = np.maximum.reduceat(np.where(pool, pair_iou, -1.0), first, axis=0)
        winner = pool & (pair_iou == best[det_of_pair])
        chosen = np.maximum.reduceat(
            np.where(winner, np.arange(hi - lo)[:, None, None], -1), first, axis=0
        )

        d_i, t_i, a_i = np.nonzero(chosen >= 0)
        chosen_gt = g[chosen[d_i, t_i, a_i]]
        match[np.searchsorted(dets, det[first[d_i]]), t_i, a_i] = chosen_gt
        taken[chosen_gt, t_i, a_i] = True
    return dets, match


def recall_targets(num_positive: np.ndarray) -> np.ndarray:
    """Smallest true-positive count v with v / npig >= each recall threshold, exactly as
    pycocotools compares them. [..., R] for num_positive [...]."""
    n = np.maximum(num_positive, 1)[..., None].astype(np.float64)
    start = np.maximum(np.floor(RECALL_THRESHOLDS * n) - 1, 0)
    window = start[..., None] + np.arange(4)
    with np.errstate(invalid="ignore"):
        below = (window / n[..., None]) < RECALL_THRESHOLDS[:, None]
    return (start + below.sum(-1)).astype(np.int64)


def _accumulate(num_positive, category, rank, out_of_range, cand_pos, tp, fp):
    """pycocotools' accumulate: precision [T, R, K, A] at maxDets=100 and recall [T, K, A, M].

    Detections come in accumulate order (category, descending score, image, rank): `category`,
    `rank`, `out_of_range` ([D, A]) describe all of them. Only the candidates (those overlapping
    some ground truth; positions `cand_pos`, ascending) can be true positives or ignored through
    a match; `tp` and `fp` are their [C, T, A] outcomes. Every other detection is a false
    positive unless it lies outside the area range.

    The interpolated precision at a recall threshold is the maximum precision at or after the
    first detection reaching that recall. Precision only rises at true positives and a recall
    level is first reached at one, so only true positives need precision values: the j-th
    recall point of a curve is the suffix maximum from its need_j-th true positive.
    """
    num_k, num_a = num_positive.shape
    num_t, num_r = len(IOU_THRESHOLDS), len(RECALL_THRESHOLDS)
    precision = np.where(num_positive > 0, 0.0, -1.0)[None, None].repeat(num_t, 0).repeat(num_r, 1)
    recall = np.where(num_positive > 0, 0.0, -1.0)[None, :, :, None].repeat(num_t, 0)
    recall = recall.repeat(len(MAX_DETS), 3)
    if not len(category):  # no detections: zero where there is ground truth
        return precision, recall

    # Running false-positive counts: those of non-candidates plus a correction at candidates.
    # Row 0 of each is "before the first", so index -1 (none) reads zero.
    base_fp = ~out_of_range
    base_cum = np.cumsum(base_fp, axis=0, dtype=np.int64)
    base_cum = np.concatenate([np.zeros((1, num_a), np.int64), base_cum])  # [D + 1, A]
    delta = fp.astype(np.int64) - base_fp[cand_pos][:, None, :]
    delta_cum = np.concatenate([np.zeros((1, num_t, num_a), np.int64), np.cumsum(delta, axis=0)])

    def fp_through(pos, cand):  # false positives at positions <= pos; cand: last candidate <= pos
        return base_cum[pos + 1][:, None, :] + delta_cum[cand + 1]

    category_start = np.searchsorted(category, np.arange(num_k), side="left")
    fp_before_category = fp_through(
        category_start - 1, np.searchsorted(cand_pos, category_start) - 1
    )  # [K, T, A]

    # True positives, grouped by curve (area, threshold, category) in detection order.
    a_i, t_i, c_i = np.nonzero(tp.transpose(2, 1, 0))
    k_i = category[cand_pos[c_i]]
    curve = (a_i * num_t + t_i) * num_k + k_i
    curve_first = (
        np.flatnonzero(np.r_[True, curve[1:] != curve[:-1]])
        if len(curve)
        else np.zeros(0, np.int64)
    )
    curve_len = np.diff(np.r_[curve_first, len(curve)])
    tp_count = (np.arange(len(curve)) - np.repeat(curve_first, curve_len) + 1).astype(np.float64)
    fp_count = (
        base_cum[cand_pos[c_i] + 1, a_i]
        + delta_cum[c_i + 1, t_i, a_i]
        - fp_before_category[k_i, t_i, a_i]
    ).astype(np.float64)
    pr = tp_count / (fp_count + tp_count + np.spacing(1))

    # The j-th recall point of a curve: suffix maximum from its max(need_j, 1)-th true positive.
    a_c, t_c, k_c = a_i[curve_first], t_i[curve_first], k_i[curve_first]
    need = np.maximum(recall_targets(num_positive)[k_c, a_c], 1)  # [curves, R]
    found = need <= curve_len[:, None]
    curve_end = curve_first + curve_len
    bounds = np.concatenate(
        [np.where(found, curve_first[:, None] + need - 1, curve_end[:, None]), curve_end[:, None]],
        axis=1,
    )
    interval_max = np.maximum.reduceat(np.r_[pr, -np.inf], bounds.reshape(-1))
    interval_max = np.where(found, interval_max.reshape(-1, num_r + 1)[:, :num_r], -np.inf)
    envelope = np.maximum.accumulate(interval_max[:, ::-1], axis=1)[:, ::-1]

    precision[t_c, :, k_c, a_c] = np.where(found, envelope, 0.0)

    tp_rank = rank[cand_pos[c_i]]
    for m, max_det in enumerate(MAX_DETS):
        counts = np.bincount(curve, weights=tp_rank < max_det, minlength=num_a * num_t * num_k)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = counts.reshape(num_a, num_t, num_k) / num_positive.T[:, None, :]
        recall[..., m] = np.where(num_positive.T[:, None, :] > 0, r, -1.0).transpose(1, 2, 0)
    return precision, recall


def _summarize(precision: np.ndarray, recall: np.ndarray) -> dict[str, float]:
    """pycocotools' summarize: means over the entries > -1 of each stat's slice."""
    areas = list(AREA_RANGES)
    stats = {}
    for name, (is_ap, iou, area, max_dets) in zip(STAT_NAMES, _STAT_SPECS):
        a, m = areas.index(area), MAX_DETS.index(max_dets)
        if is_ap:
            s = precision[:, :, :, a]  # kept at maxDets=100, the only one AP stats use
            if iou is not None:
                s = s[np.where(IOU_THRESHOLDS == iou)[0]]
        else:
            s = recall[:, :, a, m]
        stats[name] = float(np.mean(s[s > -1])) if (s > -1).any() else -1.0
    return stats
