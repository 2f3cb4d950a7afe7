"""Tests of the detection input pipeline on a tiny TFDS dataset of solid colored rectangles.

Each object is a rectangle of its class's color on a dark background, so a box that the
augmentation moved correctly still encloses exactly that color.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from ood_jax import boxes as box_lib
from ood_jax.data import counts, pipeline

SPLIT = "train_dim+train_snow"
SPLIT_SIZES = {"train_dim": 10, "train_snow": 6}
BACKGROUND = np.array([30, 30, 30], np.float32)
COLORS = np.array([[250, 60, 60], [60, 250, 60], [60, 60, 250]], np.float32)
CROWD_COLOR = (250, 250, 60)


def _make_examples() -> list[dict]:
    """16 images, each with 1-4 non-overlapping rectangles in a 2 x 2 grid; some crowd."""
    rng = np.random.default_rng(0)
    examples = []
    for i in range(sum(SPLIT_SIZES.values())):
        height, width = rng.integers(96, 200, size=2)
        image = np.broadcast_to(BACKGROUND.astype(np.uint8), (height, width, 3)).copy()
        cells = rng.permutation(4)[: rng.integers(1, 5)]
        objects = {"bbox": [], "label": [], "is_crowd": [], "xywh": []}
        for n, cell in enumerate(cells):
            cy, cx = divmod(cell, 2)
            cell_h, cell_w = height // 2, width // 2
            h, w = rng.integers(16, cell_h - 12), rng.integers(16, cell_w - 12)
            y = cy * cell_h + rng.integers(6, cell_h - h - 5)
            x = cx * cell_w + rng.integers(6, cell_w - w - 5)
            crowd = n == 1 and i % 3 == 0
            label = int(rng.integers(3))
            image[y : y + h, x : x + w] = CROWD_COLOR if crowd else COLORS[label]
            objects["bbox"].append([y / height, x / width, (y + h) / height, (x + w) / width])
            objects["label"].append(label)
            objects["is_crowd"].append(crowd)
            objects["xywh"].append([x, y, w, h])
        examples.append({"id": 2**40 + i, "image": image, "objects": objects})
    return examples


EXAMPLES = _make_examples()
BY_ID = {e["id"]: e for e in EXAMPLES}
# Train batches carry no ids; the source size names the image (the test checks it is unique).
BY_ID_BY_SIZE = {e["image"].shape[:2]: e["id"] for e in EXAMPLES}


class Rectangles(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, features=counts.detection_features(["a", "b", "c"])
        )

    def _split_generators(self, dl_manager):
        start = 0
        splits = {}
        for name, size in SPLIT_SIZES.items():
            splits[name] = self._generate_examples(
                name.split("_")[1], EXAMPLES[start : start + size]
            )
            start += size
        return splits

    def _generate_examples(self, domain, examples):
        for e in examples:
            o = e["objects"]
            yield (
                e["id"],
                {
                    "image": e["image"],
                    "image/id": e["id"],
                    "image/filename": f"{e['id']}.jpg",
                    "domain": domain,
                    "objects": {
                        "bbox": np.array(o["bbox"], np.float32),
                        "label": o["label"],
                        "area": [float(w * h) for _, _, w, h in o["xywh"]],
                        "is_crowd": o["is_crowd"],
                        "id": list(range(len(o["label"]))),
                    },
                },
            )


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    b = Rectangles(data_dir=str(tmp_path_factory.mktemp("tfds")))
    b.download_and_prepare()
    return b


def _config(**overrides) -> ml_collections.ConfigDict:
    base = {"image_size": 128, "max_size": 128, "scales": (64, 96, 128), "eval_size": 96}
    return ml_collections.ConfigDict({**base, "batch_size": 4, "max_boxes": 6, **overrides})


def _batches(builder, count: int, config=None, **kwargs) -> list[dict]:
    it = pipeline.train_iterator(builder, SPLIT, config or _config(), **kwargs)
    return [next(it) for _ in range(count)]


def _pixels(image: np.ndarray) -> np.ndarray:
    return (image * pipeline.IMAGENET_STD + pipeline.IMAGENET_MEAN) * 255.0


def _check_content(batch: dict) -> int:
    """Every large enough target box encloses its class's color, tightly. Returns boxes checked."""
    canvas = batch["image"].shape[1:3]
    on_canvas = pipeline.boxes_on_canvas(batch["boxes"], batch["image_size"], canvas)
    xyxy = box_lib.cxcywh_to_xyxy(on_canvas) * np.array(canvas[::-1] * 2, np.float32)
    checked = 0
    for i, j in zip(*np.nonzero(batch["box_mask"])):
        x0, y0, x1, y1 = xyxy[i, j]
        if min(x1 - x0, y1 - y0) < 8:
            continue
        color = COLORS[batch["labels"][i, j]]
        image = _pixels(batch["image"][i])
        dx, dy = (x1 - x0) / 4, (y1 - y0) / 4
        inner = image[int(y0 + dy) : int(np.ceil(y1 - dy)), int(x0 + dx) : int(np.ceil(x1 - dx))]
        np.testing.assert_allclose(inner.reshape(-1, 3).mean(0), color, atol=30)
        # The box is tight: pixels nearer the color than the background span it to ~1 px.
        h, w = batch["image_size"][i]
        wy0, wx0 = max(int(y0) - 3, 0), max(int(x0) - 3, 0)
        window = image[wy0 : min(int(y1) + 4, h), wx0 : min(int(x1) + 4, w)]
        near = np.linalg.norm(window - color, axis=-1) < np.linalg.norm(
            window - BACKGROUND, axis=-1
        )
        ys, xs = np.nonzero(near)
        found = np.array([xs.min() + wx0, ys.min() + wy0, xs.max() + 1 + wx0, ys.max() + 1 + wy0])
        np.testing.assert_allclose(found, [x0, y0, x1, y1], atol=1.6)
        checked += 1
    return checked


