"""The `mine oodg` job on synthetic_shifts/tiny: the items schema, each setting's example rule
(checked on the written files), the drawn boxes (pixels of the PNGs) and reproducibility."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax import datasets
from ood_jax.data import counts
from ood_jax import prompts
from ood_jax.mining import jobs, oodg

KEYS = {
    "id", "task", "setting", "domain", "size", "prompt", "images", "options", "answer",
    "category", "image_size",
}  # fmt: skip
RUNS = {
    # name: (task, setting, in-context examples, items)
    "grounding_zero": ("grounding", "zero_shot", 0, 12),
    "grounding_iid": ("grounding", "iid", 2, 8),
    "grounding_covariate": ("grounding", "covariate_shift", 3, 12),
    "grounding_label": ("grounding", "label_shift", 2, 8),
    "grounding_spurious": ("grounding", "spurious_correlation", 3, 8),
    "localization_zero": ("localization", "zero_shot", 0, 10),
    "localization_label": ("localization", "label_shift", 1, 6),
    "localization_spurious": ("localization", "spurious_correlation", 2, 6),
    "mapping_zero": ("mapping", "zero_shot", 0, 8),
    "mapping_covariate": ("mapping", "covariate_shift", 1, 4),
}
COLORS = {"blue": (0, 0, 255), "red": (255, 0, 0), "yellow": (255, 255, 0), "green": (0, 255, 0)}


def _run(data_dir: pathlib.Path, out: pathlib.Path, task, setting, ice, items, **options) -> None:
    jobs.run_oodg(
        jobs.OodgMining(
            dataset="synthetic_shifts/tiny", data_dir=str(data_dir), task=task, setting=setting,
            ice=ice, num_items=items, out=str(out), **options,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def mined(tmp_path_factory):
    root = tmp_path_factory.mktemp("oodg")
    datasets.build("synthetic_shifts", str(root / "tfds"), config="tiny")
    for name, run in RUNS.items():
        _run(root / "tfds", root / name, *run)
    return root


@pytest.fixture(scope="module")
def source(mined) -> dict[tuple[str, int], dict]:
    """(TFDS split, image id) -> the test record as TFDS decodes it."""
    builder = tfds.builder_from_directory(
        str(mined / "tfds" / "synthetic_shifts" / "tiny" / "1.0.0")
    )
    names = builder.info.features["objects"]["label"].names
    records = {}
    for domain in counts.DOMAINS:
        split = counts.split_name("test", domain)
        for ex in tfds.as_numpy(builder.as_dataset(split=split)):
            ex["names"] = [names[i] for i in ex["objects"]["label"]]
            records[(split, int(ex["image/id"]))] = ex
    return records


def _items(root: pathlib.Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / name / "items.jsonl").read_text().splitlines()]


def _unit(path: str) -> tuple[tuple[str, int], str]:
    """images/<split>/<image id>_<unit>.png -> ((split, image id), unit)."""
    match = re.fullmatch(r"images/(\w+?_\w+)/(\d+)_([a-z]\S*)\.png", path)
    assert match, path
    return (match[1], int(match[2])), match[3]


def _domain(path: str) -> str:
    return _unit(path)[0][0].split("_", 1)[1]


def _example_labels(item: dict) -> list[str]:
    """The in-context examples' labels, read back from the prompt."""
    if item["task"] == "grounding":
        return re.findall(r"^Answer choice: \([A-Z]\) (.+)$", item["prompt"], re.MULTILINE)
    return re.findall(r"find all the objects of (.+) in the image", item["prompt"])[:-1]


def _test_label(item: dict) -> str:
    return item["options"][item["answer"]] if item["task"] == "grounding" else item["category"]


@pytest.mark.slow
def test_items_follow_the_schema(mined):
    for name, (task, setting, ice, count) in RUNS.items():
        items = _items(mined, name)
        assert len(items) == count, name
        assert len({i["id"] for i in items}) == count
        for item in items:
            assert set(item) == KEYS
            assert (item["task"], item["setting"]) == (task, setting)
            assert item["domain"] in counts.DOMAINS
            assert len(item["images"]) == ice + 1
            assert item["prompt"].count(prompts.IMAGE_PLACEHOLDER) == ice + 1
            assert all((mined / name / path).is_file() for path in item["images"])
            test_image = Image.open(mined / name / item["images"][-1])
            assert list(test_image.size) == item["image_size"]
            assert _domain(item["images"][-1]) == item["domain"]
            if task == "localization":
                assert item["options"] is None and item["size"] is None
                assert isinstance(item["category"], str)
                assert item["image_size"] == [448, 448]
                assert all(len(box) == 4 for box in item["answer"]) and item["answer"]
            else:
                assert item["category"] is None and len(item["options"]) == 4
                assert len(set(item["options"])) == 4
            if task == "grounding":
                assert item["size"] in ("S", "M", "L") and 0 <= item["answer"] < 4
            if task == "mapping":
                assert item["size"] is None and len(item["answer"]) == 4
                assert all(0 <= a < 4 for a in item["answer"])


