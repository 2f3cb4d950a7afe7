"""`ood-jax eval-mllm foci|oodbench --corrupted corrupted/NAME`: tiny FOCI and OODBench builds
under two corruptions, asked through the test chat server (and the CLIP baseline with a fake
scorer); the scores per corruption and severity, mPC and rPC checked against what the
prediction records and ood_jax.metrics.robustness give, beside a plain run over the source."""

from __future__ import annotations

import collections
import hashlib
import json

import pytest
from sklearn import metrics as skm
from test_clients import ChatServer, completion, image_parts, prompt_text
from test_eval_runner import CATEGORIES, INSTANCES, SPLIT_LINES, FakeScorer, exact_interval, h
from test_eval_runner import run_cli
from test_foci_builder import _write_image, make_food101

from ood_jax import datasets, scorers
from ood_jax.eval import store
from ood_jax.metrics import robustness
from ood_jax.report import read

FOCI_VARIANTS = {("clean", None), ("gaussian_noise", 1), ("gaussian_noise", 3)}
FOCI_VARIANTS |= {("brightness", 1), ("brightness", 3)}
OODBENCH_VARIANTS = {("clean", None), ("gaussian_noise", 2), ("brightness", 2)}


def _corrupted(data_dir, dataset: str, severities: str) -> str:
    request = {"dataset": dataset, "corruptions": "gaussian_noise,brightness"}
    request["severities"] = severities
    built = datasets.build("corrupted", str(data_dir), corruption=request)
    return f"corrupted/{built.builder_config.name}"


# imagecorruptions takes images of at least 32 px a side.
SIZE = (40, 36)


@pytest.fixture(scope="module")
def foci_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("foci_corrupted")
    for image in make_food101(root / "food101"):
        _write_image(root / "food101" / image, SIZE)
    data_dir = root / "tfds"
    datasets.build("foci", str(data_dir), source=str(root / "food101"), config="food101")
    return data_dir, _corrupted(data_dir, "foci/food101", "1,3")


@pytest.fixture(scope="module")
def oodbench_data(tmp_path_factory):
    """test_eval_runner's OODBench source, its images large enough to corrupt."""
    src = tmp_path_factory.mktemp("oodbench_corrupted")
    images, annotations = [], []
    for image_id, counts in INSTANCES.items():
        _write_image(src / "images" / f"{image_id}.jpg", (SIZE[0] + image_id, SIZE[1]))
        images.append({"id": image_id, "file_name": f"{image_id}.jpg"})
        for category, n in counts.items():
            box = {"image_id": image_id, "category_id": category, "bbox": [1, 1, 4, 4]}
            annotations += [{"id": len(annotations) + k + 1, **box, "iscrowd": 0} for k in range(n)]
    categories = [{"id": k, "name": v} for k, v in CATEGORIES.items()]
    coco = {"images": images, "annotations": annotations, "categories": categories}
    (src / "annotations.json").write_text(json.dumps(coco))
    lines = [json.dumps({"image_id": i, "category": c, "split": s}) for i, c, s in SPLIT_LINES]
    (src / "splits.jsonl").write_text("\n".join(lines) + "\n")
    data_dir = src / "tfds"
    datasets.build("oodbench", str(data_dir), source=str(src), config="default")
    return data_dir, _corrupted(data_dir, "oodbench/default", "2")


def reply(body: dict, answers: str) -> str:
    """The test 'model': an answer from a hash of the question and the image, which the
    corruptions change, or now and then none."""
    key = prompt_text(body) + hashlib.sha256(image_parts(body)[0]).hexdigest()
    return "I cannot tell." if h(key, "unsure") % 5 == 0 else answers.split()[h(key) % 3 % 2]


def ask(argv: list[str], answers: str) -> tuple[dict, ChatServer]:
    def respond(body, attempt):
        return 200, {}, completion(reply(body, answers))

    with ChatServer(respond) as server:
        results = run_cli([*argv, "--endpoint", server.url, "--model", "m", "--no-progress"])
    return results, server


def records_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / store.PREDICTIONS_FILE).read_text().splitlines()]


def by_variant(records: list[dict]) -> dict[tuple, list[dict]]:
    groups = collections.defaultdict(list)
    for record in records:
        groups[record["meta"]["corruption"], record["meta"]["severity"]].append(record)
    return groups


