"""The bootstrap of COCO AP over images (ood_jax.metrics.bootstrap), its use in results.json /
results.md (ood_jax.detection.evaluation) and the paired comparison of two workdirs
(ood_jax.detection.compare).

The reference is always the explicitly resampled dataset (each drawn copy of an image a new
image with its ground truth and detections, `bootstrap.resampled_dataset`) run through our
evaluator and pycocotools: the bootstrap must give the same AP without matching again.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex

import numpy as np
import scipy.stats
import pytest

from ood_jax.cli import compare as compare_cli
from ood_jax.detection import compare, evaluation
from ood_jax.metrics import bootstrap, coco
from ood_jax.testing.coco_cases import random_case

ALL_AREAS = ("all", "small", "medium", "large")
AP_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")
# Ties inside an image (rounded scores, exact duplicate detections) make runs that hold true and
# false positives, the one place where weighted counts differ from the explicit dataset.
TIED = dict(tie_fraction=0.5, tie_decimals=1, duplicate_det_fraction=0.2)


def _case(seed, **overrides):
    kw = dict(num_images=25, dets_per_image=30, crowd_fraction=0.1, **TIED)
    kw.update(overrides)
    return random_case(seed, **kw)


def _pycocotools_stats(gt, dets) -> dict[str, float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = {**gt, "annotations": [dict(a) for a in gt["annotations"]]}
        coco_gt.createIndex()
        E = COCOeval(coco_gt, coco_gt.loadRes([dict(d) for d in dets]), "bbox")
        E.evaluate()
        E.accumulate()
        E.summarize()
    return dict(zip(coco.STAT_NAMES, map(float, E.stats)))


def _explicit(gt, dets, weights) -> list[dict[str, float]]:
    return [coco.evaluate(*bootstrap.resampled_dataset(gt, dets, row)) for row in weights]


# ------------------------------------------------------------------------------------------------
# The bootstrap's AP is the evaluator's on the resampled dataset.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_resamples_equal_the_evaluator_on_the_resampled_dataset(seed):
    gt, dets = _case(seed)
    matches = coco.evaluate_detailed(gt, dets).matches
    weights = bootstrap.resample_weights(len(matches.image_ids), 6, seed=seed, stream="test")
    got = bootstrap.ap_resamples(matches, weights, areas=ALL_AREAS)
    for b, want in enumerate(_explicit(gt, dets, weights)):
        for name in AP_NAMES:
            assert got[name][b] == want[name], (b, name, got[name][b], want[name])


@pytest.mark.parametrize("seed", range(2))
def test_resamples_equal_pycocotools_on_the_resampled_dataset(seed):
    pytest.importorskip("pycocotools")
    gt, dets = _case(10 + seed)
    matches = coco.evaluate_detailed(gt, dets).matches
    weights = bootstrap.resample_weights(len(matches.image_ids), 3, seed=seed, stream="test")
    got = bootstrap.ap_resamples(matches, weights, areas=ALL_AREAS)
    for b, row in enumerate(weights):
        want = _pycocotools_stats(*bootstrap.resampled_dataset(gt, dets, row))
        for name in AP_NAMES:
            assert abs(got[name][b] - want[name]) <= 1e-12, (b, name, got[name][b], want[name])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(
            num_categories=8, unused_category_fraction=0.25, detection_only_category_fraction=0.25
        ),
        dict(big_group_fraction=0.5, dets_per_image=60),
        dict(empty_image_fraction=0.5, crowd_fraction=0.3),
        dict(num_images=1, dets_per_image=150, big_group_fraction=1.0),
    ],
    ids=["default", "categories_without_gt", "over_100_per_group", "empty_and_crowd", "one_image"],
)
def test_weights_all_one_give_the_plain_evaluation(overrides):
    gt, dets = _case(3, **overrides)
    result = coco.evaluate_detailed(gt, dets)
    ones = np.ones((2, len(result.matches.image_ids)), np.int32)
    got = bootstrap.ap_resamples(result.matches, ones, areas=ALL_AREAS)
    for name in AP_NAMES:
        assert got[name].tolist() == [result.stats[name]] * 2, name


def test_a_tied_run_with_a_true_and_a_false_positive_is_repeated_whole():
    """Image 1 holds two equal detections of its object (a true positive, then a false one, tied
    at 0.9); image 2 one true positive at 0.8. Drawn twice, image 1 gives TP FP TP FP, then TP:
    precision 1, 2/3, 3/5 at recall 1/3, 2/3, 1, so AP = (34 + 33 * 2/3 + 34 * 3/5) / 101 at
    every threshold. Weighting image 1's detections by 2 instead would read TP(2) FP(2) TP and
    give (67 + 34 * 3/5) / 101."""
    box = [10.0, 10.0, 40.0, 40.0]
    gt = {
        "images": [{"id": 1}, {"id": 2}],
        "categories": [{"id": 1}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": box, "area": 1600.0, "iscrowd": 0},
            {"id": 2, "image_id": 2, "category_id": 1, "bbox": box, "area": 1600.0, "iscrowd": 0},
        ],
    }
    dets = [
        {"image_id": 1, "category_id": 1, "bbox": box, "score": 0.9},
        {"image_id": 1, "category_id": 1, "bbox": box, "score": 0.9},
        {"image_id": 2, "category_id": 1, "bbox": box, "score": 0.8},
    ]
    matches = coco.evaluate_detailed(gt, dets).matches
    got = bootstrap.ap_resamples(matches, np.array([[2, 1]]))["AP"][0]
    assert got == pytest.approx((34 + 33 * 2 / 3 + 34 * 3 / 5) / 101, abs=1e-12)
    assert got == coco.evaluate(*bootstrap.resampled_dataset(gt, dets, [2, 1]))["AP"]


def test_weights_are_seeded_per_stream_and_draw_every_image_count():
    a = bootstrap.resample_weights(50, 200, seed=3, stream="sky")
    assert a.shape == (200, 50) and (a.sum(axis=1) == 50).all() and a.min() >= 0
    assert np.array_equal(a, bootstrap.resample_weights(50, 200, seed=3, stream="sky"))
    assert not np.array_equal(a, bootstrap.resample_weights(50, 200, seed=3, stream="dim"))
    assert not np.array_equal(a, bootstrap.resample_weights(50, 200, seed=4, stream="sky"))
    # Multinomial(50, 1/50) per row: each image's count has mean 1 and variance 1 - 1/50.
    assert abs(a.mean() - 1) < 1e-12 and abs(a.var() - 0.98) < 0.06


@pytest.mark.parametrize(
    "weights, message",
    [
        (np.ones((2, 3)), "weights must be [resamples, 25 images]"),
        (-np.ones((2, 25)), "non-negative integers"),
        (np.full((2, 25), 0.5), "non-negative integers"),
    ],
)
def test_bad_weights_are_refused(weights, message):
    matches = coco.evaluate_detailed(*_case(0)).matches
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        bootstrap.ap_resamples(matches, weights)


def test_percentile_interval_is_numpys_percentile_over_defined_values():
    values = np.random.default_rng(0).normal(size=999)
    low, high = bootstrap.percentile_interval(np.r_[values, np.nan], confidence=0.9)
    assert [low, high] == pytest.approx(np.percentile(values, [5, 95]), abs=1e-12)
    assert np.isnan(bootstrap.percentile_interval(np.full(3, np.nan))).all()


# ------------------------------------------------------------------------------------------------
# results.json / results.md: every split and the OOD average, each domain drawn independently.
# ------------------------------------------------------------------------------------------------

SPLITS = ("iid", "sky", "dim")


def _evaluations(seed_offset=0, **overrides):
    cases = {name: _case(i + seed_offset, **overrides) for i, name in enumerate(SPLITS)}
    return cases, {name: coco.evaluate_detailed(*case) for name, case in cases.items()}


def test_the_ood_average_interval_resamples_each_domain_independently():
    cases, results = _evaluations()
    resamples, seed = 15, 5
    intervals = evaluation.ap_intervals(
        {name: r.matches for name, r in results.items()},
        {name: r.stats for name, r in results.items()},
        resamples,
        seed,
    )
    # Slow loop: each split's own resamples (its name is its stream), evaluated explicitly.
    slow = {}
    for name, (gt, dets) in cases.items():
        weights = bootstrap.resample_weights(len(gt["images"]), resamples, seed, stream=name)
        slow[name] = np.array([s["AP"] for s in _explicit(gt, dets, weights)])
    for name in SPLITS:
        want = np.percentile(slow[name], [2.5, 97.5])
        got = (intervals["iid"] if name == "iid" else intervals["per_domain"][name])["AP"]
        assert [got["percentile_low"], got["percentile_high"]] == pytest.approx(want, abs=1e-12)
        half = scipy.stats.norm.ppf(0.975) * np.std(slow[name], ddof=1)
        ap = results[name].stats["AP"]
        assert [got["low"], got["high"]] == pytest.approx(
            [max(0, ap - half), min(1, ap + half)], abs=1e-12
        )
        assert got["se"] == pytest.approx(np.std(slow[name], ddof=1), abs=1e-12)
        assert got["bias"] == pytest.approx(
            slow[name].mean() - results[name].stats["AP"], abs=1e-12
        )
    average = (slow["sky"] + slow["dim"]) / 2
    got = intervals["ood_average"]["AP"]
    assert [got["percentile_low"], got["percentile_high"]] == pytest.approx(
        np.percentile(average, [2.5, 97.5]), abs=1e-12
    )
    plain = (results["sky"].stats["AP"] + results["dim"].stats["AP"]) / 2
    half = scipy.stats.norm.ppf(0.975) * np.std(average, ddof=1)
    assert [got["low"], got["high"]] == pytest.approx([plain - half, plain + half], abs=1e-12)
    assert got["bias"] == pytest.approx(average.mean() - plain, abs=1e-12)


def test_results_json_and_md_show_the_intervals(tmp_path):
    _, results = _evaluations()
    summary = evaluation.summarize(
        12, results["iid"], {d: results[d] for d in SPLITS[1:]}, resamples=40
    )
    evaluation.write_results(tmp_path, summary, "DETR")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "matches" not in saved and set(saved["iid"]) == set(coco.STAT_NAMES)
    intervals = saved["intervals"]
    assert intervals["resamples"] == 40 and intervals["confidence"] == 0.95
    assert set(intervals["per_domain"]) == {"sky", "dim"}
    for where in [intervals["iid"], intervals["ood_average"], *intervals["per_domain"].values()]:
        assert set(where) == set(bootstrap.STATS)
        for bounds in where.values():
            assert set(bounds) == {
                "low",
                "high",
                "percentile_low",
                "percentile_high",
                "se",
                "bias",
            }
            assert 0 <= bounds["low"] <= bounds["high"] <= 1 and bounds["se"] > 0

    table = (tmp_path / "results.md").read_text().splitlines()
    row = next(line for line in table if line.startswith("| DETR"))
    cells = [c.strip() for c in row.strip("|").split("|")]

    def cell(ap, bounds):
        return f"{ap:.3f} [{bounds['AP']['low']:.3f}, {bounds['AP']['high']:.3f}]"

    assert cells == [
        "DETR",
        cell(saved["iid"]["AP"], intervals["iid"]),
        cell(saved["per_domain"]["sky"]["AP"], intervals["per_domain"]["sky"]),
        cell(saved["per_domain"]["dim"]["AP"], intervals["per_domain"]["dim"]),
        cell(saved["ood_average"]["AP"], intervals["ood_average"]),
    ]
    assert any(
        "95% intervals, AP -/+ z s.e. with the s.e. from a bootstrap over images (40" in t
        for t in table
    )

    # matches.npz holds the evaluation's matches, field for field.
    loaded = compare.read_matches(tmp_path)
    assert list(loaded) == list(SPLITS)
    for name in SPLITS:
        for field, value in results[name].matches.arrays().items():
            assert np.array_equal(loaded[name].arrays()[field], value), (name, field)


def test_results_md_without_intervals_keeps_the_plain_table():
    results = {"step": 3, "iid": {"AP": 0.25, "AP50": 0.5}, "per_domain": {"sky": {"AP": 0.125}}}
    results["ood_average"] = {"AP": 0.125}
    assert "| m | 0.250 | 0.125 | 0.125 |" in evaluation.results_markdown(results, "m")


def test_intervals_are_centered_on_the_estimate_however_biased_the_resamples():
    """Resampled AP is biased upwards; the interval holds the estimate all the same."""
    resampled = np.full(200, 0.33) + np.random.default_rng(0).normal(0, 0.005, 200)
    low, high = bootstrap.centered_interval(0.30, resampled)
    half = scipy.stats.norm.ppf(0.975) * np.std(resampled, ddof=1)
    assert (low, high) == pytest.approx((0.30 - half, 0.30 + half), abs=1e-12)
    # The percentile interval of the same resamples misses the estimate.
    assert bootstrap.percentile_interval(resampled)[0] > 0.30
    assert bootstrap.centered_interval(0.999, resampled)[1] == 1.0
    assert bootstrap.centered_interval(0.3, np.array([0.3, np.nan])) is None


# ------------------------------------------------------------------------------------------------
# compare-detectors: the paired bootstrap, against a slow loop, and its refusals.
# ------------------------------------------------------------------------------------------------


def _other_detector(dets, seed):
    """Detector B on the same images: A's detections with scores redrawn and a fifth dropped."""
    rng = np.random.default_rng(seed)
    keep = rng.random(len(dets)) > 0.2
    return [{**d, "score": float(rng.random())} for d, k in zip(dets, keep) if k]