def _non_crowd(image_id: int) -> int:
    return sum(not c for c in BY_ID[image_id]["objects"]["is_crowd"])


def test_train_batch_shapes_masks_and_content(builder):
    batches = _batches(builder, 8)
    expected = {
        "image": ((4, 128, 128, 3), np.float32),
        "image_mask": ((4, 128, 128), bool),
        "image_size": ((4, 2), np.int32),
        "orig_size": ((4, 2), np.int32),
        "boxes": ((4, 6, 4), np.float32),
        "labels": ((4, 6), np.int32),
        "box_mask": ((4, 6), bool),
        "domain": ((4,), np.int32),
        "valid": ((4,), bool),
    }
    checked = 0
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == expected
        assert batch["valid"].all()
        for i, (h, w) in enumerate(batch["image_size"]):
            assert min(h, w) in (64, 96, 128) or max(h, w) == 128
            rows, cols = np.arange(128)[:, None] < h, np.arange(128)[None, :] < w
            np.testing.assert_array_equal(batch["image_mask"][i], rows & cols)
            assert not batch["image"][i][~batch["image_mask"][i]].any()
        assert not batch["boxes"][~batch["box_mask"]].any()
        checked += _check_content(batch)
    assert checked > 30


def test_flip_mirrors_image_and_boxes(builder):
    plain, flipped = (
        _batches(builder, 2, config=_config(crop_prob=0.0, flip_prob=p)) for p in (0.0, 1.0)
    )
    for a, b in zip(plain, flipped):
        np.testing.assert_array_equal(a["image_size"], b["image_size"])
        for i, (h, w) in enumerate(a["image_size"]):
            np.testing.assert_array_equal(b["image"][i, :h, :w], a["image"][i, :h, w - 1 :: -1])
        np.testing.assert_allclose(
            b["boxes"][..., 0], np.where(a["box_mask"], 1 - a["boxes"][..., 0], 0), atol=1e-6
        )
        np.testing.assert_allclose(b["boxes"][..., 1:], a["boxes"][..., 1:], atol=1e-6)
        _check_content(b)


def test_crop_clips_and_drops_boxes(builder):
    batches = _batches(builder, 8, config=_config(crop_prob=1.0, crop_min_fraction=0.3))
    clipped = dropped = 0
    for batch in batches:
        xyxy = box_lib.cxcywh_to_xyxy(batch["boxes"])[batch["box_mask"]]
        assert (xyxy >= 0).all() and (xyxy <= 1 + 1e-6).all()
        assert (xyxy[:, 2:] > xyxy[:, :2]).all()
        clipped += int(np.isclose(xyxy, 0, atol=1e-6).sum() + np.isclose(xyxy, 1, atol=1e-6).sum())
        _check_content(batch)
        dropped += sum(
            n < _non_crowd(BY_ID_BY_SIZE[tuple(size)])
            for n, size in zip(batch["box_mask"].sum(1), batch["orig_size"])
        )
    assert clipped > 0 and dropped > 0


def test_crowd_boxes_are_not_targets(builder):
    assert len(BY_ID_BY_SIZE) == len(EXAMPLES)
    config = _config(crop_prob=0.0, batch_size=16)
    batch = _batches(builder, 1, config=config)[0]
    for count, size in zip(batch["box_mask"].sum(1), batch["orig_size"]):
        assert count == _non_crowd(BY_ID_BY_SIZE[tuple(size)])
    assert any(c for e in EXAMPLES for c in e["objects"]["is_crowd"])


