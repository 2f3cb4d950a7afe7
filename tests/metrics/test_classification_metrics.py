"""ood_jax.metrics.classification against sklearn.metrics on randomized and degenerate labels."""

import numpy as np
import pytest
from sklearn import metrics as skm

from ood_jax.metrics.classification import accuracy_by_bucket, binary_report


def sklearn_report(t: np.ndarray, p: np.ndarray) -> dict:
    return {
        "accuracy": skm.accuracy_score(t, p),
        "precision": skm.precision_score(t, p, zero_division=0),
        "recall": skm.recall_score(t, p, zero_division=0),
        "f1": skm.f1_score(t, p, zero_division=0),
        "mcc": skm.matthews_corrcoef(t, p),
    }


def label_cases(rng: np.random.Generator):
    for _ in range(150):
        n = int(rng.integers(1, 60))
        t = rng.random(n) < rng.uniform(0, 1)
        p = rng.random(n) < rng.uniform(0, 1)
        yield t, p
    for n in (1, 2, 7):
        ones, zeros = np.ones(n, bool), np.zeros(n, bool)
        yield from [(ones, ones), (ones, zeros), (zeros, ones), (zeros, zeros)]
        mixed = np.arange(n) % 2 == 0
        yield from [(mixed, ones), (mixed, zeros), (ones, mixed), (zeros, mixed)]


# sklearn warns when a degenerate case holds a single label; that case is the point here.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:A single label was found")
def test_binary_report_matches_sklearn():
    rng = np.random.default_rng(0)
    for t, p in label_cases(rng):
        # Also as 0/1 integers, the other accepted encoding.
        for tt, pp in ((t, p), (t.astype(int), p.astype(np.int8))):
            got = binary_report(tt, pp)
            want = sklearn_report(t.astype(int), p.astype(int))
            for key, value in want.items():
                assert got[key] == pytest.approx(value, abs=1e-12), (key, t, p)
            assert got["support"] == len(t)
            cm = skm.confusion_matrix(t, p, labels=[False, True])
            assert (got["tn"], got["fp"], got["fn"], got["tp"]) == tuple(cm.ravel())


def test_binary_report_bad_input():
    with pytest.raises(ValueError, match="y_true is empty"):
        binary_report([], [])
    with pytest.raises(ValueError, match="same length"):
        binary_report([0, 1], [0, 1, 1])
    with pytest.raises(ValueError, match="y_pred must hold bools or 0/1"):
        binary_report([0, 1], [0, 2])
    with pytest.raises(ValueError, match="y_true must be 1-D"):
        binary_report([[0, 1]], [[0, 1]])


def test_accuracy_by_bucket():
    rng = np.random.default_rng(1)
    correct = rng.random(500) < 0.6
    buckets = rng.choice(["S", "M", "L"], 500)
    got = accuracy_by_bucket(correct, buckets)
    assert list(got) == ["L", "M", "S"]
    for key in "SML":
        sel = buckets == key
        assert got[key]["count"] == sel.sum()
        assert got[key]["accuracy"] == pytest.approx(correct[sel].mean())
    assert accuracy_by_bucket([1, 0, 1], [2, 2, 3]) == {
        2: {"accuracy": 0.5, "count": 2},
        3: {"accuracy": 1.0, "count": 1},
    }
    with pytest.raises(ValueError, match="buckets must have one entry per example"):
        accuracy_by_bucket([1, 0], ["S"])
