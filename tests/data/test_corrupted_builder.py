"""The corrupted builder over synthetic_shifts/tiny: names, copied features, corrupted images,
byte-identical rebuilds, reading without ood_jax, and requests that are refused."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from ood_jax import datasets
from ood_jax.data import building, corrupted
from ood_jax.testing import plain_tfds

SOURCE = "synthetic_shifts/tiny"
REQUEST = {
    "dataset": SOURCE,
    "corruptions": "fog,gaussian_noise",
    "severities": "3,1",
    "splits": "test_sky,test_dim",
}
SPLITS = ("test_dim", "test_sky")
VARIANTS = [(None, None), ("gaussian_noise", 1), ("gaussian_noise", 3), ("fog", 1), ("fog", 3)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


@pytest.fixture(scope="module")
def built(data_dir):
    return datasets.build("corrupted", str(data_dir), corruption=REQUEST)


def _records(builder, split: str) -> list[dict]:
    ds = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
    return sorted(tfds.as_numpy(ds), key=lambda r: int(r["image/id"]))


def _pixels(encoded: bytes) -> np.ndarray:
    return tf.io.decode_image(encoded, channels=3, expand_animations=False).numpy()


def _record_files(builder) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(pathlib.Path(builder.data_dir).glob("*.tfrecord*"))
    }


@pytest.mark.slow
def test_names_and_sizes(built, data_dir):
    source = datasets.load(SOURCE, str(data_dir))
    request = corrupted.Request.create(
        SOURCE, source.info.splits, "gaussian_noise,fog", "1,3", SPLITS
    )
    assert built.builder_config.name == request.config_name()
    assert built.builder_config.name.startswith("synthetic_shifts-tiny-")
    expected = {corrupted.split_name(s, c, v): 4 for s in SPLITS for c, v in VARIANTS}
    assert {k: v.num_examples for k, v in built.info.splits.items()} == expected
    assert set(request.split_names()) == set(expected)
    assert built.provenance.settings["dataset"] == SOURCE
    assert built.provenance.settings["corruptions"] == ["gaussian_noise", "fog"]
    assert built.provenance.settings["severities"] == [1, 3]
    assert built.provenance.source == str(source.data_dir)
    assert "gaussian_noise" in built.info.description


def test_features_and_boxes_are_the_sources(built, data_dir):
    source = datasets.load(SOURCE, str(data_dir))
    assert built.info.features.to_json() == source.info.features.to_json()
    for split in SPLITS:
        clean = _records(source, split)
        for corruption, severity in VARIANTS:
            records = _records(built, corrupted.split_name(split, corruption, severity))
            assert len(records) == len(clean)
            for got, want in zip(records, clean):
                for key in ("image/id", "image/filename", "domain"):
                    assert got[key] == want[key]
                for key, value in want["objects"].items():
                    np.testing.assert_array_equal(got["objects"][key], value)


def test_images_are_corrupted_and_clean_is_copied(built, data_dir):
    source = datasets.load(SOURCE, str(data_dir))
    for split in SPLITS:
        clean = _records(source, split)
        assert [r["image"] for r in _records(built, corrupted.split_name(split))] == [
            r["image"] for r in clean
        ]
        images = {
            (c, v): [
                _pixels(r["image"]) for r in _records(built, corrupted.split_name(split, c, v))
            ]
            for c, v in VARIANTS[1:]
        }
        for i, record in enumerate(clean):
            original = _pixels(record["image"])
            variants = [images[key][i] for key in images]
            assert all(v.shape == original.shape and v.dtype == np.uint8 for v in variants)
            assert all(np.abs(v.astype(int) - original).mean() > 1 for v in variants)
            for a in range(len(variants)):
                for b in range(a + 1, len(variants)):
                    assert not np.array_equal(variants[a], variants[b])


@pytest.mark.slow
def test_rebuild_is_byte_identical_and_seeds_follow_the_image(built, data_dir, tmp_path):
    again = tmp_path / "again"
    datasets.build("synthetic_shifts", str(again), config="tiny")
    rebuilt = datasets.build("corrupted", str(again), corruption=REQUEST)
    assert rebuilt.builder_config.name == built.builder_config.name
    assert _record_files(rebuilt) == _record_files(built)
    # Another request holding the same image under the same corruption stores the same bytes.
    part = datasets.build(
        "corrupted",
        str(again),
        corruption={
            "dataset": SOURCE,
            "corruptions": "fog",
            "severities": "3",
            "splits": "test_sky",
        },
    )
    assert part.builder_config.name != built.builder_config.name
    split = corrupted.split_name("test_sky", "fog", 3)
    assert _records(part, split) and [r["image"] for r in _records(part, split)] == [
        r["image"] for r in _records(built, split)
    ]


def _stored(builder) -> dict[str, list[tf.train.Example]]:
    """Split -> its examples as stored, in file order (parsed: a feature map's serialized
    order can differ between processes)."""
    return {
        name: [
            tf.train.Example.FromString(record.numpy())
            for record in tf.data.TFRecordDataset([str(p) for p in split.filepaths])
        ]
        for name, split in builder.info.splits.items()
    }


@pytest.mark.slow
def test_a_beam_build_writes_the_same_records(data_dir):
    request = {"dataset": SOURCE, "corruptions": "snow", "severities": "2", "splits": "test_sky"}
    single = datasets.build("corrupted", str(data_dir), corruption=request)
    stored = _stored(single)
    beamed = datasets.build(
        "corrupted",
        str(data_dir),
        corruption=request,
        overwrite=True,
        beam_runner="DirectRunner",
        beam_options="--direct_num_workers=1",
    )
    assert list(stored) == ["test_sky__clean", "test_sky__snow_2"]
    assert _stored(beamed) == stored
    assert beamed.provenance.digest == single.provenance.digest


def test_same_request_again_is_reused(built, data_dir):
    again = datasets.build("corrupted", str(data_dir), corruption=dict(REQUEST))
    assert again.reused and again.builder_config.name == built.builder_config.name


def test_load_by_name(built, data_dir):
    name = f"corrupted/{built.builder_config.name}"
    loaded = datasets.load(name, str(data_dir))
    assert set(loaded.info.splits) == set(built.info.splits)
    assert datasets.class_names(name, str(data_dir)) == datasets.class_names(SOURCE, str(data_dir))
    with pytest.raises(FileNotFoundError, match="ood-jax build corrupted --dataset"):
        datasets.load("corrupted/synthetic_shifts-tiny-0000000000", str(data_dir))


@pytest.mark.slow
def test_readable_without_ood_jax(built, tmp_path):
    got = plain_tfds.detection_records(built.data_dir, ["test_sky__fog_3"], cwd=tmp_path)
    names = built.info.features["objects"]["label"].names
    for record in _records(built, "test_sky__fog_3"):
        want = got[str(record["image/id"])]
        assert want["labels"] == [names[i] for i in record["objects"]["label"]]
        assert want["shape"] == list(_pixels(record["image"]).shape)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"corruptions": "fog,rain"}, "--corruptions: unknown corruption 'rain'"),
        ({"severities": "0,3"}, "--severities: '0' is not a severity"),
        (
            {"splits": "test_sky,test_moon"},
            "--splits: synthetic_shifts/tiny has no split 'test_moon'",
        ),
        ({"splits": ""}, "--splits: empty"),
        ({"dataset": ""}, "pass --dataset"),
    ],
)
def test_bad_requests_name_the_field(data_dir, change, message):
    with pytest.raises(building.BuildError, match=message):
        datasets.build("corrupted", str(data_dir), corruption={**REQUEST, **change})


def test_bad_build_arguments(data_dir):
    with pytest.raises(FileNotFoundError, match="synthetic_shifts/demo is not prepared"):
        datasets.build(
            "corrupted", str(data_dir), corruption={**REQUEST, "dataset": "synthetic_shifts/demo"}
        )
    with pytest.raises(building.BuildError, match="not chosen with --config"):
        datasets.build("corrupted", str(data_dir), config="tiny", corruption=REQUEST)
    with pytest.raises(building.BuildError, match="are for corrupted, not synthetic_shifts"):
        datasets.build("synthetic_shifts", str(data_dir), config="tiny", corruption=REQUEST)


def test_split_names_parse_back():
    for source in ("test_sky", "train_water_sky", "ood_s", "test"):
        assert corrupted.parse_split_name(corrupted.split_name(source)) == (source, None, None)
        for name in ("gaussian_noise", "elastic_transform", "fog"):
            split = corrupted.split_name(source, name, 5)
            assert corrupted.parse_split_name(split) == (source, name, 5)
    for other in ("test_sky", "__clean", "test_sky__fog_6", "test_sky__rain_1", "test_sky__fog"):
        assert corrupted.parse_split_name(other) is None


def test_requests_are_canonical():
    splits = ("test_sky", "test_dim", "train_sky")
    a = corrupted.Request.create(SOURCE, splits, "fog,snow", "3,1", "test_sky,test_dim")
    b = corrupted.Request.create(
        SOURCE, splits, ["snow", "fog", "fog"], [1, 3], ["test_dim", "test_sky"]
    )
    assert a == b and a.config_name() == b.config_name()
    c = corrupted.Request.create(SOURCE, splits, "fog,snow", "1,3")
    assert c.splits == ("test_dim", "test_sky", "train_sky") and c.config_name() != a.config_name()
    every = corrupted.Request.create(SOURCE, splits)
    assert len(every.corruptions) == 15 and every.severities == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="holds '__'"):
        corrupted.Request.create(SOURCE, ["test__sky"], "fog", "1")
