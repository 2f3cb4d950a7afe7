"""Yes/no classification metrics for MLLM answers (OODBench's ACC, precision, recall, F1, MCC).

Each metric is computed from the four confusion counts in closed form, so scoring is one pass of
vectorized numpy. Undefined ratios (a zero denominator) are 0.0, as sklearn's zero_division=0
and as its matthews_corrcoef.
"""

import numpy as np


def _binary_labels(name: str, y: object) -> np.ndarray:
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if arr.dtype != bool:
        if not np.isin(arr, (0, 1)).all():
            bad = arr[~np.isin(arr, (0, 1))][:5]
            raise ValueError(f"{name} must hold bools or 0/1, found e.g. {bad.tolist()}")
        arr = arr.astype(bool)
    return arr


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den else 0.0


def _ratios(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def f1_from_counts(tp, fp, fn) -> np.ndarray:
    """F1 from confusion counts (or their means), elementwise: 2PR / (P + R) in counts, 0 where
    tp is 0, as with zero_division=0."""
    tp, fp, fn = (np.asarray(x, np.float64) for x in (tp, fp, fn))
    return _ratios(2 * tp, 2 * tp + fp + fn)


def mcc_from_counts(tp, fp, fn, tn) -> np.ndarray:
    """Matthews' correlation from confusion counts (or their means), elementwise; 0 where it is
    undefined, as sklearn's matthews_corrcoef. In floats: products of counts overflow int64
    beyond ~3e9 examples per factor pair."""
    tp, fp, fn, tn = (np.asarray(x, np.float64) for x in (tp, fp, fn, tn))
    den = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return _ratios(tp * tn - fp * fn, den)


def binary_report(y_true: object, y_pred: object) -> dict:
    """Accuracy, precision, recall, F1 and MCC with "yes" (True / 1) as the positive class.

    Returns those five floats, support (number of examples) and the confusion counts tp, fp, fn,
    tn. Matches sklearn's accuracy_score, precision/recall/f1_score(zero_division=0) and
    matthews_corrcoef.
    """
    t, p = _binary_labels("y_true", y_true), _binary_labels("y_pred", y_pred)
    if t.shape != p.shape:
        raise ValueError(f"y_true and y_pred must have the same length, got {t.size} and {p.size}")
    tp = int(np.count_nonzero(t & p))
    fp = int(np.count_nonzero(~t & p))
    fn = int(np.count_nonzero(t & ~p))
    tn = t.size - tp - fp - fn
    return {
        "accuracy": (tp + tn) / t.size,
        "precision": _ratio(tp, tp + fp),
        "recall": _ratio(tp, tp + fn),
        "f1": float(f1_from_counts(tp, fp, fn)),
        "mcc": float(mcc_from_counts(tp, fp, fn, tn)),
        "support": int(t.size),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
    }


def accuracy_by_bucket(correct: object, buckets: object) -> dict:
    """Accuracy per bucket (e.g. object size S/M/L): {bucket: {"accuracy", "count"}}.

    Buckets appear in sorted order; `correct` is bool or 0/1 per example.
    """
    c = _binary_labels("correct", correct)
    b = np.asarray(buckets)
    if b.shape != c.shape:
        raise ValueError(f"buckets must have one entry per example ({c.size}), got shape {b.shape}")
    keys, inverse = np.unique(b, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(keys))
    hits = np.bincount(inverse, weights=c, minlength=len(keys))
    return {
        key.item(): {"accuracy": float(h / n), "count": int(n)}
        for key, h, n in zip(keys, hits, counts, strict=True)
    }