def test_determinism_and_seeds(builder):
    a, b = _batches(builder, 3), _batches(builder, 3)
    for x, y in zip(a, b):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    other = _batches(builder, 3, config=_config(seed=1))
    assert any(not np.array_equal(x["image_size"], y["image_size"]) for x, y in zip(a, other))
    assert not all(np.array_equal(x["image"], y["image"]) for x, y in zip(a, other))


def test_epochs_cover_the_split_in_new_orders(builder):
    batches = _batches(builder, 8)  # Two epochs of 16.
    sizes = [tuple(s) for b in batches for s in b["orig_size"]]
    first, second = sizes[:16], sizes[16:]
    assert sorted(first) == sorted(second) == sorted(BY_ID_BY_SIZE)
    assert first != second


@pytest.mark.parametrize("orientation_window", [0, 3])
def test_resume_continues_the_same_sequence(builder, orientation_window):
    # 6 does not divide 16, so batches straddle epochs and the resume point is mid-epoch (and,
    # grouped, in the middle of a run of 3 batches).
    config = _config(batch_size=6, orientation_window=orientation_window)
    full = _batches(builder, 8, config=config)
    resumed = _batches(builder, 4, config=config, start_step=4)
    for x, y in zip(full[4:], resumed):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP"])
def test_encoded_image_size_reads_headers_and_decodes_the_rest(fmt):
    """JPEG and PNG from their headers (what orientation groups read), others by decoding."""
    import io

    from PIL import Image

    rng = np.random.default_rng(len(fmt))
    for height, width in rng.integers(1, 3000, size=(3, 2)):
        buffer = io.BytesIO()
        Image.new("RGB", (int(width), int(height))).save(buffer, format=fmt)
        size = pipeline.encoded_image_size(tf.constant(buffer.getvalue())).numpy()
        assert size.tolist() == [height, width]


def test_orientation_groups_are_the_same_examples_on_rectangles(builder):
    """With orientation_window=2, each run of 2 batches holds the images, crops, scales and
    flips of the ungrouped run, sorted: a batch is landscape on 96x128 or portrait on 128x96,
    and only where a run turns may an image of the other orientation be resized to fit."""
    plain_config = _config(scales=(64, 96))
    grouped_config = _config(scales=(64, 96), orientation_window=2)
    landscape, portrait = pipeline.train_canvases(grouped_config)
    assert (landscape, portrait) == ((96, 128), (128, 96))
    assert pipeline.train_canvases(plain_config) == ((128, 128),)
    plain, grouped = _batches(builder, 8, plain_config), _batches(builder, 8, grouped_config)

    fitted = 0
    for run in range(4):
        mixed = 0
        by_source = {}
        for batch in plain[2 * run : 2 * run + 2]:
            for i, source in enumerate(batch["orig_size"]):
                by_source[tuple(source)] = (batch, i)
        sources = [tuple(s) for b in grouped[2 * run : 2 * run + 2] for s in b["orig_size"]]
        assert sorted(sources) == sorted(by_source)
        wide = []
        for batch in grouped[2 * run : 2 * run + 2]:
            canvas = batch["image"].shape[1:3]
            assert canvas in (landscape, portrait)
            orientations = set()
            for i, (h, w) in enumerate(batch["image_size"]):
                assert h <= canvas[0] and w <= canvas[1]
                twin, j = by_source[tuple(batch["orig_size"][i])]
                th, tw = twin["image_size"][j]
                orientations.add(bool(tw >= th))
                if (h, w) == (th, tw):
                    np.testing.assert_array_equal(
                        batch["image"][i, :h, :w], twin["image"][j, :h, :w]
                    )
                    np.testing.assert_array_equal(batch["boxes"][i], twin["boxes"][j])
                else:  # resized to fit the other orientation's canvas
                    assert (tw >= th) != (canvas == landscape) and h <= th and w <= tw
                    fitted += 1
            mixed += len(orientations) > 1
            wide.append(canvas == landscape)
            _check_content(batch)
        assert wide in ([True, True], [True, False], [False, False])  # landscape first
        assert mixed <= 1
    assert fitted > 0


