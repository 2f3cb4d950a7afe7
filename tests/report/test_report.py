"""`ood-jax report` (ood_jax.report) on run directories written here by the real writers:
detector workdirs by ood_jax.detection.evaluation (`summarize`, `write_results`) on seeded
random COCO cases and ood_jax.manifest, eval-mllm runs by the runner's `build_results` over
prediction records scored by each task (FOCI, OODBench, OODBench BAP, COUNTS OODG; MLLMs and
the CLIP baseline's identity), and corruptions.json in the schema the corruption benchmark
writes. The fit is checked against numpy.polyfit and scipy.stats.linregress, the page in
headless Chromium (Debian's `chromium`): it loads with no console message (no script error, no
blocked load), names every run, holds every figure, and its screenshot is no blank page.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import string
import subprocess

import numpy as np
import pytest
import scipy.special
import scipy.stats
from PIL import Image

from ood_jax import files, manifest, report
from ood_jax.cli import report as report_command
from ood_jax.detection import evaluation
from ood_jax.eval import clip_baseline
from ood_jax.eval import store
from ood_jax.eval import results as run_results
from ood_jax.eval.tasks import CountsOodgScoring, FociScoring, OodBenchBapScoring
from ood_jax.eval.tasks import OodBenchScoring
from ood_jax.eval.tasks.base import scored
from ood_jax.metrics import coco
from ood_jax.report import fit, read
from ood_jax.report.runs import Pair, Run, RunError, Score, Shift
from ood_jax.testing.coco_cases import random_case

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_TIMEOUT_S = 90
LETTERS = string.ascii_uppercase[:4]
CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)


# ---------------------------------------------------------------------------------------------
# Run directories, written by the real writers
# ---------------------------------------------------------------------------------------------

# Detectors: (name, share of detections kept in-domain, on the held-out domains).
DETECTORS = (
    ("detr_r50", 0.95, 0.55),
    ("dino_r50", 0.85, 0.6),
    ("deformable_detr", 0.6, 0.3),
    ("detr_vit", 0.4, 0.25),
)
HELD_OUT = ("sky", "dim")
# The data, the same for every detector: a seeded COCO case per split.
SPLIT_SEEDS = {"iid": 11, "sky": 12, "dim": 13}


def write_detector(directory: pathlib.Path, name: str, kept_in: float, kept_out: float) -> None:
    rng = np.random.default_rng(len(name))
    evaluated = {}
    for split, seed in SPLIT_SEEDS.items():
        gt, dets = random_case(seed, num_images=16, dets_per_image=15)
        keep = rng.random(len(dets)) < (kept_in if split == "iid" else kept_out)
        evaluated[split] = coco.evaluate_detailed(gt, [d for d, k in zip(dets, keep) if k])
    held_out = {d: evaluated[d] for d in HELD_OUT}
    summary = evaluation.summarize(100, evaluated["iid"], held_out, resamples=20)
    evaluation.write_results(directory, summary, name)
    # What ood_jax.train.run_manifest.start records of the config and the data.
    about = manifest.collect(
        "evaluate",
        config={"model_name": name, "model": name.split("_")[0]},
        dataset={"name": "synthetic_shifts", "config": "tiny", "version": "1.0.0"},
    )
    manifest.write(directory, about)


def openai_identity(model: str) -> dict:
    """What ood_jax.eval.clients' OpenAI client and the runner put in a run's identity."""
    return {
        "client": "openai",
        "model": model,
        "max_tokens": 16,
        "token_param": "max_tokens",
        "temperature": 0,
        "extra_body": {},
        "strip_think": True,
    }


def write_mllm_run(directory: pathlib.Path, scoring, identity: dict, asked: list) -> dict:
    """results.json, results.md and run.json as runner._Session writes them, from (meta,
    reply) pairs; a reply of None is a failed request."""
    identity = {**scoring.identity(), **identity}
    records = [
        scored(
            scoring,
            {
                "id": f"item-{k}",
                "digest": f"sha256-{k}",
                "outcome": "error" if reply is None else "answered",
                "reply": reply,
                "error": "HTTP 500: upstream error" if reply is None else None,
                "meta": meta,
            },
        )
        for k, (meta, reply) in enumerate(asked)
    ]
    results, markdown = run_results.build_results(scoring, identity, records)
    files.write_atomic(directory / store.RESULTS_JSON, json.dumps(results, indent=2) + "\n")
    files.write_atomic(directory / store.RESULTS_MD, markdown)
    files.write_atomic(directory / store.RUN_FILE, json.dumps(identity, indent=2) + "\n")
    return results


def rights(rng, n: int, accuracy: float) -> np.ndarray:
    """Which of `n` questions a model gets right: round(accuracy * n) of them, shuffled."""
    return rng.permutation(n) < round(accuracy * n)


def choice_reply(answer: int, right: bool) -> str:
    return LETTERS[answer if right else (answer + 1) % 4]


# FOCI runs: (name, client, accuracy on each dataset).
FOCI_RUNS = (
    ("qwen2_vl", "openai", {"imagenet_1k": 0.85, "imagenet_r": 0.7, "imagenet_sketch": 0.6}),
    ("llava_1.5", "openai", {"imagenet_1k": 0.65, "imagenet_r": 0.45, "imagenet_sketch": 0.35}),
    ("internvl2", "openai", {"imagenet_1k": 0.75, "imagenet_r": 0.6, "imagenet_sketch": 0.4}),
    ("clip_vit_l14", "clip", {"imagenet_1k": 0.9, "imagenet_r": 0.85, "imagenet_sketch": 0.7}),
)


def foci_asked(seed: int, accuracy: dict, per_dataset: int = 40) -> list:
    rng = np.random.default_rng(seed)
    asked = []
    for dataset, p_right in accuracy.items():
        for right in rights(rng, per_dataset, p_right):
            answer = int(rng.integers(0, 4))
            meta = {"dataset": dataset, "options": ["a", "b", "c", "d"], "answer": answer}
            asked.append(({**meta, "label": "abcd"[answer]}, choice_reply(answer, right)))
    return asked


OODBENCH_RUNS = (
    ("qwen2_vl_oodbench", {"id": 0.9, "ood_s": 0.8, "ood_h": 0.6}),
    ("llava_oodbench", {"id": 0.8, "ood_s": 0.65, "ood_h": 0.55}),
    ("internvl_oodbench", {"id": 0.7, "ood_s": 0.6, "ood_h": 0.4}),
)


def oodbench_asked(seed: int, accuracy: dict, per_split: int = 50) -> list:
    rng = np.random.default_rng(seed)
    asked = []
    for split, p_right in accuracy.items():
        for k, right in enumerate(rights(rng, per_split, p_right)):
            answer = bool(k % 2)
            said = answer if right else not answer
            kind = "positive" if answer else "negated_positive"
            meta = {"split": split, "answer": answer, "category": "dog", "kind": kind}
            asked.append(({**meta, "image_id": k}, "Yes" if said else "No"))
    return asked


def bap_asked(seed: int) -> list:
    rng = np.random.default_rng(seed)
    asked = []
    levels = (("existential", "yes"), ("counting", "3"), ("logical", "no"))
    for split, p_right in (("id", 0.8), ("ood_h", 0.5)):
        answers = iter(rights(rng, 20 * len(levels), p_right))
        for sample in range(20):
            for level, answer in levels:
                right = next(answers)
                reply = answer if right else {"yes": "no", "no": "yes", "3": "2"}[answer]
                meta = {"split": split, "level": level, "answer": answer}
                asked.append(
                    ({**meta, "categories": ["dog"], "sample": f"{split}/{sample}"}, reply)
                )
    return asked


def oodg_asked(seed: int) -> list:
    rng = np.random.default_rng(seed)
    asked = []
    for setting, p_right in (("iid", 0.7), ("covariate_shift", 0.45)):
        for k, right in enumerate(rights(rng, 40, p_right)):
            answer = int(rng.integers(0, 4))
            meta = {
                "task": "grounding",
                "setting": setting,
                "ice": 1,
                "domain": ("sky", "water", "dim")[k % 3],
                "size": "SML"[k % 3],
                "options": ["dog", "cat", "car", "sky"],
                "answer": answer,
                "category": None,
                "image_size": [64, 64],
            }
            asked.append((meta, f"({choice_reply(answer, right)})"))
    return asked


def write_corruptions(directory: pathlib.Path, metric: str, clean: float, names, seed: int) -> dict:
    """corruptions.json as the corruption benchmark writes it: each score falls with severity."""
    rng = np.random.default_rng(seed)
    scores = {}
    for name in names:
        steepness = rng.uniform(0.05, 0.15)
        scores[name] = {
            str(s): float(clean * max(0.0, 1 - steepness * s - rng.uniform(0, 0.03)))
            for s in range(1, 6)
        }
    mpc = float(np.mean([v for by in scores.values() for v in by.values()]))
    data = {"metric": metric, "clean": clean, "scores": scores, "mPC": mpc, "rPC": mpc / clean}
    files.write_json_atomic(directory / read.CORRUPTIONS_FILE, data)
    return data


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name, kept_in, kept_out in DETECTORS:
        dirs[name] = root / "workdirs" / name
        write_detector(dirs[name], name, kept_in, kept_out)
    for seed, (name, client, accuracy) in enumerate(FOCI_RUNS):
        dirs[name] = root / "runs" / name
        identity = (
            clip_baseline.scorer_identity(name, clip_baseline.DEFAULT_TEMPLATES)
            if client == "clip"
            else openai_identity(name)
        )
        write_mllm_run(dirs[name], FociScoring(), identity, foci_asked(seed, accuracy))
    # FOCI without ImageNet: no pair; one failed request: an incomplete run.
    dirs["qwen2_vl_fine_grained"] = root / "runs" / "qwen2_vl_fine_grained"
    asked = foci_asked(7, {"food101": 0.8, "flowers102": 0.7, "oxford_pet": 0.9})
    asked[0] = (asked[0][0], None)
    write_mllm_run(dirs["qwen2_vl_fine_grained"], FociScoring(), openai_identity("q"), asked)
    for seed, (name, accuracy) in enumerate(OODBENCH_RUNS):
        dirs[name] = root / "runs" / name
        scoring = OodBenchScoring("plain")
        write_mllm_run(dirs[name], scoring, openai_identity(name), oodbench_asked(seed, accuracy))
    dirs["qwen2_vl_bap"] = root / "runs" / "qwen2_vl_bap"
    write_mllm_run(dirs["qwen2_vl_bap"], OodBenchBapScoring(), openai_identity("q"), bap_asked(0))
    dirs["qwen2_vl_oodg"] = root / "runs" / "qwen2_vl_oodg"
    write_mllm_run(dirs["qwen2_vl_oodg"], CountsOodgScoring(), openai_identity("q"), oodg_asked(0))

    clean = json.loads((dirs["detr_r50"] / "results.json").read_text())["iid"]["AP"]
    write_corruptions(dirs["detr_r50"], "AP", clean, CORRUPTIONS, seed=1)
    clean = json.loads((dirs["dino_r50"] / "results.json").read_text())["iid"]["AP"]
    write_corruptions(dirs["dino_r50"], "AP", clean, CORRUPTIONS[:4], seed=2)
    results = json.loads((dirs["qwen2_vl_oodbench"] / "results.json").read_text())
    clean = results["splits"]["id"]["accuracy"]
    write_corruptions(dirs["qwen2_vl_oodbench"], "accuracy", clean, CORRUPTIONS[:6], seed=3)
    dirs["resnet50_imagenet_c"] = root / "corruptions" / "resnet50_imagenet_c"
    write_corruptions(dirs["resnet50_imagenet_c"], "accuracy", 0.76, CORRUPTIONS, seed=4)
    return dirs


@pytest.fixture(scope="module")
def runs(run_dirs) -> dict[str, Run]:
    return {run.name: run for run in read.read_runs(list(run_dirs.values()))}


def _results(run_dirs, name: str) -> dict:
    return json.loads((run_dirs[name] / "results.json").read_text())


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def test_a_detector_pairs_iid_ap_with_the_held_out_mean_and_their_intervals(run_dirs, runs):
    results = _results(run_dirs, "detr_r50")
    run = runs["detr_r50"]
    assert (run.family, run.model, run.benchmark) == (
        "detector",
        "detr_r50",
        "O(OD)² on synthetic_shifts/tiny",
    )
    (pair,) = run.pairs
    assert pair.shift == Shift("O(OD)² on synthetic_shifts/tiny", "AP", "iid", "mean over sky, dim")
    intervals = results["intervals"]
    assert pair.in_domain == Score(
        results["iid"]["AP"], intervals["iid"]["AP"]["low"], intervals["iid"]["AP"]["high"]
    )
    assert pair.held_out == Score(
        results["ood_average"]["AP"],
        intervals["ood_average"]["AP"]["low"],
        intervals["ood_average"]["AP"]["high"],
    )
    (bars,) = run.bars
    assert list(bars.scores) == ["iid", "sky", "dim", "held-out mean"]
    assert bars.scores["sky"].value == results["per_domain"]["sky"]["AP"]
    assert bars.in_domain == "iid"


def test_a_detector_workdir_without_intervals_or_held_out_domains(tmp_path):
    # An older workdir (no intervals, no manifest) evaluated in-domain only; -1: no ground truth.
    results = {"step": 3, "iid": {"AP": -1.0, "AP50": -1.0}, "per_domain": {}}
    files.write_json_atomic(tmp_path / "results.json", results)
    run = read.read_run(tmp_path)
    assert run.pairs == () and run.benchmark == "O(OD)²" and run.model is None
    assert run.bars[0].scores == {"iid": Score(None)}
    assert "no held-out domain" in run.notes[0]


def test_foci_pairs_imagenet_1k_with_each_shifted_variant(run_dirs, runs):
    for name, client, _ in FOCI_RUNS:
        run, results = runs[name], _results(run_dirs, name)
        assert run.family == ("scorer" if client == "clip" else "MLLM") and run.model == name
        per = results["per_dataset"]
        assert [(p.shift.in_domain, p.shift.held_out) for p in run.pairs] == [
            ("ImageNet-1k", "ImageNet-R"),
            ("ImageNet-1k", "ImageNet-Sketch"),
        ]
        for pair, held_out in zip(run.pairs, ("imagenet_r", "imagenet_sketch")):
            assert pair.in_domain == Score(
                per["imagenet_1k"]["accuracy"], *per["imagenet_1k"]["accuracy_ci"]
            )
            assert pair.held_out == Score(per[held_out]["accuracy"], *per[held_out]["accuracy_ci"])
        assert run.bars[0].in_domain == "imagenet_1k"


def test_foci_without_imagenet_is_in_the_bars_only_and_says_why(runs):
    run = runs["qwen2_vl_fine_grained"]
    assert run.pairs == ()
    assert list(run.bars[0].scores) == ["flowers102", "food101", "oxford_pet"]
    assert any("FOCI pairs ImageNet-1k with ImageNet-A, -R or -Sketch" in n for n in run.notes)
    assert any(n.startswith("incomplete") for n in run.notes)


def test_oodbench_bap_and_oodg_pairs(run_dirs, runs):
    results = _results(run_dirs, "qwen2_vl_oodbench")["splits"]
    run = runs["qwen2_vl_oodbench"]
    assert [(p.shift.in_domain, p.shift.held_out) for p in run.pairs] == [
        ("ID", "OOD-S"),
        ("ID", "OOD-H"),
    ]
    assert run.pairs[1].held_out == Score(
        results["ood_h"]["accuracy"], *results["ood_h"]["accuracy_ci"]
    )
    assert run.bars[1].scores["OOD-S"] == Score(results["ood_s"]["f1"])

    bap = _results(run_dirs, "qwen2_vl_bap")["splits"]
    (pair,) = runs["qwen2_vl_bap"].pairs
    assert pair.shift.metric == "BAP (C/N)"
    assert pair.in_domain == Score(bap["id"]["bap"], *bap["id"]["bap_ci"])

    rows = _results(run_dirs, "qwen2_vl_oodg")["grounding"]
    run = runs["qwen2_vl_oodg"]
    (pair,) = run.pairs
    assert pair.shift == Shift(
        "COUNTS OODG grounding", "accuracy", "iid, 1 ICE", "covariate_shift, 1 ICE"
    )
    assert pair.in_domain == Score(rows[0]["accuracy"], *rows[0]["accuracy_ci"])
    assert pair.held_out == Score(rows[1]["accuracy"], *rows[1]["accuracy_ci"])
    sky = rows[1]["per_domain"]["sky"]["all"]
    assert run.bars[1].scores["sky"] == Score(sky["accuracy"], *sky["accuracy_ci"])


def test_corruptions_json_is_read_as_written(run_dirs, runs):
    data = json.loads((run_dirs["detr_r50"] / read.CORRUPTIONS_FILE).read_text())
    corruptions = runs["detr_r50"].corruptions
    assert corruptions.metric == "AP" and corruptions.clean == data["clean"]
    assert list(corruptions.scores) == list(CORRUPTIONS)
    assert corruptions.scores["fog"] == {int(s): v for s, v in data["scores"]["fog"].items()}
    assert (corruptions.mpc, corruptions.rpc) == (data["mPC"], data["rPC"])
    assert runs["detr_r50"].notes == ()
    alone = runs["resnet50_imagenet_c"]
    assert alone.family is None and alone.pairs == () and alone.corruptions.metric == "accuracy"


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"metric": "mAP"}, "field 'metric' must be one of ('AP', 'accuracy', 'F1')"),
        ({"scores": {"fog": {"6": 0.1}}}, "field 'scores.fog': severity '6'"),
        ({"scores": {"fog": {"1": "high"}}}, "field 'scores.fog.1' must be a finite number"),
        ({"mPC": None}, "field 'mPC' must be a finite number"),
        ({"clean": "missing"}, "field 'clean' must be a finite number"),
        ({"scores": {}}, "field 'scores' must map each corruption to its scores per severity"),
        ({"rPC": float("nan")}, "field 'rPC' must be a finite number"),
    ],
)
def test_a_bad_corruptions_json_names_the_file_and_field(tmp_path, damage, message):
    data = {"metric": "AP", "clean": 0.4, "scores": {"fog": {"1": 0.3}}, "mPC": 0.3, "rPC": 0.75}
    files.write_json_atomic(tmp_path / read.CORRUPTIONS_FILE, {**data, **damage})
    with pytest.raises(RunError, match=r"corruptions\.json: " + re.escape(message)):
        read.read_run(tmp_path)


def test_an_rpc_of_null_goes_with_a_clean_score_of_zero(tmp_path):
    # ood_jax.metrics.robustness writes rPC null where the clean score is not positive.
    data = {"metric": "AP", "clean": 0.0, "scores": {"fog": {"1": 0.0}}, "mPC": 0.0, "rPC": None}
    files.write_json_atomic(tmp_path / read.CORRUPTIONS_FILE, data)
    run = read.read_run(tmp_path)
    assert run.corruptions.rpc is None and run.notes[1:] == ()
    files.write_json_atomic(tmp_path / read.CORRUPTIONS_FILE, {**data, "clean": 0.5})
    assert read.read_run(tmp_path).notes[1:] == (
        "corruptions.json: rPC is None, with a clean score of 0.5000",
    )


def test_corruption_numbers_that_do_not_add_up_are_noted(tmp_path):
    data = {"metric": "F1", "clean": 0.5, "scores": {"fog": {"1": 0.4, "2": 0.2}}}
    files.write_json_atomic(tmp_path / read.CORRUPTIONS_FILE, {**data, "mPC": 0.35, "rPC": 0.6})
    notes = read.read_run(tmp_path).notes
    assert notes == (
        "corruptions.json only: no in-domain or held-out score",
        "corruptions.json: mPC 0.3500 is not the mean of its scores, 0.3000",
        "corruptions.json: rPC 0.6000 is not mPC / clean, 0.7000",
    )


def test_a_directory_that_is_no_run_fails_in_one_line_naming_it(tmp_path):
    with pytest.raises(RunError) as error:
        report.write_report([tmp_path], tmp_path / "report.html")
    assert str(error.value).startswith(f"{tmp_path}: not a run directory ood-jax report knows")
    assert "results.json" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "report.html").exists()

    with pytest.raises(RunError, match="not a directory"):
        read.read_run(tmp_path / "missing")
    files.write_json_atomic(tmp_path / "results.json", {"benchmark": "mmbench", "complete": True})
    with pytest.raises(RunError, match=r"results\.json: neither a detector's .* 'mmbench'"):
        read.read_run(tmp_path)
    files.write_json_atomic(tmp_path / "results.json", {"benchmark": "foci", "complete": True})
    with pytest.raises(
        RunError, match=r"results\.json: not the format ood-jax writes: field 'datasets' is missing"
    ):
        read.read_run(tmp_path)
    (tmp_path / "results.json").write_text("{")
    with pytest.raises(RunError, match=r"results\.json: not JSON"):
        read.read_run(tmp_path)


def test_two_directories_of_one_name_are_named_by_their_paths(run_dirs, tmp_path):
    copy = tmp_path / "detr_r50"
    shutil.copytree(run_dirs["detr_r50"], copy)
    names = [run.name for run in read.read_runs([run_dirs["detr_r50"], copy, run_dirs["dino_r50"]])]
    assert names == [str(run_dirs["detr_r50"]), str(copy), "dino_r50"]


# ---------------------------------------------------------------------------------------------
# The fit and effective robustness
# ---------------------------------------------------------------------------------------------


def _panel(panels, in_domain: str, held_out: str):
    (panel,) = [p for p in panels if (p.shift.in_domain, p.shift.held_out) == (in_domain, held_out)]
    return panel


@pytest.mark.parametrize("scale", fit.SCALES)
def test_the_fit_is_least_squares_and_effective_robustness_the_distance_from_it(runs, scale):
    panel = _panel(fit.panels(list(runs.values()), scale), "ImageNet-1k", "ImageNet-R")
    assert [p.run.name for p in panel.points] == [name for name, _, _ in FOCI_RUNS]
    x = np.array([p.pair.in_domain.value for p in panel.points])
    y = np.array([p.pair.held_out.value for p in panel.points])
    forward, inverse = (
        (scipy.special.logit, scipy.special.expit) if scale == "logit" else (np.asarray,) * 2
    )
    slope, intercept = np.polyfit(forward(x), forward(y), 1)
    regression = scipy.stats.linregress(forward(x), forward(y))
    assert panel.fit.scale == scale
    assert panel.fit.slope == pytest.approx(slope, abs=1e-10)
    assert panel.fit.intercept == pytest.approx(intercept, abs=1e-10)
    assert panel.fit.r == pytest.approx(regression.rvalue, abs=1e-12)
    assert panel.fit.slope == pytest.approx(regression.slope, abs=1e-10)
    expected = y - inverse(intercept + slope * forward(x))
    got = [p.effective_robustness for p in panel.points]
    assert got == pytest.approx(expected, abs=1e-10)
    assert [p.drop for p in panel.points] == pytest.approx(y - x, abs=1e-15)


def test_detectors_share_one_panel_and_mllms_and_scorers_another(runs):
    panels = fit.panels(list(runs.values()))
    titles = [p.shift.title for p in panels]
    assert titles == [
        "O(OD)² on synthetic_shifts/tiny: AP, iid vs mean over sky, dim",
        "FOCI: accuracy, ImageNet-1k vs ImageNet-R",
        "FOCI: accuracy, ImageNet-1k vs ImageNet-Sketch",
        "OODBench: accuracy, ID vs OOD-S",
        "OODBench: accuracy, ID vs OOD-H",
        "OODBench BAP: BAP (C/N), ID vs OOD-H",
        "COUNTS OODG grounding: accuracy, iid, 1 ICE vs covariate_shift, 1 ICE",
    ]
    detectors = panels[0]
    assert [p.run.name for p in detectors.points] == [name for name, _, _ in DETECTORS]
    assert detectors.fit is not None and detectors.notes == ()
    families = {p.run.family for p in panels[1].points}
    assert families == {"MLLM", "scorer"}


def test_a_linear_fit_is_stated_on_the_page(run_dirs, tmp_path):
    out = tmp_path / "foci.html"
    _, panels = report.write_report([run_dirs[n] for n, _, _ in FOCI_RUNS], out, scale="linear")
    page = out.read_text()
    assert [p.fit.scale for p in panels] == ["linear", "linear"]
    for panel in panels:
        assert f"held-out = {panel.fit.slope:.3f} &times; in-domain" in page
    assert "logit(" not in page and "fit on linear scores" in page


def test_a_panel_of_fewer_than_three_runs_has_no_fit_and_says_so(runs):
    panels = fit.panels(list(runs.values()))
    bap = panels[5]
    assert bap.fit is None and [p.effective_robustness for p in bap.points] == [None]
    assert bap.notes == ("no fit: 1 run with both scores, and a fit needs at least 3",)
    # Two runs would fit a line through both: still no fit.
    two = fit.panels([runs["qwen2_vl"], runs["llava_1.5"]])
    assert all(p.fit is None for p in two)
    assert two[0].notes == ("no fit: 2 runs with both scores, and a fit needs at least 3",)


def _run(name: str, in_domain: float | None, held_out: float) -> Run:
    shift = Shift("B", "accuracy", "in", "out")
    pair = Pair(shift, Score(in_domain), Score(held_out))
    return Run(name, pathlib.Path(name), "MLLM", "B", None, (pair,))


def test_a_score_without_a_logit_is_fitted_linearly_and_a_missing_one_left_out():
    runs = [_run("a", 0.0, 0.1), _run("b", 0.5, 0.3), _run("c", 0.9, 0.6), _run("d", None, 0.2)]
    (panel,) = fit.panels(runs)
    assert panel.fit.scale == "linear"
    slope, intercept = np.polyfit([0.0, 0.5, 0.9], [0.1, 0.3, 0.6], 1)
    assert (panel.fit.slope, panel.fit.intercept) == pytest.approx((slope, intercept), abs=1e-12)
    assert panel.notes == (
        "d is left out: it has no accuracy on in",
        "fitted on linear scores: a score of 0 or 1 has no logit",
    )
    same = [_run(k, 0.5, v) for k, v in (("a", 0.1), ("b", 0.2), ("c", 0.3))]
    assert fit.panels(same)[0].notes == ("no fit: every run has the same in-domain score",)
    with pytest.raises(ValueError, match="scale must be one of"):
        fit.fit_line([0.1, 0.2], [0.1, 0.2], "probit")
    with pytest.raises(ValueError, match="scale must be one of"):
        fit.panels(runs, "probit")


# ---------------------------------------------------------------------------------------------
# The command and the page in headless Chromium
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ood-jax")
    report_command.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_help_ends_with_examples_that_parse():
    parser = _parser()
    help_text = parser._subparsers._group_actions[0].choices["report"].format_help()
    examples = [
        line.strip() for line in help_text.splitlines() if line.strip().startswith("ood-jax ")
    ]
    assert len(examples) == 2
    for example in examples:
        args = parser.parse_args(shlex.split(example)[1:])
        assert args.run is not None and args.out.endswith(".html")


def chromium(profile: pathlib.Path, *args: str) -> tuple[str, str]:
    """(stdout, stderr) of headless Chromium run with `args`, logging the page's console to
    stderr; killed with everything it started if it runs past CHROMIUM_TIMEOUT_S."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} not found: the report's page test needs headless Chromium; "
            "install it with `apt-get install chromium`"
        )
    command = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    command += ["--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", *args]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"chromium did not finish in {CHROMIUM_TIMEOUT_S} s: {shlex.join(command)}")
    assert process.returncode == 0, stderr[-2000:]
    return stdout, stderr


