"""Detection input pipeline: TFDS records -> augmented, padded host batches (numpy).

`ood_jax.sharding.start_global` turns the host batches into global jax.Arrays. All randomness is
stateless in (seed, epoch, position), so a resumed run, or one on another number of processes,
sees the same global batches. Batch format, augmentation and the resume contract:
docs/reference/data.pipeline.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from ood_jax import boxes as box_lib
from ood_jax.data import iteration

Batch = dict[str, np.ndarray]

# Fields that never go to a device: jax without x64 would truncate an int64 id.
HOST_ONLY_KEYS = ("image_id",)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# TFDS writes each split to its own files, so domains lie apart; reading this many files at once,
# one record from each in turn, mixes them before the shuffle buffer does the rest.
_FILE_CYCLE = 16
_READ_BUFFER = 1 << 20  # Bytes per file read; records are whole JPEGs, so read in large chunks.

# The functions given to tf.data are straight-line TensorFlow, which AutoGraph's conversion
# leaves as it is, at a cost in every pipeline's tracing (and a generated file in the temp dir).
_unconverted = tf.autograph.experimental.do_not_convert


def default_config() -> ml_collections.ConfigDict:
    """The pipeline's options with their defaults: DETR's recipe at demo resolution."""
    config = ml_collections.ConfigDict()
    config.image_size = 160  # S: the square canvas of evaluation (and of training, but below).
    config.max_size = 160  # Longest side after resizing; at most image_size.
    config.scales = (96, 112, 128, 144, 160)  # Training: shorter side drawn from these.
    config.eval_size = 160  # Evaluation: shorter side.
    config.flip_prob = 0.5
    config.crop_prob = 0.5  # DETR picks crop-then-resize or plain resize with equal odds.
    config.crop_min_fraction = 0.5  # Crop sides are uniform in [this, 1] of the image's sides.
    config.max_boxes = 100  # Targets per image, padded or truncated; DETR's num_queries.
    config.batch_size = 16  # Global; each process feeds its rows of it (`process_rows`).
    config.seed = 0
    config.shuffle_buffer = 1024  # Encoded examples held for shuffling.
    # Training on rectangles instead of the S x S square: > 0 sorts each run of this many
    # batches by orientation after cropping (`train_canvases`); 0 pads every image to S x S.
    config.orientation_window = 0
    return config


def _checked(config: ml_collections.ConfigDict | None) -> ml_collections.ConfigDict:
    """Defaults filled in and every field validated; errors name the field."""
    merged = default_config()
    if config is not None:
        unknown = set(config.keys()) - set(merged.keys())
        if unknown:
            raise ValueError(f"unknown pipeline config field(s): {', '.join(sorted(unknown))}")
        merged.update(config)
    c = merged

    def require(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise ValueError(f"config.{field}={c[field]!r}: expected {expected}")

    require(c.image_size > 0, "image_size", "a positive number of pixels")
    require(0 < c.max_size <= c.image_size, "max_size", f"in [1, image_size={c.image_size}]")
    require(len(c.scales) > 0 and min(c.scales) > 0, "scales", "positive shorter-side sizes")
    require(c.eval_size > 0, "eval_size", "a positive number of pixels")
    require(0.0 <= c.flip_prob <= 1.0, "flip_prob", "a probability")
    require(0.0 <= c.crop_prob <= 1.0, "crop_prob", "a probability")
    require(0.0 < c.crop_min_fraction <= 1.0, "crop_min_fraction", "a fraction in (0, 1]")
    require(c.max_boxes > 0, "max_boxes", "a positive count")
    require(c.batch_size > 0, "batch_size", "a positive count")
    require(c.shuffle_buffer > 0, "shuffle_buffer", "a positive count")
    require(c.orientation_window >= 0, "orientation_window", "a count of batches, 0 for none")
    return c


def train_canvases(config: ml_collections.ConfigDict | None) -> tuple[tuple[int, int], ...]:
    """The (height, width) canvases of training batches: the S x S square, or with
    `orientation_window` the landscape rectangle (short x max_size, short = the largest
    scale within max_size) and the portrait one (its transpose).

    With orientation_window = k, each run of k global batches is sorted by the orientation
    of its images after cropping, landscape first (a square counts as landscape): every batch
    is of one orientation but the one where the sorted run turns, which takes its majority's
    canvas, its other images resized to fit it. A batch at 800x1333 needs the memory of that
    rectangle, not of the 1333x1333 square (a train step on each of the two canvases is
    compiled on first use).
    """
    c = _checked(config)
    if not c.orientation_window:
        return ((c.image_size, c.image_size),)
    short = min(max(c.scales), c.max_size)
    return ((short, c.max_size), (c.max_size, short))


# ------------------------------------------------------------------------------------------------
# Hosts and record files.
# ------------------------------------------------------------------------------------------------


def process_rows(batch_size: int) -> tuple[int, int]:
    """[first, stop): the rows of each global batch of `batch_size` that this JAX process
    feeds when the mesh lays processes out in order (`sharding.process_rows` reads them off
    the mesh itself)."""
    count = jax.process_count()
    if batch_size % count:
        raise ValueError(f"batch_size={batch_size} is not divisible by process_count={count}")
    local = batch_size // count
    return jax.process_index() * local, (jax.process_index() + 1) * local


def _checked_rows(rows: tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    first, stop = process_rows(batch_size) if rows is None else rows
    if not 0 <= first < stop <= batch_size:
        raise ValueError(f"rows=({first}, {stop}) are not rows of a batch of {batch_size}")
    return first, stop


def _keep_rows(stream: tf.data.Dataset, rows: tuple[int, int], batch_size: int) -> tf.data.Dataset:
    """The elements of `stream` that fall in rows [first, stop) of its consecutive batches."""
    first, stop = rows
    if (first, stop) == (0, batch_size):
        return stream

    @_unconverted
    def mine(index: tf.Tensor, element: Any) -> tf.Tensor:
        row = index % batch_size
        return (row >= first) & (row < stop)

    @_unconverted
    def element(index: tf.Tensor, element: Any) -> Any:
        return element

    return stream.enumerate().filter(mine).map(element)


def _file_instructions(
    builder: tfds.core.DatasetBuilder, split: tfds.typing.SplitArg
) -> tuple[list[Any], int]:
    """The (file, skip, take) pieces holding `split`, and its number of examples."""
    if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
        raise ValueError(
            f"{builder.name}: file_format {builder.info.file_format} is not supported; "
            "the pipeline reads TFRecord files"
        )
    info = builder.info.splits[split]
    return [fi for fi in info.file_instructions if fi.take > 0], info.num_examples


def _read(instructions: list[Any], order: tf.Tensor, cycle: int) -> tf.data.Dataset:
    """Serialized records of `instructions`, files taken in `order`, `cycle` files at a time."""
    names = tf.constant([fi.filename for fi in instructions], tf.string)
    skips = tf.constant([fi.skip for fi in instructions], tf.int64)
    takes = tf.constant([fi.take for fi in instructions], tf.int64)
    files = tf.data.Dataset.from_tensor_slices(
        (tf.gather(names, order), tf.gather(skips, order), tf.gather(takes, order))
    )

    @_unconverted
    def records(name: tf.Tensor, skip: tf.Tensor, take: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TFRecordDataset(name, buffer_size=_READ_BUFFER).skip(skip).take(take)

    return files.interleave(
        records,
        cycle_length=cycle,
        block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def _decoded(builder: tfds.core.DatasetBuilder, record: tf.Tensor) -> dict[str, Any]:
    example = builder.info.features.deserialize_example(
        record, decoders={"image": tfds.decode.SkipDecoding()}
    )
    example["image"] = tf.io.decode_image(example["image"], channels=3, expand_animations=False)
    return example


# ------------------------------------------------------------------------------------------------
# Per-example transforms (graph code; boxes are normalized xyxy until `_targets`).
# ------------------------------------------------------------------------------------------------


def _crop_window(
    hw: tf.Tensor, key: tf.Tensor, c: ml_collections.ConfigDict
) -> tuple[tf.Tensor, tf.Tensor]:
    """Top-left corner and (height, width) of the random crop of an image of size `hw`: the
    whole image with probability 1 - crop_prob. Pixel-free, so the orientation grouping can
    know a crop's shape without decoding the image."""
    size_key, place_key, apply_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    fraction = tf.random.stateless_uniform([2], size_key, minval=c.crop_min_fraction, maxval=1.0)
    crop = tf.maximum(tf.cast(tf.round(fraction * tf.cast(hw, tf.float32)), tf.int32), 1)
    place = tf.random.stateless_uniform([2], place_key)
    corner = tf.minimum(tf.cast(place * tf.cast(hw - crop + 1, tf.float32), tf.int32), hw - crop)
    apply = tf.random.stateless_uniform([], apply_key) < c.crop_prob
    return tf.where(apply, corner, 0), tf.where(apply, crop, hw)