def test_prompts_come_from_the_paper_tables(mined):
    item = _items(mined, "grounding_zero")[0]
    assert item["prompt"] == prompts.counts_grounding(item["options"])
    item = _items(mined, "mapping_zero")[0]
    assert item["prompt"] == prompts.counts_mapping(item["options"])
    item = _items(mined, "localization_zero")[0]
    assert item["prompt"] == "<image>\n" + prompts.counts_localization(item["category"])
    # The in-context frame of localization and mapping is Table 9's, as prompts.py prints it.
    with_examples = prompts.counts_grounding(
        ["a", "b"], [prompts.InContextExample(["a", "b"], "x")]
    )
    assert with_examples.splitlines()[:2] == list(oodg.ICE_HEADER)
    for name in ("localization_label", "mapping_covariate"):
        for item in _items(mined, name):
            lines = item["prompt"].splitlines()
            assert lines[:2] == list(oodg.ICE_HEADER)
            assert item["prompt"].count("Final Question:") == 1


def test_grounding_examples_answer_with_their_options(mined):
    for item in _items(mined, "grounding_iid"):
        blocks = item["prompt"].split("Final Question:")[0].split("Question: ")[1:]
        for block in blocks:
            options = re.findall(r"^\(([A-Z])\) (.+)$", block, re.MULTILINE)
            letter, name = re.search(r"Answer choice: \(([A-Z])\) (.+)", block).groups()
            assert (letter, name) in options


@pytest.mark.parametrize(
    "name", [n for n, run in RUNS.items() if run[1] != "zero_shot" and run[0] != "mapping"]
)
def test_each_setting_selects_examples_by_its_rule(mined, name):
    _, setting, ice, _ = RUNS[name]
    for item in _items(mined, name):
        examples, test = item["images"][:-1], item["images"][-1]
        keys = [_unit(p)[0] for p in examples]
        assert len(set(keys)) == ice and _unit(test)[0] not in keys  # distinct, not the test's
        domains, labels = [_domain(p) for p in examples], _example_labels(item)
        assert len(labels) == ice
        label, domain = _test_label(item), item["domain"]
        if setting == "iid":
            assert set(domains) == {domain}
        elif setting == "covariate_shift":
            assert domain not in domains
        elif setting == "label_shift":
            assert set(domains) == {domain} and label not in labels
        elif setting == "spurious_correlation":
            # Alternating: a wrong label always in the test's domain, the test's label always in
            # one other domain; the test breaks both co-occurrences.
            wrong, shifted = labels[0::2], labels[1::2]
            assert len(set(wrong)) == 1 and wrong[0] != label
            assert set(domains[0::2]) == {domain}
            assert set(shifted) <= {label}
            assert len(set(domains[1::2])) <= 1 and domain not in domains[1::2]


def test_mapping_covariate_examples_come_from_other_domains(mined):
    for item in _items(mined, "mapping_covariate"):
        assert item["domain"] not in [_domain(p) for p in item["images"][:-1]]
        answers = re.findall(
            r"^(blue|red|yellow|green) box:\(([A-Z])\) (.+)$", item["prompt"], re.M
        )
        assert [a[0] for a in answers] == list(prompts.MAPPING_COLORS)


def _frame(rect, thickness, shape) -> np.ndarray:
    left, top, right, bottom = rect
    mask = np.zeros(shape[:2], bool)
    mask[top : bottom + 1, left : right + 1] = True
    mask[top + thickness : bottom + 1 - thickness, left + thickness : right + 1 - thickness] = False
    return mask


def _rect(record: dict, k: int) -> tuple[int, int, int, int]:
    """The pixels a box covers: columns round(xmin * W) .. round(xmax * W) - 1, same for rows."""
    height, width = record["image"].shape[:2]
    ymin, xmin, ymax, xmax = record["objects"]["bbox"][k]
    return (round(xmin * width), round(ymin * height), round(xmax * width) - 1,
            round(ymax * height) - 1)  # fmt: skip


def _thickness(record: dict) -> int:
    return max(2, round(min(record["image"].shape[:2]) / 160))


