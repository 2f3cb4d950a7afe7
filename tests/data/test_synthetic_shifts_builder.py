"""The synthetic_shifts builder: splits, features, valid records, determinism, loading by name."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds

from ood_jax import boxes as box_lib
from ood_jax import datasets
from ood_jax.data import counts, synthetic_render

TINY = {"train": 8, "test": 4}
SIZE_RANGE = (96, 128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[tfds.core.DatasetBuilder, pathlib.Path]:
    data_dir = tmp_path_factory.mktemp("synthetic")
    return datasets.build("synthetic_shifts", str(data_dir), config="tiny"), data_dir


def _examples(builder: tfds.core.DatasetBuilder, split: str, decode: bool = True) -> list[dict]:
    decoders = None if decode else {"image": tfds.decode.SkipDecoding()}
    ds = builder.as_dataset(split=split, decoders=decoders)
    return sorted(tfds.as_numpy(ds), key=lambda r: int(r["image/id"]))


def _digest(builder: tfds.core.DatasetBuilder) -> str:
    digest = hashlib.sha256()
    for split in sorted(builder.info.splits):
        for record in _examples(builder, split, decode=False):
            digest.update(split.encode())
            digest.update(record["image"])
            digest.update(record["image/filename"])
            digest.update(np.int64(record["image/id"]).tobytes())
            digest.update(np.int64(record["domain"]).tobytes())
            for name in sorted(record["objects"]):
                digest.update(np.ascontiguousarray(record["objects"][name]).tobytes())
    return digest.hexdigest()


def test_splits_and_sizes(tiny):
    builder, _ = tiny
    expected = {
        counts.split_name(split, domain): n
        for split, n in TINY.items()
        for domain in counts.DOMAINS
    }
    assert {name: info.num_examples for name, info in builder.info.splits.items()} == expected


def test_features_and_descriptions(tiny):
    builder, _ = tiny
    features = builder.info.features
    assert features["objects"]["label"].names == list(synthetic_render.CLASS_NAMES)
    assert features["domain"].names == list(counts.DOMAINS)
    assert set(features["objects"].feature) == {"bbox", "label", "area", "is_crowd", "id"}
    assert "synthetic" in builder.info.description.lower()
    assert "synthetic" in builder.builder_config.description.lower()
    assert builder.builder_config.name == "tiny"


@pytest.mark.slow
def test_records_are_valid(tiny):
    builder, _ = tiny
    image_ids, object_ids = [], []
    for split in builder.info.splits:
        source_split, domain = split.split("_", 1)
        for record in _examples(builder, split):
            assert counts.DOMAINS[record["domain"]] == domain
            height, width, channels = record["image"].shape
            assert SIZE_RANGE[0] <= height == width <= SIZE_RANGE[1] and channels == 3
            name = record["image/filename"].decode()
            assert name.startswith(f"synthetic/{source_split}/{domain}/") and name.endswith(".jpg")
            objects = record["objects"]
            boxes = objects["bbox"]
            assert len(boxes) >= 1
            assert ((boxes >= 0) & (boxes <= 1)).all()
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            assert (
                (objects["label"] >= 0) & (objects["label"] < len(synthetic_render.CLASS_NAMES))
            ).all()
            box_pixels = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) * height * width
            assert ((objects["area"] > 0) & (objects["area"] <= box_pixels + 1e-3)).all()
            assert not objects["is_crowd"].any()
            image_ids.append(int(record["image/id"]))
            object_ids += objects["id"].tolist()
    assert len(image_ids) == len(set(image_ids)) == sum(TINY.values()) * len(counts.DOMAINS)
    assert len(object_ids) == len(set(object_ids))


@pytest.mark.parametrize("split, domain, seed", [("train", "snow", 0), ("test", "occlusion", 1)])
def test_records_match_the_renderer(tiny, split, domain, seed):
    builder, _ = tiny
    records = {int(r["image/id"]): r for r in _examples(builder, counts.split_name(split, domain))}
    for index in range(TINY[split]):
        want = synthetic_render.split_example(seed, domain, index, SIZE_RANGE)
        record = records[int(want["image/id"])]
        size = want["image"].shape[0]
        assert record["image"].shape == want["image"].shape
        # JPEG at quality 90 keeps the picture close to the rendered pixels.
        error = np.abs(record["image"].astype(np.float32) - want["image"].astype(np.float32))
        assert error.mean() < 6.0
        yxyx = record["objects"]["bbox"].astype(np.float64)
        xywh = box_lib.xyxy_to_xywh(box_lib.scale(box_lib.yxyx_to_xyxy(yxyx), size, size))
        np.testing.assert_allclose(xywh, want["boxes"], atol=1e-3)
        np.testing.assert_array_equal(record["objects"]["label"], want["labels"])
        np.testing.assert_allclose(record["objects"]["area"], want["area"])


def test_train_and_test_differ(tiny):
    builder, _ = tiny
    train = _examples(builder, "train_dim")[0]["image"]
    test = _examples(builder, "test_dim")[0]["image"]
    assert train.shape != test.shape or np.abs(train.astype(int) - test).mean() > 5


@pytest.mark.slow
def test_two_builds_are_identical(tiny, tmp_path):
    builder, _ = tiny
    again = tfds.builder("synthetic_shifts/tiny", data_dir=str(tmp_path))
    again.download_and_prepare()
    assert _digest(again) == _digest(builder)


def test_loads_by_name_with_split_expressions(tiny):
    _, data_dir = tiny
    ds = tfds.load("synthetic_shifts/tiny", split="train_dim+test_dim", data_dir=str(data_dir))
    assert sum(1 for _ in ds) == TINY["train"] + TINY["test"]
    builder = tfds.builder("synthetic_shifts/tiny", data_dir=str(data_dir))
    expressions = counts.held_out_split_expressions(
        builder.info.splits.keys(), targets=("sky", "handmade")
    )
    sources = len(counts.DOMAINS) - 2
    sizes = {"train": TINY["train"] * sources, "iid": TINY["test"] * sources}
    for key, expression in expressions.items():
        ds = tfds.load("synthetic_shifts/tiny", split=expression, data_dir=str(data_dir))
        assert sum(1 for _ in ds) == sizes.get(key, TINY["test"]), key