def _crop(
    image: tf.Tensor, boxes: tf.Tensor, corner: tf.Tensor, crop: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """The crop's pixels and the boxes clipped to it, still normalized (to the crop)."""
    hw = tf.shape(image)[:2]
    image = tf.slice(image, tf.concat([corner, [0]], 0), tf.concat([crop, [-1]], 0))
    height, width = tf.unstack(tf.cast(hw, tf.float32))
    crop_h, crop_w = tf.unstack(tf.cast(crop, tf.float32))
    y0, x0 = tf.unstack(tf.cast(corner, tf.float32))
    absolute = box_lib.scale(boxes, height, width) - tf.stack([x0, y0, x0, y0])
    clipped = box_lib.clip_xyxy(absolute, max_x=crop_w, max_y=crop_h)
    return image, box_lib.unscale(clipped, crop_h, crop_w)


def _resize(
    image: tf.Tensor, shorter: tf.Tensor, max_size: int, canvas: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Shorter side to `shorter`, longer side at most `max_size`, the whole within `canvas`
    (height, width); float32 [h, w, 3] and (h, w).

    DETR's get_size rounds so the long side may pass max_size by a pixel; here it never does,
    as the image must fit the canvas.
    """
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    canvas = tf.cast(canvas, tf.float32)
    ratio = tf.minimum(
        tf.cast(shorter, tf.float32) / tf.reduce_min(hw), max_size / tf.reduce_max(hw)
    )
    ratio = tf.minimum(ratio, tf.reduce_min(canvas / hw))
    size = tf.clip_by_value(tf.cast(tf.round(hw * ratio), tf.int32), 1, max_size)
    size = tf.minimum(size, tf.cast(canvas, tf.int32))
    # Antialiasing keeps downscaling close to the PIL resize DETR trains with; upscaling gives
    # the same pixels without it, at half the cost.
    resized = tf.cond(
        ratio < 1.0,
        lambda: tf.image.resize(image, size, antialias=True),
        lambda: tf.image.resize(image, size),
    )
    return resized, size


def _canvas(
    image: tf.Tensor, size: tf.Tensor, canvas: tuple[int, int] | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Normalized image padded with zeros to [*canvas, 3], and its pixel mask."""
    image = (image / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    image = tf.image.pad_to_bounding_box(image, 0, 0, canvas[0], canvas[1])
    rows = tf.range(canvas[0]) < size[0]
    cols = tf.range(canvas[1]) < size[1]
    return image, rows[:, None] & cols[None, :]


def _targets(boxes: tf.Tensor, objects: Mapping[str, tf.Tensor], max_boxes: int) -> dict:
    """Non-crowd, non-empty boxes as padded cxcywh targets with their mask."""
    keep = (
        tf.logical_not(objects["is_crowd"])
        & (boxes[:, 2] > boxes[:, 0])
        & (boxes[:, 3] > boxes[:, 1])
    )
    kept = tf.boolean_mask(boxes, keep)[:max_boxes]
    labels = tf.boolean_mask(objects["label"], keep)[:max_boxes]
    count = tf.shape(kept)[0]
    pad = max_boxes - count
    return {
        "boxes": tf.ensure_shape(
            tf.pad(box_lib.xyxy_to_cxcywh(kept), [[0, pad], [0, 0]]), [max_boxes, 4]
        ),
        "labels": tf.ensure_shape(tf.pad(tf.cast(labels, tf.int32), [[0, pad]]), [max_boxes]),
        "box_mask": tf.range(max_boxes) < count,
    }


def _features(
    example: Mapping[str, Any],
    image: tf.Tensor,
    size: tf.Tensor,
    boxes: tf.Tensor,
    canvas: tuple[int, int] | tf.Tensor,
    c: ml_collections.ConfigDict,
) -> dict[str, tf.Tensor]:
    padded, mask = _canvas(image, size, canvas)
    return {
        "image": padded,
        "image_mask": mask,
        "image_size": size,
        "orig_size": tf.shape(example["image"])[:2],
        **_targets(boxes, example["objects"], c.max_boxes),
        "domain": tf.cast(example["domain"], tf.int32),
        "valid": tf.constant(True),
    }


def _augmentation_keys(key: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """An example's crop, scale and flip keys."""
    return tuple(tf.unstack(tf.random.experimental.stateless_split(key, 3)))


def _train_example(
    example: Mapping[str, Any],
    key: tf.Tensor,
    canvas: tuple[int, int] | tf.Tensor,
    c: ml_collections.ConfigDict,
) -> dict[str, tf.Tensor]:
    crop_key, scale_key, flip_key = _augmentation_keys(key)
    boxes = box_lib.yxyx_to_xyxy(example["objects"]["bbox"])
    corner, crop = _crop_window(tf.shape(example["image"])[:2], crop_key, c)
    image, boxes = _crop(example["image"], boxes, corner, crop)
    scales = tf.constant(c.scales, tf.int32)
    shorter = scales[tf.random.stateless_uniform([], scale_key, 0, len(c.scales), tf.int32)]
    image, size = _resize(image, shorter, c.max_size, canvas)
    flip = tf.random.stateless_uniform([], flip_key) < c.flip_prob
    image = tf.where(flip, tf.reverse(image, axis=[1]), image)
    mirrored = tf.stack([1.0 - boxes[:, 2], boxes[:, 1], 1.0 - boxes[:, 0], boxes[:, 3]], -1)
    boxes = tf.where(flip, mirrored, boxes)
    return _features(example, image, size, boxes, canvas, c)


def _eval_example(example: Mapping[str, Any], c: ml_collections.ConfigDict) -> dict:
    canvas = (c.image_size, c.image_size)
    image, size = _resize(example["image"], c.eval_size, c.max_size, canvas)
    boxes = box_lib.yxyx_to_xyxy(example["objects"]["bbox"])
    features = _features(example, image, size, boxes, canvas, c)
    features["image_id"] = example["image/id"]
    return features


# ------------------------------------------------------------------------------------------------
# Orientation groups (`train_canvases`).
# ------------------------------------------------------------------------------------------------

_JPEG_MAGIC = b"\xff\xd8"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def encoded_image_size(encoded: tf.Tensor) -> tf.Tensor:
    """(height, width) of an encoded image from its header where it is a JPEG or PNG (the
    formats TFDS writes), by decoding it otherwise."""

    def png() -> tf.Tensor:  # IHDR: big-endian width and height at bytes 16-23
        digits = tf.cast(tf.io.decode_raw(tf.strings.substr(encoded, 16, 8), tf.uint8), tf.int32)
        width, height = tf.unstack(
            tf.reshape(digits, [2, 4]) @ tf.constant([[1 << 24], [1 << 16], [1 << 8], [1]])
        )
        return tf.concat([height, width], 0)

    def decoded() -> tf.Tensor:
        return tf.shape(tf.io.decode_image(encoded, channels=3, expand_animations=False))[:2]

    return tf.case(
        [
            (
                tf.strings.substr(encoded, 0, 2) == _JPEG_MAGIC,
                lambda: tf.image.extract_jpeg_shape(encoded)[:2],
            ),
            (tf.strings.substr(encoded, 0, 8) == _PNG_MAGIC, png),
        ],
        default=decoded,
        exclusive=False,
    )


def _grouped_by_orientation(
    stream: tf.data.Dataset, builder: tfds.core.DatasetBuilder, c: ml_collections.ConfigDict
) -> tf.data.Dataset:
    """(key, record) -> (key, record, landscape canvas): each run of `orientation_window`
    batches sorted by the orientation of its crops, landscape first, and each batch given its
    majority's canvas (`train_canvases`). `stream` must start at a run's first record."""
    window, batch = c.orientation_window, c.batch_size

    @_unconverted
    def landscape(key: tf.Tensor, record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        example = builder.info.features.deserialize_example(
            record, decoders={"image": tfds.decode.SkipDecoding()}
        )
        crop_key, _, _ = _augmentation_keys(key)
        _, crop = _crop_window(encoded_image_size(example["image"]), crop_key, c)
        return key, record, crop[1] >= crop[0]

    @_unconverted
    def sorted_run(keys: tf.Tensor, records: tf.Tensor, landscape: tf.Tensor):
        order = tf.argsort(tf.cast(tf.logical_not(landscape), tf.int32), stable=True)
        by_batch = tf.reshape(tf.cast(tf.gather(landscape, order), tf.int32), [window, batch])
        majority = 2 * tf.reduce_sum(by_batch, axis=1) >= batch
        return tf.gather(keys, order), tf.gather(records, order), tf.repeat(majority, batch)

    return (
        stream.map(landscape, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .batch(window * batch, drop_remainder=True)
        .map(sorted_run)
        .unbatch()
    )


# ------------------------------------------------------------------------------------------------
# Datasets.
# ------------------------------------------------------------------------------------------------


def train_dataset(
    builder: tfds.core.DatasetBuilder,
    split: str,
    config: ml_collections.ConfigDict | None = None,
    *,
    start_step: int = 0,
    rows: tuple[int, int] | None = None,
) -> tf.data.Dataset:
    """Endless training batches of `split`, starting at step `start_step`: rows [first, stop)
    of each global batch (`rows`, by default this JAX process's share, `process_rows`).

    `train_dataset(..., start_step=k)` yields exactly the batches k, k+1, ... that
    `start_step=0` yields, for the same config, split and process layout.
    """
    c = _checked(config)
    rows = _checked_rows(rows, c.batch_size)
    instructions, num_examples = _file_instructions(builder, split)
    if num_examples == 0:
        raise ValueError(f"split {split!r} has no examples")
    if start_step < 0:
        raise ValueError(f"start_step={start_step} is negative")
    # Orientation groups are runs of whole batches counted from the first: a resumed stream
    # starts at its run's first record and skips the batches of the run already trained on.
    run_start = (
        start_step - start_step % c.orientation_window if c.orientation_window else start_step
    )
    first_epoch, offset = divmod(run_start * c.batch_size, num_examples)
    num_files = len(instructions)

    @_unconverted
    def epoch(e: tf.Tensor) -> tf.data.Dataset:
        key = tf.random.experimental.stateless_fold_in(tf.constant([c.seed, 0], tf.int64), e)
        files_key, buffer_key, augment_key = tf.unstack(
            tf.random.experimental.stateless_split(key, 3)
        )
        order = tf.random.experimental.stateless_shuffle(tf.range(num_files), files_key)
        buffer_seed = tf.random.stateless_uniform(
            [], buffer_key, minval=None, maxval=None, dtype=tf.int64
        )
        records = _read(instructions, order, min(num_files, _FILE_CYCLE)).shuffle(
            c.shuffle_buffer, seed=buffer_seed, reshuffle_each_iteration=False
        )

        @_unconverted
        def keyed(position: tf.Tensor, record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            return tf.random.experimental.stateless_fold_in(augment_key, position), record

        return records.enumerate().map(keyed)

    # Records before the resume point (and other processes' rows) are read and shuffled, to keep
    # the global order, but skipped before parsing, so never decoded or augmented. Every process
    # reads every record's bytes: TFRecord files allow no random access.
    stream = tf.data.Dataset.counter(first_epoch).flat_map(epoch).skip(offset)
    if c.orientation_window:
        landscape, portrait = train_canvases(c)
        stream = _grouped_by_orientation(stream, builder, c)
        stream = stream.skip((start_step - run_start) * c.batch_size)

        @_unconverted
        def example(key: tf.Tensor, record: tf.Tensor, wide: tf.Tensor) -> dict[str, tf.Tensor]:
            canvas = tf.where(wide, landscape, portrait)
            return _train_example(_decoded(builder, record), key, canvas, c)

    else:

        @_unconverted
        def example(key: tf.Tensor, record: tf.Tensor) -> dict[str, tf.Tensor]:
            return _train_example(_decoded(builder, record), key, train_canvases(c)[0], c)

    return (
        _keep_rows(stream, rows, c.batch_size)
        .map(
            example,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        .batch(rows[1] - rows[0], drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def train_iterator(
    builder: tfds.core.DatasetBuilder,
    split: str,
    config: ml_collections.ConfigDict | None = None,
    **kwargs: Any,
) -> Iterator[Batch]:
    """`train_dataset` as numpy batches."""
    return iteration.numpy_iterator(train_dataset(builder, split, config, **kwargs))


def num_eval_batches(builder: tfds.core.DatasetBuilder, split: str, batch_size: int) -> int:
    """Global batches of `batch_size` that cover `split`, the last one filled up."""
    return -(-builder.info.splits[split].num_examples // batch_size)


# Evaluation reads every split of a build with one per-example function: each `map` of a new
# Python function traces it again (0.2-0.4 s on 2 cores), once per split and run; 14 splits
# were built in 5.9 s with a function each, in 1.0 s with one traced once.
@functools.lru_cache(maxsize=8)
def _eval_example_fn(builder: tfds.core.DatasetBuilder, config_json: str) -> Any:
    c = _checked(ml_collections.ConfigDict(json.loads(config_json)))

    def example(record: tf.Tensor) -> dict[str, tf.Tensor]:
        return _eval_example(_decoded(builder, record), c)

    return tf.function(example, autograph=False)


def eval_dataset(
    builder: tfds.core.DatasetBuilder,
    split: str,
    config: ml_collections.ConfigDict | None = None,
    *,
    rows: tuple[int, int] | None = None,
) -> tf.data.Dataset:
    """`split` in record order, unaugmented, in `num_eval_batches` batches: rows [first, stop)
    of each global batch (`rows`, by default this JAX process's share).

    The last batch is filled with all-zero dummies whose `valid` is False, so every batch has
    the same shape and every process runs the same number of steps.
    """
    c = _checked(config)
    first, stop = rows = _checked_rows(rows, c.batch_size)
    instructions, num_examples = _file_instructions(builder, split)
    records = _read(instructions, tf.range(len(instructions)), cycle=1)
    examples = _keep_rows(records, rows, c.batch_size).map(
        _eval_example_fn(builder, c.to_json(sort_keys=True)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    full, rest = divmod(num_examples, c.batch_size)
    mine = full * (stop - first) + min(max(rest - first, 0), stop - first)
    fill = num_eval_batches(builder, split, c.batch_size) * (stop - first) - mine
    dummy = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), examples.element_spec)
    return (
        examples.concatenate(tf.data.Dataset.from_tensors(dummy).repeat(fill))
        .batch(stop - first, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


# ------------------------------------------------------------------------------------------------
# Box conventions.
# ------------------------------------------------------------------------------------------------


def batch_spec(
    config: ml_collections.ConfigDict, canvas: tuple[int, int] | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one global device batch of `config` (config.input) on `canvas`
    (height, width; by default the S x S square), without the host-only keys: what a step is
    compiled for before any data exists."""
    c = _checked(config)
    b, m = c.batch_size, c.max_boxes
    h, w = canvas or (c.image_size, c.image_size)
    shapes = {
        "image": ((b, h, w, 3), np.float32),
        "image_mask": ((b, h, w), np.bool_),
        "image_size": ((b, 2), np.int32),
        "orig_size": ((b, 2), np.int32),
        "boxes": ((b, m, 4), np.float32),
        "labels": ((b, m), np.int32),
        "box_mask": ((b, m), np.bool_),
        "domain": ((b,), np.int32),
        "valid": ((b,), np.bool_),
    }
    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}


def boxes_on_canvas(
    boxes: np.ndarray, image_size: np.ndarray, canvas: tuple[int, int]
) -> np.ndarray:
    """Normalized cxcywh relative to the unpadded image [..., M, 4] -> relative to the canvas
    (height, width).

    `image_size` is the batch's [..., 2] (height, width); numpy or jax arrays.
    """
    size = image_size.astype(boxes.dtype)
    absolute = box_lib.scale(boxes, size[..., None, 0], size[..., None, 1])
    return box_lib.unscale(absolute, float(canvas[0]), float(canvas[1]))


def coco_boxes(boxes: np.ndarray, orig_size: np.ndarray) -> np.ndarray:
    """Model boxes [..., Q, 4] (normalized cxcywh, relative to the unpadded image) -> COCO.

    Returns absolute [x, y, w, h] in source-image pixels, given the batch's `orig_size`
    [..., 2] (height, width); numpy or jax arrays. Boxes are not clipped to the image, as in
    DETR's post-processing.
    """
    size = orig_size.astype(boxes.dtype)
    return box_lib.cxcywh_to_coco(boxes, size[..., None, 0], size[..., None, 1])
