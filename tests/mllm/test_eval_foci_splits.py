"""`ood-jax eval-mllm foci` on ImageNet-1k's halves and GeoDE's regions: one run over test, the
items grouped by the split their record is also in (FOCI Tables 3 and 7), checked against the
builds' own splits and the test server's answers, with scipy's exact intervals."""

from __future__ import annotations

import hashlib
import json

import pytest
import tensorflow_datasets as tfds
from test_clients import ChatServer, completion, image_parts, prompt_text
from test_eval_runner import _raw_records, exact_interval, h, run_cli
from test_foci_builder import make_food101, make_geode, make_imagenet

from ood_jax import datasets, prompts
from ood_jax.data import foci as foci_source
from ood_jax.eval import tasks
from ood_jax.eval import store
from ood_jax.eval.tasks.base import pct_ci
from ood_jax.eval.tasks.foci import FociScoring

CONFIGS = ("food101", "geode", "imagenet_1k")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("foci_splits")
    make_food101(root / "food101")
    make_geode(root / "geode")
    name = foci_source.released_options_file("imagenet_1k")
    make_imagenet(root / "imagenet_1k", "imagenet_1k", name, relative=True)
    for config in CONFIGS:
        datasets.build("foci", str(root / "tfds"), source=str(root / config), config=config)
    return root / "tfds"


def reply(text: str, image: bytes) -> str:
    """The test 'model': a letter from a hash of the question and image, or now and then none."""
    key = text + hashlib.sha256(image).hexdigest()
    return "I cannot tell." if h(key, "unsure") % 4 == 0 else "ABCD"[h(key) % 4]


def expected_splits(data_dir) -> dict[str, dict[str, list[bool]]]:
    """config -> split -> whether each of its items is answered right, from the raw records."""
    out = {}
    for config in CONFIGS:
        directory = tasks.dataset_dir(data_dir, "foci", config)
        splits = _raw_records(directory, tfds.builder_from_directory(str(directory)).info.splits)
        right = {}
        for record in splits.pop("test"):
            options = [o.decode() for o in record["options"]]
            text = prompts.foci_multiple_choice(record["dataset"].decode(), options)
            answer = reply(text, record["image"])
            right[record["image/filename"]] = answer == "ABCD"[record["answer"]]
        out[config] = {"test": list(right.values())} | {
            split: [right[r["image/filename"]] for r in records]
            for split, records in splits.items()
        }
    return out


@pytest.mark.slow
def test_one_run_scores_every_half_and_region(data_dir, tmp_path):
    def respond(body, attempt):
        return 200, {}, completion(reply(prompt_text(body), image_parts(body)[0]))

    out = tmp_path / "run"
    argv = ["eval-mllm", "foci", "--data-dir", str(data_dir), "--model", "tiny"]
    argv += ["--output", str(out), "--no-progress"]
    with ChatServer(respond) as server:
        results = run_cli([*argv, "--endpoint", server.url])
    expected = expected_splits(data_dir)
    # Each test record asked once: the halves and regions repeat test's records, not its items.
    num_items = sum(len(splits["test"]) for splits in expected.values())
    assert server.hits == results["num_items"] == num_items
    assert results["complete"] is True

    per_split = results["per_split"]
    assert set(per_split) == {"geode", "imagenet_1k"}  # food101 has test alone
    assert set(per_split["imagenet_1k"]) == {"train_half", "test_half"}
    assert set(per_split["geode"]) == {"africa", "west_asia", "europe"}
    for config, splits in per_split.items():
        # Each item in exactly one half or region: the splits add up to the config.
        assert sum(s["num_items"] for s in splits.values()) == len(expected[config]["test"])
        for split, summary in splits.items():
            right = expected[config][split]
            assert summary["num_items"] == len(right)
            assert summary["accuracy"] == pytest.approx(sum(right) / len(right))
            assert summary["accuracy_ci"] == pytest.approx(exact_interval(sum(right), len(right)))
        overall = results["per_dataset"][config]
        assert overall["accuracy"] == pytest.approx(
            sum(expected[config]["test"]) / overall["num_items"]
        )
        unread = sum(s["generation_failures"] for s in splits.values())
        assert unread == overall["generation_failures"]
    assert "without_split" not in results

    # Tagged from the build's splits by image/filename; food101's items carry no split.
    records = [json.loads(line) for line in (out / store.PREDICTIONS_FILE).read_text().splitlines()]
    tags = {(r["meta"]["dataset"], r["meta"].get("split")) for r in records}
    assert tags == {("food101", None)} | {(c, s) for c, splits in per_split.items() for s in splits}
    # No new identity: a run directory over these configs is what it was before.
    identities = {
        json.dumps(tasks.make_benchmark("foci", str(data_dir), config=c).identity())
        for c in CONFIGS
    }
    assert identities == {json.dumps({"benchmark": "foci"})}

    train = per_split["imagenet_1k"]["train_half"]
    cell = pct_ci(train["accuracy"], train["accuracy_ci"])
    markdown = (out / store.RESULTS_MD).read_text()
    assert "### Per split (FOCI Tables 3 and 7)" in markdown
    assert f"| imagenet_1k | train_half | {cell} | {train['num_items']} |" in markdown
    # Re-scored from the records alone, under another mode: the same splits, the same items.
    (strict,) = run_cli(["rescore", str(out), "--parse-mode", "strict"])
    assert _split_sizes(strict) == _split_sizes(results)


def _split_sizes(results: dict) -> dict[str, dict[str, int]]:
    return {
        c: {s: v["num_items"] for s, v in splits.items()}
        for c, splits in results["per_split"].items()
    }


def _record(dataset: str, correct: bool, split: str | None = None) -> dict:
    meta = {"dataset": dataset, "options": list("wxyz"), "answer": 0, "label": "w"}
    meta |= {"split": split} if split else {}
    return {"meta": meta, "parsed": 0 if correct else 1, "correct": correct, "error": None}


def test_records_without_a_split_read_as_before():
    scoring = FociScoring()
    old = [_record("geode", k % 2 == 0) for k in range(5)] + [_record("food101", True)]
    results = scoring.results(old)
    assert "per_split" not in results and "without_split" not in results
    assert "Per split" not in scoring.markdown(results)
    # A resumed run's older records are counted in no split, and the tables say how many.
    mixed = old + [_record("geode", True, "africa"), _record("geode", False, "europe")]
    results = scoring.results(mixed)
    assert {s: v["num_items"] for s, v in results["per_split"]["geode"].items()} == {
        "africa": 1, "europe": 1
    }  # fmt: skip
    assert results["without_split"] == {"geode": 5}
    assert "5 items of geode were recorded without their split" in scoring.markdown(results)
