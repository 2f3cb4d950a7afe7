"""`ood-jax mine foci-zero-shot` on a tiny foci build and a corrupted build of it (fog at
severities 1 and 3): every split's all-class and 4-way accuracy against a recomputation from
transformers' PyTorch CLIP features, corruptions.json's mPC and rPC against
ood_jax.metrics.robustness, and the run read by the report."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from test_eval_corrupted import assert_summary
from test_foci_builder import _options, _write_options
from test_mining_foci import _numpy_accuracy
from test_scorers import TEXT_LEN, clip_config, normalized, save_clip, torch_features

from ood_jax import cli, datasets
from ood_jax.eval.tasks.base import interval
from ood_jax.metrics import robustness
from ood_jax.mining import foci, zero_shot
from ood_jax.report import read

# Six classes, so the 4 options are not all of them; two test images each.
RAW = ["apple_pie", "baby_back_ribs", "beef_carpaccio", "bibimbap", "churros", "tiramisu"]
# 32 px a side: imagecorruptions' smallest, and the test CLIP's input size, so the image
# processor does not resample and ours and transformers' see the same pixels.
SIZE = 32


def _pixels(seed: int) -> np.ndarray:
    """A colour of its own and a gradient in a random direction, so that the random CLIP's
    predictions vary between images and under fog."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(-1, 1, SIZE)
    gradient = rng.normal() * ramp[:, None] + rng.normal() * ramp[None, :]
    pixels = rng.uniform(0, 255, 3) + 60 * gradient[..., None] + rng.normal(0, 8, (SIZE, SIZE, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_food101(src) -> None:
    """A food101 source: meta/test.json, distinct random images, and its foci_options.json."""
    entries = {c: [f"{c}/{100 + k}" for k in range(2)] for c in RAW}
    (src / "meta").mkdir(parents=True)
    (src / "meta" / "test.json").write_text(json.dumps(entries))
    classes = [c.replace("_", " ") for c in RAW]
    expected = {}
    for raw, label in zip(RAW, classes):
        for entry in entries[raw]:
            image = f"images/{entry}.jpg"
            (src / image).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(_pixels(len(expected))).save(src / image, format="JPEG")
            expected[image] = (label, _options(label, classes), (SIZE, SIZE))
    _write_options(src / "foci_options.json", expected, {})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_shot")
    make_food101(root / "food101")
    data_dir = root / "tfds"
    datasets.build("foci", str(data_dir), source=str(root / "food101"), config="food101")
    request = {"dataset": "foci/food101", "corruptions": "fog", "severities": "1,3"}
    built = datasets.build("corrupted", str(data_dir), corruption=request)
    torch.manual_seed(0)  # transformers' initialization, so that every run scores alike
    model = save_clip(root / "clip", clip_config())
    return data_dir, f"corrupted/{built.builder_config.name}", root / "clip", model


def reference(clip_dir, model, builder, split: str, classes: list[str]) -> tuple[float, float]:
    """(all-class, 4-way) accuracy of a split from PyTorch CLIP features, in numpy."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(clip_dir, local_files_only=True)
    processor = transformers.CLIPImageProcessor.from_pretrained(clip_dir, local_files_only=True)
    tokens = tokenizer(
        [foci.DEFAULT_TEMPLATES[0].format(c) for c in classes],
        padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="np",
    )  # fmt: skip
    texts = normalized(
        torch_features(model, ids=tokens["input_ids"], mask=tokens["attention_mask"])
    )
    records = list(zero_shot.records(builder, split))
    pixels = np.concatenate(
        [
            processor(images=np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB")),
                      return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
            for r in records
        ]
    )  # fmt: skip
    images = torch_features(model, pixels=pixels)
    labels = np.array([classes.index(r["label"].decode()) for r in records])
    options = np.array([[classes.index(o.decode()) for o in r["options"]] for r in records])
    return _numpy_accuracy(images, texts, labels, options)


def run(data_dir, dataset: str, clip_dir, out) -> dict:
    cli.main(
        ["mine", "foci-zero-shot", "--data-dir", str(data_dir), "--dataset", dataset,
         "--scorer", str(clip_dir), "--out", str(out), "--batch-size", "5", "--quiet"]
    )  # fmt: skip
    return json.loads((out / zero_shot.RESULTS_FILE).read_text())


def check_split(entry: dict, want: tuple[float, float]) -> None:
    n = entry["images"]
    assert n == 12
    assert (entry["zero_shot"], entry["four_way"]) == pytest.approx(want)
    assert entry["zero_shot_ci"] == pytest.approx(interval(round(want[0] * n), n))
    assert entry["four_way_ci"] == pytest.approx(interval(round(want[1] * n), n))


@pytest.mark.slow
def test_zero_shot_per_corruption(data, tmp_path):
    data_dir, name, clip_dir, model = data
    classes = sorted(c.replace("_", " ") for c in RAW)

    results = run(data_dir, name, clip_dir, tmp_path / "corrupted")
    target = zero_shot.read_target(str(data_dir), name)
    assert results["source"] == "foci/food101" and results["classes"] == classes
    assert list(results["splits"]) == ["clean", "fog/1", "fog/3"]
    accuracies = {}
    for key, entry in results["splits"].items():
        want = reference(clip_dir, model, target.builder, entry["split"], classes)
        check_split(entry, want)
        accuracies[key] = want[0]

    assert len(set(accuracies.values())) > 1  # fog changes the predictions

    grid = {"fog": {1: accuracies["fog/1"], 3: accuracies["fog/3"]}}
    summary = robustness.summary(accuracies["clean"], grid, "accuracy")
    assert_summary(json.loads((tmp_path / "corrupted" / robustness.FILE).read_text()), summary)
    curves = read.read_run(tmp_path / "corrupted").corruptions
    assert (curves.metric, curves.mpc) == ("accuracy", pytest.approx(summary["mPC"]))
    assert "| fog/3 | 12 |" in (tmp_path / "corrupted" / zero_shot.MARKDOWN_FILE).read_text()

    # The plain foci build: its test split, the corrupted build's clean copy, scores the same.
    plain = run(data_dir, "foci/food101", clip_dir, tmp_path / "plain")
    assert list(plain["splits"]) == ["test"]
    assert {k: v for k, v in plain["splits"]["test"].items() if k != "split"} == {
        k: v for k, v in results["splits"]["clean"].items() if k != "split"
    }
    assert not (tmp_path / "plain" / robustness.FILE).exists()