def _workdir(path, cases):
    results = {name: coco.evaluate_detailed(*case) for name, case in cases.items()}
    summary = evaluation.summarize(
        1, results["iid"], {d: r for d, r in results.items() if d != "iid"}, resamples=5
    )
    evaluation.write_results(path, summary, "model")
    return path


def test_the_paired_bootstrap_matches_a_slow_loop(tmp_path):
    cases_a, _ = _evaluations()
    cases_b = {
        n: (gt, _other_detector(dets, i)) for i, (n, (gt, dets)) in enumerate(cases_a.items())
    }
    a, b = _workdir(tmp_path / "a", cases_a), _workdir(tmp_path / "b", cases_b)
    resamples, seed = 12, 2
    result = compare.compare(a, b, resamples=resamples, seed=seed)

    diffs = {}
    for name in SPLITS:
        weights = bootstrap.resample_weights(25, resamples, seed, stream=name)
        stats_a = _explicit(*cases_a[name], weights)
        stats_b = _explicit(*cases_b[name], weights)
        diffs[name] = {
            k: np.array([x[k] - y[k] for x, y in zip(stats_a, stats_b)]) for k in ("AP", "AP50")
        }
        row = result["splits"][name]
        plain_a, plain_b = coco.evaluate(*cases_a[name]), coco.evaluate(*cases_b[name])
        for k in ("AP", "AP50"):
            assert row[k]["a"] == plain_a[k] and row[k]["b"] == plain_b[k]
            want = np.percentile(diffs[name][k], [2.5, 97.5])
            assert [row[k]["low"], row[k]["high"]] == pytest.approx(want, abs=1e-12)
    ood = (diffs["sky"]["AP"] + diffs["dim"]["AP"]) / 2
    got = result["splits"]["ood_average"]["AP"]
    assert [got["low"], got["high"]] == pytest.approx(np.percentile(ood, [2.5, 97.5]), abs=1e-12)
    smaller = min((ood <= 0).sum(), (ood >= 0).sum())
    assert got["p_value"] == pytest.approx(min(1.0, 2 * (1 + smaller) / (1 + resamples)))