def check_foci_accuracies(results: dict, records: list[dict]) -> dict[tuple, float]:
    """Each variant's accuracy and interval against the records; returns the accuracies."""
    groups, accuracies = by_variant(records), {}
    for (name, severity), group in groups.items():
        section = results["corruptions"]
        got = (
            section["clean"] if name == "clean" else section["per_corruption"][name][str(severity)]
        )
        right = sum(r["correct"] for r in group)
        assert got["num_items"] == len(group)
        assert got["accuracy"] == pytest.approx(right / len(group))
        assert got["accuracy_ci"] == pytest.approx(exact_interval(right, len(group)))
        accuracies[name, severity] = right / len(group)
    return accuracies


def expected_summary(scores: dict[tuple, float], metric: str) -> dict:
    grid = collections.defaultdict(dict)
    for (name, severity), value in scores.items():
        if name != "clean":
            grid[name][severity] = value
    return robustness.summary(scores["clean", None], grid, metric)


def assert_summary(got: dict, want: dict) -> None:
    """A corruptions.json summary equal to `want` up to rounding (approx is one level deep)."""
    assert got.keys() == want.keys() and got["scores"].keys() == want["scores"].keys()
    for name, by_severity in want["scores"].items():
        assert got["scores"][name] == pytest.approx(by_severity)
    flat = {k: v for k, v in want.items() if k != "scores"}
    assert {k: got[k] for k in flat} == pytest.approx(flat)


def test_foci_per_corruption_beside_a_plain_run(foci_data, tmp_path):
    data_dir, name = foci_data
    base = ["eval-mllm", "foci", "--data-dir", str(data_dir)]
    out = tmp_path / "corrupted"
    results, server = ask([*base, "--corrupted", name, "--output", str(out)], "A B")
    records = records_of(out)
    # Each test record asked once clean and once per corruption and severity, ids unique.
    assert server.hits == results["num_items"] == len(records) == 8 * len(FOCI_VARIANTS)
    assert {k: len(v) for k, v in by_variant(records).items()} == dict.fromkeys(FOCI_VARIANTS, 8)
    assert all(
        r["id"].startswith(("clean/food101/", "gaussian_noise_", "brightness_")) for r in records
    )
    run = json.loads((out / store.RUN_FILE).read_text())
    assert run["benchmark"] == "foci" and run["corrupted"] == name

    accuracies = check_foci_accuracies(results, records)
    assert len(set(accuracies.values())) > 1  # the corruptions change the answers
    section = results["corruptions"]
    assert (section["metric"], section["headline"]) == ("accuracy", "test")
    summary = expected_summary(accuracies, "accuracy")
    assert_summary(section["robustness"]["test"], summary)
    assert_summary(json.loads((out / robustness.FILE).read_text()), summary)
    assert_summary(json.loads((out / robustness.PER_SPLIT_DIR / "test.json").read_text()), summary)
    markdown = (out / store.RESULTS_MD).read_text()
    assert (
        "### Corruptions" in markdown and "| mPC |" in markdown and "| brightness | 3 |" in markdown
    )

    # A plain run over the source: its identity, ids and results as before; its items are the
    # clean ones, asked alike.
    plain_out = tmp_path / "plain"
    plain, _ = ask([*base, "--output", str(plain_out)], "A B")
    plain_records = records_of(plain_out)
    assert "corruptions" not in plain and not (plain_out / robustness.FILE).exists()
    assert "corrupted" not in json.loads((plain_out / store.RUN_FILE).read_text())
    clean = {
        r["id"].removeprefix("clean/"): r["digest"] for r in by_variant(records)["clean", None]
    }
    assert {r["id"]: r["digest"] for r in plain_records} == clean
    assert all("corruption" not in r["meta"] for r in plain_records)
    for key in ("accuracy", "accuracy_ci", "num_items", "datasets"):
        assert plain[key] == section["clean"][key]

    # Re-scored from the records alone, and read by the report.
    (strict,) = run_cli(["rescore", str(out), "--parse-mode", "strict"])
    assert strict["corruptions"]["per_corruption"].keys() == section["per_corruption"].keys()
    curves = read.read_run(out).corruptions
    assert (curves.metric, curves.mpc) == ("accuracy", pytest.approx(summary["mPC"]))
    page = tmp_path / "report.html"
    run_cli(["report", str(out), str(plain_out), "--out", str(page)])
    assert "corruptions-" in page.read_text()


