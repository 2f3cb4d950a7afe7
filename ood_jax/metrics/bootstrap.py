"""Bootstrap confidence intervals for COCO AP over images, from one matching.

A resample draws the images with replacement, i.e. gives each an integer weight. Matching is
per image, so a resample's AP is an accumulation of `coco.Matches` under those weights, equal to
pycocotools' AP on the explicitly resampled dataset: nothing is matched again. All resamples are
evaluated at once, curve by curve, in numpy, with no Python loop over images, detections or
resamples.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence

import numpy as np
import scipy.sparse
import scipy.special

from ood_jax.metrics import coco

# Stats a bootstrap reports for each area range: the thresholds it averages over (None: all).
AREA_STATS = {
    "all": {"AP": None, "AP50": 0.5, "AP75": 0.75},
    "small": {"APs": None},
    "medium": {"APm": None},
    "large": {"APl": None},
}
STATS = tuple(AREA_STATS["all"])  # what results.json's intervals cover
# Elements of a category's largest [resamples, points] array (8 bytes each): 2 MiB stays in cache,
# which made the 5,000-image bench twice as fast as chunks of 32 MiB.
_CHUNK_ELEMENTS = 1 << 18
# Entries of the precision arrays of a block of resamples (8 bytes each; 128 MiB): all 1,000
# resamples of 5 categories in one block, 200 of 80 categories.
_BLOCK_ELEMENTS = 1 << 24


def resample_weights(num_images: int, resamples: int, seed: int, stream: str = "") -> np.ndarray:
    """[resamples, num_images] int32: how often each image is drawn when `num_images` images are
    drawn with replacement, once per resample.

    Seeded by (`seed`, `stream`): the same split name gives the same resamples in every run, so
    two detectors' results on a split can be paired; different names are independent.
    """
    if num_images < 1:
        raise ValueError(f"a bootstrap over images needs at least one image, got {num_images}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if seed < 0:
        raise ValueError(f"a bootstrap seed must be >= 0, got {seed}")
    rng = np.random.default_rng([seed, zlib.crc32(stream.encode())])
    draws = rng.integers(0, num_images, size=(resamples, num_images))
    draws += np.arange(resamples)[:, None] * num_images
    counts = np.bincount(draws.ravel(), minlength=resamples * num_images)
    return counts.reshape(resamples, num_images).astype(np.int32)


def ap_resamples(
    matches: coco.Matches, weights: np.ndarray, areas: Sequence[str] = ("all",)
) -> dict[str, np.ndarray]:
    """AP stats (`AREA_STATS` of each of `areas`) under each row of image weights [B, I]: what
    the evaluator returns on the dataset holding image i weights[b, i] times. [B] each; -1
    where no category has ground truth (as COCO)."""
    weights = np.asarray(weights)
    if weights.ndim != 2 or weights.shape[1] != len(matches.image_ids):
        raise ValueError(
            f"weights must be [resamples, {len(matches.image_ids)} images], got {weights.shape}"
        )
    if weights.size and (weights.min() < 0 or np.any(weights != np.round(weights))):
        raise ValueError("weights must be non-negative integers (copies of each image)")
    out = {}
    for area in areas:
        if area not in AREA_STATS:
            raise ValueError(f"unknown area range {area!r}; expected one of {list(AREA_STATS)}")
        plan = _prepare(matches, list(coco.AREA_RANGES).index(area))
        stats = {name: np.empty(len(weights)) for name in AREA_STATS[area]}
        # Blocks of resamples bound the [block, K, T, R] precision kept for the exact means.
        block = max(1, _BLOCK_ELEMENTS // precision_size(len(matches.category_ids)))
        for lo in range(0, len(weights), block):
            precision = np.moveaxis(_precision(plan, weights[lo : lo + block]), 1, -1)
            for name, iou in AREA_STATS[area].items():
                t = slice(None) if iou is None else np.flatnonzero(coco.IOU_THRESHOLDS == iou)
                stats[name][lo : lo + block] = _masked_means(precision[:, t])
        out.update(stats)
    return out


def precision_size(num_categories: int) -> int:
    """Entries of one resample's precision array [K, T, R]."""
    return num_categories * len(coco.IOU_THRESHOLDS) * len(coco.RECALL_THRESHOLDS)


