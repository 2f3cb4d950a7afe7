"""Exported detectors: the one file format, written and read here.

An exported detector is one self-contained msgpack file (docs/guide/detectors.md#export-formats).
`write_exported` writes one (`ood_jax.train.export` does, from a workdir's checkpoint);
`load_exported` reads it back and runs it without the training stack: nothing here imports
optax, orbax or TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import serialization

from ood_jax import boxes as box_lib
from ood_jax import files
from ood_jax.models import registry

EXPORT_FORMAT_VERSION = 1

Detections = dict[str, np.ndarray]


def _forward(
    module: nn.Module, variables: Mapping[str, Any], images: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Model, then its family's post-processing."""
    outputs = module.apply(variables, images, mask, train=False)
    return registry.family_of(module).postprocess(outputs)


@dataclasses.dataclass
class ExportedModel:
    """An exported detector: the module, its variables and how its inputs were prepared.

    `input_config` holds image_size (the padded canvas side), eval_size (shorter side after
    resizing), max_size (cap on the longer side), mean and std (per channel, on pixels scaled
    to [0, 1]); `predict` prepares images exactly as the evaluation pipeline does.
    """

    module: nn.Module
    variables: dict[str, Any]
    class_names: list[str] | None
    input_config: dict[str, Any]
    step: int
    model_name: str | None = None

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> ExportedModel:
        """The model a format-1 dict (`make_payload`, or a file's contents) describes."""
        return cls(
            module=registry.build_model(ml_collections.ConfigDict(payload["model"])),
            variables=jax.tree.map(jnp.asarray, payload["variables"]),
            class_names=payload["class_names"],
            input_config=payload["input"],
            step=int(payload["step"]),
            model_name=payload["model_name"],
        )

    def predict_canvas(self, images: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        """The model on prepared batches (`preprocess`'s canvases [B, S, S, 3] and masks
        [B, S, S]): {"boxes": [B, Q, 4] normalized cx, cy, w, h of the image, "scores",
        "labels": [B, Q]}."""
        return self._predict_batch(self.variables, images, mask)

    @functools.cached_property
    def _predict_batch(self) -> Callable[..., dict[str, jax.Array]]:
        return jax.jit(functools.partial(_forward, self.module))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) of an image after the evaluation resize: shorter side to eval_size, capped.

        Computed in float32 with round-half-to-even, as the tf.data pipeline does, so both give
        the same size.
        """
        c = self.input_config
        hw = np.array([height, width], np.float32)
        ratio = min(np.float32(c["eval_size"]) / hw.min(), np.float32(c["max_size"]) / hw.max())
        size = np.clip(np.round(hw * ratio).astype(np.int32), 1, c["max_size"])
        return int(size[0]), int(size[1])

    def preprocess(self, image: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """uint8 [H, W, 3] -> normalized image on the padded canvas [S, S, 3] and its mask [S, S]."""
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"expected an image [H, W, 3], got shape {image.shape}")
        c = self.input_config
        height, width = self.resized_size(*image.shape[:2])
        # Antialiasing only acts when downscaling, as in the pipeline's tf.image.resize.
        resized = jax.image.resize(
            jnp.asarray(image, jnp.float32), (height, width, 3), "bilinear", antialias=True
        )
        normalized = (resized / 255.0 - jnp.asarray(c["mean"])) / jnp.asarray(c["std"])
        side = c["image_size"]
        canvas = jnp.zeros((side, side, 3), jnp.float32).at[:height, :width].set(normalized)
        mask = (jnp.arange(side) < height)[:, None] & (jnp.arange(side) < width)[None, :]
        return canvas, mask

    def predict(self, images: np.ndarray | Sequence[np.ndarray]) -> Detections | list[Detections]:
        """Detections of one uint8 image [H, W, 3], or a list of them for a list of images
        (or a [B, H, W, 3] array).

        Each is {"boxes": [Q, 4] absolute [x, y, w, h] in the image's pixels, "scores": [Q],
        "labels": [Q]}, one per query, unfiltered, as DETR's post-processing gives them. A list
        runs as one batch (images of any sizes: each is padded to the canvas).
        """
        single = not isinstance(images, (list, tuple)) and np.ndim(images) == 3
        batch = [images] if single else list(images)
        prepared = [self.preprocess(image) for image in batch]
        out = self.predict_canvas(
            jnp.stack([canvas for canvas, _ in prepared]),
            jnp.stack([mask for _, mask in prepared]),
        )
        out = jax.device_get(out)
        detections = []
        for i, image in enumerate(batch):
            height, width = np.asarray(image).shape[:2]
            detections.append(
                {
                    "boxes": box_lib.cxcywh_to_coco(out["boxes"][i], float(height), float(width)),
                    "scores": out["scores"][i],
                    "labels": out["labels"][i],
                }
            )
        return detections[0] if single else detections


def load_exported(path: str | pathlib.Path) -> ExportedModel:
    """The detector exported to `path` (by `write_exported`, as `ood-jax export` does), ready
    for inference."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no exported model there")
    try:
        payload = serialization.msgpack_restore(path.read_bytes())
    except Exception as e:
        raise ValueError(f"{path}: not an exported model ({e})") from e
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if version != EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {version!r}; this ood_jax reads {EXPORT_FORMAT_VERSION}"
        )
    return ExportedModel.from_payload(payload)


def make_payload(
    *,
    model_config: Mapping[str, Any],
    input_config: Mapping[str, Any],
    mean: Sequence[float],
    std: Sequence[float],
    class_names: Sequence[str] | None,
    variables: Mapping[str, Any],
    step: int,
    model_name: str | None,
) -> dict[str, Any]:
    """A detector's format-1 dict (docs/guide/detectors.md#export-formats).

    `model_config` is config.model as a dict, `input_config` config.input (image_size,
    eval_size and max_size are kept), `mean` and `std` the normalization the input pipeline
    applies. Raises ValueError when the class names do not match config.model.args.num_classes.
    """
    num_classes = model_config.get("args", {}).get("num_classes")
    if class_names is not None and num_classes is not None and len(class_names) != num_classes:
        raise ValueError(
            f"{len(class_names)} class names for config.model.args.num_classes={num_classes}"
        )
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "model": model_config,
        "input": {
            "image_size": input_config["image_size"],
            "eval_size": input_config["eval_size"],
            "max_size": input_config["max_size"],
            "mean": list(mean),
            "std": list(std),
        },
        "class_names": None if class_names is None else list(class_names),
        "variables": variables,
        "step": step,
        "model_name": model_name,
    }


def write_exported(path: str | pathlib.Path, payload: Mapping[str, Any]) -> pathlib.Path:
    """Writes a `make_payload` dict to `path`, atomically: a failure leaves any previous file
    there and no partial one. Returns the path."""
    return files.write_atomic(path, serialization.msgpack_serialize(dict(payload)))