@pytest.mark.slow
def test_oodbench_f1_per_corruption_and_split(oodbench_data, tmp_path):
    data_dir, name = oodbench_data
    out = tmp_path / "run"
    argv = ["eval-mllm", "oodbench", "--data-dir", str(data_dir), "--corrupted", name]
    results, server = ask([*argv, "--output", str(out)], "Yes. No.")
    records = records_of(out)
    assert server.hits == len(records) == 22 * len(OODBENCH_VARIANTS)
    assert {k: len(v) for k, v in by_variant(records).items()} == dict.fromkeys(
        OODBENCH_VARIANTS, 22
    )
    section = results["corruptions"]
    assert (section["metric"], section["headline"]) == ("F1", "id")
    f1 = collections.defaultdict(dict)
    for (name, severity), group in by_variant(records).items():
        got = (
            section["clean"] if name == "clean" else section["per_corruption"][name][str(severity)]
        )
        assert list(got["splits"]) == ["id", "ood_s", "ood_h"]
        for split in got["splits"]:
            rows = [r for r in group if r["meta"]["split"] == split]
            truth = [r["meta"]["answer"] for r in rows]
            said = [
                r["parsed"] if r["parsed"] is not None else not r["meta"]["answer"] for r in rows
            ]
            assert got["splits"][split]["f1"] == pytest.approx(
                skm.f1_score(truth, said, zero_division=0)
            )
            assert got["splits"][split]["accuracy"] == pytest.approx(
                skm.accuracy_score(truth, said)
            )
            f1[split][name, severity] = got["splits"][split]["f1"]
    for split, scores in f1.items():
        summary = expected_summary(scores, "F1")
        assert_summary(section["robustness"][split], summary)
        written = json.loads((out / robustness.PER_SPLIT_DIR / f"{split}.json").read_text())
        assert_summary(written, summary)
    assert json.loads((out / robustness.FILE).read_text()) == section["robustness"]["id"]
    assert read.read_run(out).corruptions.metric == "F1"


def test_clip_baseline_scores_per_corruption(foci_data, tmp_path, monkeypatch):
    data_dir, name = foci_data
    monkeypatch.setattr(scorers, "from_hf", lambda path: FakeScorer())
    out = tmp_path / "clip"
    argv = ["eval-mllm", "foci", "--data-dir", str(data_dir), "--corrupted", name]
    results = run_cli([*argv, "--clip", "fake", "--output", str(out), "--no-progress"])
    records = records_of(out)
    assert results["client"] == "clip" and len(records) == 8 * len(FOCI_VARIANTS)
    summary = expected_summary(check_foci_accuracies(results, records), "accuracy")
    assert_summary(json.loads((out / robustness.FILE).read_text()), summary)


def test_limit_and_misuse(foci_data, oodbench_data, tmp_path):
    data_dir, name = foci_data
    base = ["eval-mllm", "foci", "--data-dir", str(data_dir), "--corrupted", name]
    # A --limit run cuts the grid: no mPC, and no corruptions.json.
    results, _ = ask([*base, "--output", str(tmp_path / "limit"), "--limit", "12"], "A B")
    assert results["corruptions"]["robustness"] is None
    assert not (tmp_path / "limit" / robustness.FILE).exists()
    for argv, message in (
        ([*base, "--config", "food101"], "drop --config"),
        (
            ["eval-mllm", "oodbench", "--data-dir", str(data_dir), "--corrupted", name],
            "not from a oodbench",
        ),
        (
            ["eval-mllm", "foci", "--data-dir", str(oodbench_data[0]), "--corrupted", name],
            "no built dataset",
        ),
        ([*base[:-1], "corrupted"], "expected corrupted/NAME"),
        (
            ["eval-mllm", "oodbench-bap", "--data-dir", str(data_dir), "--corrupted", name],
            "foci and oodbench only",
        ),
    ):
        with pytest.raises(SystemExit, match=message):
            run_cli(
                [
                    *argv,
                    "--endpoint",
                    "http://127.0.0.1:9/v1",
                    "--model",
                    "m",
                    "--output",
                    str(tmp_path / "x"),
                ]
            )


def test_circular_groups_stay_within_their_corruption(oodbench_data, tmp_path):
    data_dir, name = oodbench_data
    argv = ["eval-mllm", "oodbench", "--data-dir", str(data_dir), "--corrupted", name]
    results, server = ask([*argv, "--circular", "2", "--output", str(tmp_path)], "Yes. No.")
    # Each instance's four items (question and negation, both answer orders) once per copy.
    assert server.hits == 4 * len(SPLIT_LINES) * len(OODBENCH_VARIANTS)
    instances = [s["instances"] for s in results["circular_eval"]["splits"].values()]
    assert sum(i["groups"] for i in instances) == len(SPLIT_LINES) * len(OODBENCH_VARIANTS)
    assert all(i["incomplete"] == 0 for i in instances)
    for by_severity in results["corruptions"]["per_corruption"].values():
        for r in by_severity.values():
            assert sum(s["instances"]["groups"] for s in r["circular_eval"]["splits"].values()) == (
                len(SPLIT_LINES)
            )