def split_resamples(
    matches: coco.Matches, resamples: int, seed: int, split: str
) -> dict[str, np.ndarray]:
    """AP stats of one split over `resamples` bootstrap resamples of its images, with COCO's -1
    (no ground truth in a resample) as NaN. The resamples are `resample_weights(..., split)`'s:
    a split is resampled the same way for every detector and independently of other splits."""
    weights = resample_weights(len(matches.image_ids), resamples, seed, stream=split)
    return {name: defined(v) for name, v in ap_resamples(matches, weights).items()}


def average(per_split: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The resampled mean over splits (the OOD average over held-out domains): resample b of
    the mean is the mean of each split's resample b, each split resampled independently. NaN
    where a split's statistic is undefined."""
    if not per_split:
        raise ValueError("an average over splits needs at least one split")
    return {name: np.mean([s[name] for s in per_split], axis=0) for name in per_split[0]}


def percentile_interval(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval: the (1 -/+ confidence) / 2 quantiles of the resampled
    values (linear interpolation), over the resamples where the statistic is defined (not NaN);
    NaN without any."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence}")
    values = np.asarray(values, np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        return float("nan"), float("nan")
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def centered_interval(
    estimate: float, resampled: np.ndarray, confidence: float = 0.95
) -> tuple[float, float] | None:
    """estimate -/+ z * (the resamples' standard deviation), clipped to [0, 1]; None with fewer
    than two defined resamples.

    AP is biased upwards on a resample (it holds about 63% distinct images, and AP's precision
    envelope, a maximum over a noisier curve, grows on fewer of them): on COCO-like data with 80
    categories the resamples sit 2.4 standard errors above the estimate, so the percentile
    interval misses the estimate. The spread of the resamples is still the standard error, so
    the interval is centered on the estimate instead.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence}")
    values = np.asarray(resampled, np.float64)
    values = values[~np.isnan(values)]
    if len(values) < 2:
        return None
    # The normal quantile (scipy.stats.norm.ppf is this function; scipy.stats would add a
    # second to the import of every training process).
    half = float(scipy.special.ndtri((1 + confidence) / 2)) * float(np.std(values, ddof=1))
    return max(0.0, estimate - half), min(1.0, estimate + half)


def paired_p_value(differences: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "no difference" from resampled paired differences: twice
    the smaller share of resamples on either side of 0, each share counted as (1 + k) / (1 + B)
    so that a finite number of resamples never claims p = 0. It falls below 1 - confidence about
    when 0 lies outside the percentile interval. NaN without any defined difference."""
    d = np.asarray(differences, np.float64)
    d = d[~np.isnan(d)]
    if not len(d):
        return float("nan")
    smaller = min(int(np.sum(d <= 0)), int(np.sum(d >= 0)))
    return min(1.0, 2 * (1 + smaller) / (1 + len(d)))


def defined(values: np.ndarray) -> np.ndarray:
    """COCO's -1 ("no ground truth") as NaN, so that intervals and averages skip it."""
    values = np.asarray(values, np.float64)
    return np.where(values < 0, np.nan, values)


def resampled_dataset(
    gt: Mapping[str, Any], detections: Sequence[Mapping[str, Any]], weights: np.ndarray
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The dataset a row of weights stands for, built explicitly (the reference the bootstrap
    equals, and a slow way to compute it): image i, in id order, weights[i] times, each copy an
    image of its own with the next ids from 1, with copies of its ground truth and detections in
    their original order. Annotation ids are renumbered from 1, so pycocotools' reading of a
    match to annotation id 0 as no match, which the matches keep, is not carried over."""
    images = sorted(gt["images"], key=lambda im: im["id"])
    weights = np.asarray(weights)
    if weights.shape != (len(images),):
        raise ValueError(f"weights must be [{len(images)} images], got {weights.shape}")
    copies, next_id = {}, 1
    for image, w in zip(images, weights.tolist()):
        copies[image["id"]] = range(next_id, next_id + w)
        next_id += w
    new_images = [{**im, "id": c} for im in images for c in copies[im["id"]]]
    annotations = [{**a, "image_id": c} for a in gt["annotations"] for c in copies[a["image_id"]]]
    for i, a in enumerate(annotations):
        a["id"] = i + 1
    new_detections = [{**d, "image_id": c} for d in detections for c in copies[d["image_id"]]]
    return {**gt, "images": new_images, "annotations": annotations}, new_detections


# ----------------------------------------------------------------------------------------
# Preparation: what does not depend on the weights, once per (matches, area range).


@dataclasses.dataclass(frozen=True)
class _Curve:
    """One (category, IoU threshold) precision-recall curve, at its true positives."""

    tp_image: np.ndarray  # [P] image of each true positive, in accumulate order
    event: np.ndarray  # [P] its index among the category's events (true positives at any t)
    ignored_image: np.ndarray  # [G] images of the candidates ignored at this threshold
    ignored_through: np.ndarray  # [P] how many of those lie at or before each true positive
    # Per true positive, None when the curve has no mixed run; read for those in one: whether it
    # is in one, its run's true positives up to and including it and false positives before it,
    # the run's totals, and the index of the run's first true positive.
    mixed: np.ndarray | None = None  # [P] bool
    tp_in_run: np.ndarray | None = None
    fp_in_run: np.ndarray | None = None
    run_tp: np.ndarray | None = None
    run_fp: np.ndarray | None = None
    run_first: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Category:
    # [E, I]: detections that count (all but those ignored at every threshold) in each stretch
    # (previous event, event], per image.
    counted: scipy.sparse.csr_matrix
    curves: tuple[_Curve, ...]  # one per IoU threshold

    @property
    def longest(self) -> int:
        """Points of the longest [resamples, points] array it needs."""
        return max([1, self.counted.shape[0], *(len(c.tp_image) for c in self.curves)])


@dataclasses.dataclass(frozen=True)
class _Plan:
    num_positive: np.ndarray  # [I, K] non-ignored ground truth of the area range
    categories: tuple[_Category, ...]


def _prepare(m: coco.Matches, area: int) -> _Plan:
    bounds = np.searchsorted(m.category, np.arange(len(m.category_ids) + 1))
    cand_bounds = np.searchsorted(m.candidate, bounds)
    categories = tuple(
        _prepare_category(m, area, slice(bounds[k], bounds[k + 1]), cand_bounds[k : k + 2])
        for k in range(len(m.category_ids))
    )
    return _Plan(num_positive=m.num_positive[:, :, area].astype(np.int64), categories=categories)


def _prepare_category(m: coco.Matches, area: int, dets: slice, cand_bounds) -> _Category:
    num_t = len(coco.IOU_THRESHOLDS)
    n = dets.stop - dets.start
    if not n:
        nothing = np.zeros(0, np.int64)
        return _Category(
            counted=scipy.sparse.csr_matrix((0, len(m.image_ids))),
            curves=(_Curve(nothing, nothing, nothing, nothing),) * num_t,
        )
    image, score = m.image[dets], m.score[dets]
    cand = m.candidate[cand_bounds[0] : cand_bounds[1]] - dets.start
    in_range = ~m.out_of_range[dets, area]
    tp = np.zeros((n, num_t), bool)
    tp[cand] = m.tp[cand_bounds[0] : cand_bounds[1], :, area]
    fp = np.repeat(in_range[:, None], num_t, axis=1)  # non-candidates: false unless out of range
    fp[cand] = m.fp[cand_bounds[0] : cand_bounds[1], :, area]
    counted = in_range.copy()
    counted[cand] = True
    ignored = counted[:, None] & ~tp & ~fp
    # Detections ignored at every threshold (most of those a crowd region absorbs) never count;
    # those ignored at some thresholds only are subtracted curve by curve.
    always = ignored.all(axis=1)
    counted &= ~always
    ignored &= ~always[:, None]

    events = np.flatnonzero(tp.any(axis=1))
    q = np.flatnonzero(counted)
    stretch = np.searchsorted(events, q, side="left")
    q, stretch = q[stretch < len(events)], stretch[stretch < len(events)]
    counted_matrix = scipy.sparse.csr_matrix(
        (np.ones(len(q), np.int64), (stretch, image[q])), shape=(len(events), len(m.image_ids))
    )
    counted_matrix.sum_duplicates()

    runs = _tie_runs(image, score, tp, fp)
    curves = []
    for t in range(num_t):
        p = np.flatnonzero(tp[:, t])
        ign = np.flatnonzero(ignored[:, t])
        curve = dict(
            tp_image=image[p],
            event=np.searchsorted(events, p),
            ignored_image=image[ign],
            ignored_through=np.searchsorted(ign, p, side="right"),
        )
        curves.append(_Curve(**curve, **_mixed_runs(runs, p, t)))
    return _Category(counted=counted_matrix, curves=tuple(curves))


def _tie_runs(image, score, tp, fp) -> dict[str, np.ndarray]:
    """Runs of one image's equal scores (detections of a category in accumulate order are
    grouped by score, then image): each detection's run, the runs' true/false positive counts
    per threshold, and inclusive within-run prefix counts."""
    start = np.r_[True, (image[1:] != image[:-1]) | (score[1:] != score[:-1])]
    run = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    tp_cum, fp_cum = np.cumsum(tp, axis=0), np.cumsum(fp, axis=0)
    run_tp = np.add.reduceat(tp.astype(np.int64), first, axis=0)
    run_fp = np.add.reduceat(fp.astype(np.int64), first, axis=0)
    return dict(
        run=run,
        run_tp=run_tp,
        run_fp=run_fp,
        tp_in_run=tp_cum - (tp_cum[first] - tp[first])[run],
        fp_in_run=fp_cum - (fp_cum[first] - fp[first])[run],
    )


def _mixed_runs(runs, p: np.ndarray, t: int) -> dict[str, np.ndarray]:
    """The `_Curve` fields of mixed runs for true positives at positions `p`, threshold `t`."""
    run = runs["run"][p]
    run_tp, run_fp = runs["run_tp"][run, t], runs["run_fp"][run, t]
    mixed = (run_tp > 0) & (run_fp > 0)
    if not mixed.any():
        return {}
    return dict(
        mixed=mixed,
        tp_in_run=runs["tp_in_run"][p, t].astype(np.int64),
        fp_in_run=runs["fp_in_run"][p, t].astype(np.int64),
        run_tp=run_tp.astype(np.int64),
        run_fp=run_fp.astype(np.int64),
        run_first=np.searchsorted(run, run, side="left"),
    )


# ----------------------------------------------------------------------------------------
# Evaluation under weights.
#
# Why weighted counts are pycocotools' AP on the explicit dataset, where each drawn copy is an
# image of its own and the copies of an image follow each other in id order (which orders tied
# scores): the 101-point precision reads the curve only at true positives, and the w copies of a
# true positive follow each other with the same false-positive count before them, so the last
# copy has the highest precision and recall of them and stands for all. Except inside a run of
# one image's tied detections (same category, same score), which the explicit dataset repeats
# whole, copy after copy: a run holding true and false positives ("mixed") puts false positives
# between the copies' true positives, so those are points of their own, added in closed form.
#
# Weighted false-positive counts come from one scipy.sparse product per category (detections per
# image between consecutive true positives, times the weights): O(detections x resamples)
# multiply-adds plus O(true positives x resamples) per threshold. numpy rather than JAX: every
# curve has its own length, so jit would compile once per curve (about 50 per split), and even
# compiled, an XLA version of the per-curve core (gather, cumulative sum, division, running
# maximum, search) was no faster on a 2-core CPU: 0.29 s of wall time on both cores against
# numpy's 0.32 s on one, for the bench's largest curve under 1,000 resamples.


def _precision(plan: _Plan, weights: np.ndarray) -> np.ndarray:
    """[B, K, T, R] interpolated precision at maxDets=100 (coco's eval precision, transposed).

    Counts are int64 (exact, and numpy's cumulative sums run several times faster on integers
    than on floats); they become float64 only in the division, as in the evaluator. Resamples
    go in chunks small enough for a category's [chunk, points] arrays to stay in cache.
    """
    num_b = len(weights)
    num_t, num_r = len(coco.IOU_THRESHOLDS), len(coco.RECALL_THRESHOLDS)
    precision = np.empty((num_b, len(plan.categories), num_t, num_r))
    positives = weights @ plan.num_positive  # [B, K]
    copies = int(weights.max()) if weights.size else 0
    for k, category in enumerate(plan.categories):
        slots = [_copy_slots(curve, copies) for curve in category.curves]
        chunk = max(1, _CHUNK_ELEMENTS // category.longest)
        for lo in range(0, num_b, chunk):
            w = np.asarray(weights[lo : lo + chunk], np.int64)
            need = np.maximum(coco.recall_targets(positives[lo : lo + chunk, k]), 1)  # [b, R]
            counted = np.ascontiguousarray((category.counted @ np.ascontiguousarray(w.T)).T)
            counted = np.cumsum(counted, axis=1)
            for t, curve in enumerate(category.curves):
                precision[lo : lo + chunk, k, t] = _curve_precision(
                    curve, w, counted, need, slots[t]
                )
        precision[positives[:, k] == 0, k] = -1.0
    return precision


def _curve_precision(curve: _Curve, w, counted, need, slots) -> np.ndarray:
    """[b, R] interpolated precision of one curve under weights w [b, I]; `counted` [b, E] is
    the weighted count of counted detections through each of the category's events."""
    if not len(curve.tp_image):
        return np.zeros(need.shape)
    w_tp = w[:, curve.tp_image]
    tp = np.cumsum(w_tp, axis=1)
    seen = counted[:, curve.event]  # true + false positives through each true positive
    if len(curve.ignored_image):
        ignored = np.cumsum(w[:, curve.ignored_image], axis=1)
        ignored = np.concatenate([np.zeros((len(w), 1), np.int64), ignored], axis=1)
        seen -= ignored[:, curve.ignored_through]
    pr = _precision_at(tp, seen)
    if slots is None:
        return _interpolate(tp, pr, need)
    # A mixed run's weighted points are not points of the explicit dataset: the run's copies,
    # a separate sorted set, stand for it. The envelope over the union of two sets of points is
    # the larger of the two envelopes.
    pr[:, curve.mixed] = -np.inf
    copy_tp, copy_pr = _copies_of_mixed_runs(curve, slots, w_tp, tp, seen)
    return np.maximum(_interpolate(tp, pr, need), _interpolate(copy_tp, copy_pr, need))


def _precision_at(tp: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """The evaluator's tp / (fp + tp + eps); fp + tp, a sum of integers, is exactly `seen`."""
    return tp.astype(np.float64) / (seen + np.spacing(1))


def _copy_slots(curve: _Curve, copies: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For each point of a mixed run's copies, its true positive and copy number, in the
    explicit dataset's order (a run: copy after copy); None when no copy can matter (no mixed
    run, or no image drawn more than once)."""
    if curve.mixed is None or copies <= 1:
        return None
    mixed = np.flatnonzero(curve.mixed)
    point = np.repeat(mixed, copies)
    copy = np.tile(np.arange(copies), len(mixed))
    order = np.lexsort((point, copy, curve.run_first[point]))
    return point[order], copy[order]


def _copies_of_mixed_runs(curve: _Curve, slots, w_tp, tp, seen):
    """True-positive counts [b, S] and precision of the points of mixed runs' copies.

    The explicit dataset repeats a run whole: copy c's j-th true positive comes after c full
    runs, with tp0 + c * run_tp + tp_in_run true positives and seen0 + c * (run_tp + run_fp) +
    tp_in_run + fp_in_run counted detections, where tp0, seen0 count what precedes the run.
    Slots for c = 0 .. copies - 1 are laid out for every resample (fixed shape); those with
    c >= the image's weight get precision -inf and the count at the run's end, so that counts
    stay sorted along a row.
    """
    point, copy = slots
    w = w_tp[:, point]
    tp_in, run_tp = curve.tp_in_run[point], curve.run_tp[point]
    seen_in = tp_in + curve.fp_in_run[point]
    valid = copy < w
    copy_tp = tp[:, point] - w * tp_in + np.where(valid, copy * run_tp + tp_in, w * run_tp)
    copy_seen = seen[:, point] - w * seen_in + copy * (run_tp + curve.run_fp[point]) + seen_in
    copy_pr = _precision_at(copy_tp, copy_seen)
    copy_pr[~valid] = -np.inf
    return copy_tp, copy_pr


def _interpolate(tp: np.ndarray, pr: np.ndarray, need: np.ndarray) -> np.ndarray:
    """COCO's 101-point precision per row: at recall threshold j, the highest precision at or
    after the first point whose true-positive count reaches need[:, j]; 0 when none does.

    tp [b, S] is sorted along each row, so all rows are searched at once after shifting row r's
    counts by r * (largest count + 1). The points from one threshold's first point to the
    next's are disjoint stretches of the flattened rows: one maximum.reduceat gives each
    stretch's maximum, and a running maximum over the 101 of them from the right the envelope.
    """
    num_b, num_s = tp.shape
    rows = np.arange(num_b)[:, None]
    shift = (max(int(tp.max()), int(need.max())) + 1) * rows
    first = np.searchsorted((tp + shift).ravel(), (need + shift).ravel(), side="left")
    first = first.reshape(need.shape) - num_s * rows  # [b, R], num_s where none reaches need
    bounds = np.concatenate([first, np.full((num_b, 1), num_s)], axis=1) + num_s * rows
    flat = np.append(pr.ravel(), -np.inf)  # the last row's end is a valid index
    stretch = np.maximum.reduceat(flat, bounds.ravel()).reshape(num_b, -1)[:, :-1]
    stretch[first == np.append(first[:, 1:], np.full((num_b, 1), num_s), axis=1)] = -np.inf
    envelope = np.maximum.accumulate(stretch[:, ::-1], axis=1)[:, ::-1]
    return np.where(first < num_s, envelope, 0.0)


def _masked_means(precision: np.ndarray) -> np.ndarray:
    """[B] of pycocotools' summarize (mean of the entries > -1) over precision [B, T, R, K].

    Rows with the same categories present are averaged together, each row flattened in the
    evaluator's element order, so the result is the evaluator's to the last bit.
    """
    present = precision[:, 0, 0, :] > -1  # a category is -1 throughout or nowhere
    out = np.full(len(precision), -1.0)
    patterns, which = np.unique(present, axis=0, return_inverse=True)
    for i, pattern in enumerate(patterns):
        rows = np.flatnonzero(which.reshape(-1) == i)
        if not pattern.any():
            continue
        selected = precision if len(rows) == len(precision) else precision[rows]
        if not pattern.all():
            selected = selected[..., pattern]
        out[rows] = selected.reshape(len(rows), -1).mean(axis=1)
    return out