@pytest.mark.slow
def test_the_page_loads_in_chromium_and_shows_every_run(run_dirs, tmp_path, capsys):
    out = tmp_path / "report.html"
    args = _parser().parse_args(["report", *map(str, run_dirs.values()), "--out", str(out)])
    args.run(args)
    assert capsys.readouterr().out == (
        f"wrote {out}: {len(run_dirs)} runs, 7 in-domain vs held-out panels (5 with a fit)\n"
    )
    page = out.read_text()
    # Nothing to run and nothing to fetch: no script, no source or link off the page.
    assert "<script" not in page and "src=" not in page and 'href="http' not in page
    ids = re.findall(r'\bid="([^"]+)"', page)  # the figures' too, which refer to them
    assert len(ids) == len(set(ids))

    url = out.as_uri()
    dom, log = chromium(tmp_path / "profile", "--dump-dom", url)
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert console == []  # a script error, or a load the page's policy blocked, would be here
    runs = read.read_runs(list(run_dirs.values()))
    for run in runs:
        assert f"<strong>{run.name}</strong>" in dom
    figures = (
        7 + sum(len(run.bars) for run in runs) + sum(run.corruptions is not None for run in runs)
    )
    assert dom.count("<svg") == figures
    # Text in the figures stays text: the scatter names its runs.
    assert dom.count(">detr_vit</text>") == 1

    screenshot = tmp_path / "report.png"
    chromium(tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1400,3000", url)
    image = np.asarray(Image.open(screenshot).convert("RGB"))
    assert image.shape == (3000, 1400, 3)
    not_white = np.any(image < 235, axis=-1).mean()
    assert 0.03 < not_white < 0.6
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 200
    if os.environ.get("OOD_JAX_REPORT_SCREENSHOT"):  # to look at it
        shutil.copy(screenshot, os.environ["OOD_JAX_REPORT_SCREENSHOT"])
        shutil.copy(out, pathlib.Path(os.environ["OOD_JAX_REPORT_SCREENSHOT"]).with_suffix(".html"))