def _parser():
    parser = argparse.ArgumentParser(prog="ood-jax")
    compare_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


def test_compare_detectors_command_prints_the_table(tmp_path, capsys):
    cases, _ = _evaluations()
    a = _workdir(tmp_path / "a", cases)
    b = _workdir(tmp_path / "b", {n: (gt, _other_detector(d, 0)) for n, (gt, d) in cases.items()})
    args = _parser().parse_args(["compare-detectors", str(a), str(b), "--resamples", "20"])
    result = args.run(args)
    out = capsys.readouterr().out
    assert f"A = {a}" in out and "20 paired resamples" in out
    for split in [*SPLITS, "ood_average"]:
        line = next(t for t in out.splitlines() if t.startswith(split + " "))
        assert f"{result['splits'][split]['AP']['difference']:+.3f}" in line
    args = _parser().parse_args(
        ["compare-detectors", str(a), str(b), "--resamples", "20", "--json"]
    )
    args.run(args)
    assert json.loads(capsys.readouterr().out) == result
    # A workdir compared with itself: no difference in any resample.
    same = compare.compare(a, a, resamples=10)["splits"]["iid"]["AP"]
    assert same["difference"] == same["low"] == same["high"] == 0 and same["p_value"] == 1


def _one_line_error(a, b) -> str:
    with pytest.raises(ValueError) as e:
        compare.compare(a, b, resamples=5)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_compare_detectors_refuses_mismatched_splits(tmp_path):
    cases, _ = _evaluations()
    a = _workdir(tmp_path / "a", cases)

    fewer = dict(cases)
    gt, dets = cases["sky"]
    kept = {im["id"] for im in gt["images"][:-1]}
    fewer["sky"] = (
        {
            **gt,
            "images": gt["images"][:-1],
            "annotations": [x for x in gt["annotations"] if x["image_id"] in kept],
        },
        [d for d in dets if d["image_id"] in kept],
    )
    message = _one_line_error(a, _workdir(tmp_path / "fewer", fewer))
    assert "split 'sky'" in message and "different images" in message and "25 and 24" in message

    moved = dict(cases)
    gt, dets = cases["dim"]
    shifted = [dict(x, bbox=[x["bbox"][0] + 1, *x["bbox"][1:]]) for x in gt["annotations"]]
    moved["dim"] = ({**gt, "annotations": shifted}, dets)
    message = _one_line_error(a, _workdir(tmp_path / "moved", moved))
    assert "split 'dim'" in message and "different ground truth" in message

    message = _one_line_error(
        a, _workdir(tmp_path / "no_dim", {n: cases[n] for n in ("iid", "sky")})
    )
    assert "different splits" in message and "['dim']" in message

    message = _one_line_error(a, tmp_path / "never_evaluated")
    assert "matches.npz: not found" in message


def test_a_damaged_matches_file_names_the_field(tmp_path):
    cases, _ = _evaluations()
    a = _workdir(tmp_path / "a", cases)
    data = dict(np.load(a / compare.MATCHES_FILE))
    del data["1.tp"]
    np.savez(a / compare.MATCHES_FILE, **data)
    with pytest.raises(ValueError, match=r"matches.npz split 'sky': missing field 'tp'"):
        compare.read_matches(a)


def test_compare_detectors_help_examples_parse():
    parser = argparse.ArgumentParser(prog="ood-jax")
    command = compare_cli.add_compare_detectors(
        parser.add_subparsers(dest="command", required=True)
    )
    examples = [
        line.strip()
        for line in command.format_help().splitlines()
        if line.strip().startswith("ood-jax ")
    ]
    assert len(examples) == 2
    for example in examples:
        args = parser.parse_args(shlex.split(example)[1:])
        assert args.run is not None and args.workdir_a and args.workdir_b