def test_grounding_box_is_drawn_in_red_around_the_object(mined, source):
    for item in _items(mined, "grounding_zero"):
        key, unit = _unit(item["images"][-1])
        record, k = source[key], int(unit[1:])
        drawn = np.asarray(Image.open(mined / "grounding_zero" / item["images"][-1]))
        frame = _frame(_rect(record, k), _thickness(record), drawn.shape)
        assert (drawn[frame] == COLORS["red"]).all()
        np.testing.assert_array_equal(drawn[~frame], record["image"][~frame])  # nothing else
        assert record["names"][k] == item["options"][item["answer"]]
        area = record["objects"]["area"][k]
        assert item["size"] == ("S" if area < 32**2 else "M" if area <= 96**2 else "L")


def test_mapping_boxes_are_blue_red_yellow_green(mined, source):
    for item in _items(mined, "mapping_zero"):
        key, unit = _unit(item["images"][-1])
        record, objects = source[key], [int(k) for k in unit[1:].split("-")]
        drawn = np.asarray(Image.open(mined / "mapping_zero" / item["images"][-1]))
        frames = [_frame(_rect(record, k), _thickness(record), drawn.shape) for k in objects]
        for i, color in enumerate(prompts.MAPPING_COLORS):
            # Boxes are drawn in colour order, so a later box covers an earlier one.
            visible = frames[i] & ~np.any(frames[i + 1 :], axis=0) if i < 3 else frames[i]
            assert visible.any() and (drawn[visible] == COLORS[color]).all()
            assert item["options"][item["answer"][i]] == record["names"][objects[i]]
        outside = ~np.any(frames, axis=0)
        np.testing.assert_array_equal(drawn[outside], record["image"][outside])
        assert not record["objects"]["is_crowd"][objects].any()


def test_localization_answers_are_in_the_448_frame(mined, source):
    for name in ("localization_zero", "localization_label"):
        for item in _items(mined, name):
            key, _ = _unit(item["images"][-1])
            record = source[key]
            sent = np.asarray(Image.open(mined / name / item["images"][-1]))
            assert sent.shape == (448, 448, 3)
            resized = np.asarray(Image.fromarray(record["image"]).resize((448, 448)))
            assert np.abs(sent.astype(float) - resized).mean() < 8
            height, width = record["image"].shape[:2]
            mine = [k for k, n in enumerate(record["names"]) if n == item["category"]]
            want = []
            for k in mine:  # pixel box in the original image, scaled to 448 x 448
                ymin, xmin, ymax, xmax = record["objects"]["bbox"][k]
                x, y = xmin * width * 448 / width, ymin * height * 448 / height
                want.append([x, y, (xmax - xmin) * 448, (ymax - ymin) * 448])
            np.testing.assert_allclose(sorted(item["answer"]), sorted(want), atol=2e-3)


def test_same_arguments_give_identical_files(mined, tmp_path):
    again = tmp_path / "again"
    _run(mined / "tfds", again, *RUNS["grounding_spurious"])
    first = mined / "grounding_spurious"
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    _run(mined / "tfds", tmp_path / "seeded", *RUNS["grounding_spurious"], seed=1)
    assert _items(tmp_path, "seeded") != _items(mined, "grounding_spurious")


def test_example_split_and_domains_options(mined, tmp_path):
    out = tmp_path / "cross"
    _run(mined / "tfds", out, "grounding", "iid", 1, 5, ice_split="train", domains=("dim",))
    for item in json.loads("[" + ",".join((out / "items.jsonl").read_text().splitlines()) + "]"):
        assert item["domain"] == "dim"
        assert _unit(item["images"][0])[0][0] == "train_dim"


@pytest.mark.parametrize(
    "args, options, message",
    [
        (("grounding", "zero_shot", 2, 3), {}, r"zero_shot takes 0"),
        (("grounding", "iid", 0, 3), {}, r"the other settings at least 1"),
        (("mapping", "label_shift", 4, 3), {}, r"no item could be built"),
        (("grounding", "iid", 1, 3), {"split": "val"}, r"no split val_"),
        (("grounding", "iid", 1, 3), {"domains": ("moon",)}, r"unknown domain 'moon'"),
    ],
)
def test_impossible_requests_fail_clearly(mined, tmp_path, args, options, message):
    with pytest.raises(ValueError, match=message):
        _run(mined / "tfds", tmp_path / "x", *args, **options)


def test_unbuilt_dataset_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"synthetic_shifts/tiny is not built"):
        _run(tmp_path, tmp_path / "x", "grounding", "zero_shot", 0, 1)