@pytest.mark.slow
def test_processes_feed_their_rows_of_one_global_order(builder):
    """Two processes' rows of each global batch, stacked, are the one process's batch, bit for
    bit, from the start and from a resume point; so the data does not depend on the process
    count (6 does not divide 16: batches straddle epochs)."""
    for config, start_step in [
        (_config(batch_size=6), 0),
        (_config(batch_size=6), 3),
        (_config(batch_size=6, orientation_window=2), 3),  # runs of 2 batches: 2 and 3
    ]:
        whole = _batches(builder, 4, config=config, start_step=start_step)
        parts = [
            _batches(builder, 4, config=config, start_step=start_step, rows=rows)
            for rows in ((0, 2), (2, 6))
        ]
        for step, batch in enumerate(whole):
            for key in batch:
                stacked = np.concatenate([part[step][key] for part in parts])
                np.testing.assert_array_equal(stacked, batch[key], err_msg=f"{step} {key}")

    config = _config(batch_size=6)
    with pytest.raises(ValueError, match=r"rows=\(4, 7\)"):
        pipeline.train_dataset(builder, SPLIT, config, rows=(4, 7))
    with pytest.raises(ValueError, match="max_size"):
        pipeline.train_dataset(builder, SPLIT, _config(max_size=200))
    with pytest.raises(ValueError, match="orientation_window"):
        pipeline.train_dataset(builder, SPLIT, _config(orientation_window=-1))


def test_eval_ids_sizes_partial_batch_and_coco_round_trip(builder):
    config = _config(batch_size=6)
    assert pipeline.num_eval_batches(builder, SPLIT, 6) == 3
    batches = list(pipeline.eval_dataset(builder, SPLIT, config).as_numpy_iterator())
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[-1]["valid"], [True] * 4 + [False] * 2)
    assert not batches[-1]["image"][4:].any() and not batches[-1]["box_mask"][4:].any()
    seen = []
    for batch in batches:
        assert batch["image_id"].dtype == np.int64
        coco = pipeline.coco_boxes(batch["boxes"], batch["orig_size"])
        for i in np.nonzero(batch["valid"])[0]:
            example = BY_ID[int(batch["image_id"][i])]
            seen.append(example["id"])
            np.testing.assert_array_equal(batch["orig_size"][i], example["image"].shape[:2])
            assert min(batch["image_size"][i]) == 96 or max(batch["image_size"][i]) == 128
            crowd = np.array(example["objects"]["is_crowd"])
            truth = np.array(example["objects"]["xywh"], np.float32)[~crowd]
            n = batch["box_mask"][i].sum()
            assert n == len(truth)
            np.testing.assert_allclose(coco[i, :n], truth, atol=1e-3)
            np.testing.assert_array_equal(
                batch["labels"][i, :n], np.array(example["objects"]["label"])[~crowd]
            )
        _check_content(batch)
    assert sorted(seen) == sorted(BY_ID)

    # Two processes run the same number of steps; their rows of each batch, stacked, are the
    # one process's batch.
    per_process = [
        list(pipeline.eval_dataset(builder, SPLIT, config, rows=rows).as_numpy_iterator())
        for rows in ((0, 4), (4, 6))
    ]
    assert len(per_process[0]) == len(per_process[1]) == len(batches)
    for step, batch in enumerate(batches):
        for key in batch:
            stacked = np.concatenate([part[step][key] for part in per_process])
            np.testing.assert_array_equal(stacked, batch[key], err_msg=f"{step} {key}")


_GLOBAL_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np, ml_collections, tensorflow_datasets as tfds
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ood_jax import sharding as sharding_lib
    from ood_jax.data import pipeline

    assert jax.device_count() == 4
    builder = tfds.builder_from_directory(sys.argv[1])
    config = ml_collections.ConfigDict({"image_size": 64, "max_size": 64, "scales": (48, 64),
                                        "batch_size": 8, "max_boxes": 6})
    local = next(pipeline.train_iterator(builder, "train_dim+train_snow", config))
    for shape, axes in [((4,), ("data",)), ((2, 2), ("data", "model"))]:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
        sharding = NamedSharding(mesh, P("data"))
        batch, _ = next(sharding_lib.start_global([local], sharding))
        rows = 8 // shape[0]
        for name, value in batch.items():
            assert value.sharding == sharding and value.shape == local[name].shape, name
            np.testing.assert_array_equal(np.asarray(value), local[name])
            for shard in value.addressable_shards:
                assert shard.data.shape[0] == rows
                np.testing.assert_array_equal(shard.data, local[name][shard.index])
            np.testing.assert_array_equal(sharding_lib.to_host_local(value, sharding), local[name])
    try:
        sharding_lib.to_global_array({"image_id": np.zeros(8, np.int64)}, sharding)
    except ValueError as e:
        assert "image_id" in str(e)
    else:
        raise AssertionError("int64 field accepted")
    print("ok")
    """
)


@pytest.mark.slow
def test_global_array_on_a_four_device_mesh(builder):
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, "-c", _GLOBAL_SCRIPT, builder.data_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
