"""The image processor of a scorer checkpoint: resize, center crop, rescale, normalize.

`load_preprocessing` reads a checkpoint's preprocessor_config.json (transformers'
`CLIPImageProcessor`, `SiglipImageProcessor` or BLIP-2's `BlipImageProcessor` fields; their class
defaults, at the model's image size, for what the file leaves out), and `ImagePreprocessing`
maps one uint8 [H, W, 3] image to float32 [h, w, 3] as that processor does, to within one uint8
level. Pillow releases the GIL while resampling, so a thread pool preprocesses in parallel.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PREPROCESSOR_FILE = "preprocessor_config.json"

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the code preprocessor configs store
RESAMPLE_CODES = {int(r) for r in Image.Resampling}
# big_vision's `resize` op (LiT's evaluation): tf.image.resize's bilinear with half-pixel
# centres and no antialiasing, clipped and cast back to uint8 (truncating), not a Pillow filter.
TF_BILINEAR = "tf_bilinear"


def _defaults(kind: str, image_size: int) -> dict[str, Any]:
    """`CLIPImageProcessor` / `SiglipImageProcessor` / `BlipImageProcessor` class defaults at
    the model's image size."""
    # GroupViT's checkpoints ship CLIP's processor, with their own statistics in the file.
    if kind in ("clip", "groupvit"):
        return {
            "do_resize": True,
            "size": {"shortest_edge": image_size},
            "resample": BICUBIC,
            "do_center_crop": True,
            "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": OPENAI_CLIP_MEAN,
            "image_std": OPENAI_CLIP_STD,
        }
    if kind == "siglip":
        return {
            "do_resize": True,
            "size": {"height": image_size, "width": image_size},
            "resample": BICUBIC,
            "do_center_crop": False,
            "crop_size": None,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": IMAGENET_STANDARD_MEAN,
            "image_std": IMAGENET_STANDARD_STD,
        }
    if kind == "blip2":  # SigLIP's square resize without crop, with OpenAI CLIP's statistics
        statistics = {"image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD}
        return {**_defaults("siglip", image_size), **statistics}
    raise ValueError(f"unknown scorer kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class ImagePreprocessing:
    """One image processor configuration; call it on a uint8 [H, W, 3] image.

    Attributes:
      shortest_edge: resize the shorter side to this (exclusive with `resize_to`).
      resize_to: (height, width) to resize to.
      resample: Pillow filter code (2 bilinear, 3 bicubic, ...), or `TF_BILINEAR`.
      crop: (height, width) of the center crop, or None.
      rescale_factor: multiplies pixel values (1/255), or None.
      mean, std: per-channel normalization (in rescaled units), or None.
    """

    shortest_edge: int | None = None
    resize_to: tuple[int, int] | None = None
    resample: int | str = BICUBIC
    crop: tuple[int, int] | None = None
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(h, w) of every output, or None when it depends on the input's size."""
        return self.crop or self.resize_to

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        if self.shortest_edge is None:
            return height, width
        size = self.shortest_edge
        # transformers' get_resize_output_image_size: the longer side int(s * long / short).
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(size * long / short)
        return (new_long, size) if width <= height else (size, new_long)

    def resize(self, image: np.ndarray) -> np.ndarray:
        height, width = self.resized_size(*image.shape[:2])
        if self.resample == TF_BILINEAR:
            if (height, width) == image.shape[:2]:
                return image
            return tf_bilinear_resize(image, height, width)
        # transformers' default (torchvision) backend resizes uint8 images with torch's
        # antialiased kernels, which follow Pillow's, up to fixed-point rounding (one level).
        # Two separable passes, width first, each rounded to uint8 as torch's kernel does; a
        # single Pillow call may pick the other order, which moves overshooting pixels by up to
        # ~20 levels on noisy images.
        pil = Image.fromarray(image)
        if width != pil.width:
            pil = pil.resize((width, pil.height), resample=self.resample)
        if height != pil.height:
            pil = pil.resize((width, height), resample=self.resample)
        return np.asarray(pil)

    def center_crop(self, image: np.ndarray) -> np.ndarray:
        if self.crop is None:
            return image
        ch, cw = self.crop
        h, w = image.shape[:2]
        if ch > h or cw > w:
            # torchvision pads (left/top get the smaller half) with black, then crops.
            top, left = max(ch - h, 0) // 2, max(cw - w, 0) // 2
            bottom, right = max(ch - h, 0) - top, max(cw - w, 0) - left
            image = np.pad(image, ((top, bottom), (left, right), (0, 0)))
            h, w = image.shape[:2]
        top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
        return image[top : top + ch, left : left + cw]

    def normalize(self, image: np.ndarray) -> np.ndarray:
        x = image.astype(np.float32)
        if self.mean is not None:
            # transformers folds the rescale into the statistics, in float32, then
            # subtracts and divides (torchvision's normalize).
            scale = np.float32(1.0 / self.rescale_factor) if self.rescale_factor else np.float32(1)
            mean = np.asarray(self.mean, np.float32) * scale
            std = np.asarray(self.std, np.float32) * scale
            return (x - mean) / std
        if self.rescale_factor is not None:
            return x * np.float32(self.rescale_factor)
        return x

    def __call__(self, image: np.ndarray) -> np.ndarray:
        return self.normalize(self.center_crop(self.resize(as_rgb_uint8(image))))


def _bilinear_taps(out: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TensorFlow's bilinear source taps along one axis (half-pixel centres, float32)."""
    src = (np.arange(out, dtype=np.float32) + np.float32(0.5)) * np.float32(size / out)
    src -= np.float32(0.5)
    floor = np.floor(src)
    lower = np.maximum(floor, 0).astype(np.int64)
    upper = np.minimum(np.ceil(src), size - 1).astype(np.int64)
    return lower, upper, (src - floor).astype(np.float32)


def tf_bilinear_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [height, width, C] as big_vision's `resize` op: TensorFlow's
    `resize_bilinear` (half-pixel centres, no antialiasing), in its order of operations, then
    truncated to uint8. Equal to `tf.cast(tf.image.resize(image, (height, width)), tf.uint8)`."""
    y0, y1, ly = _bilinear_taps(height, image.shape[0])
    x0, x1, lx = _bilinear_taps(width, image.shape[1])
    x = image.astype(np.float32)
    lx = lx[None, :, None]
    top = x[y0][:, x0] + (x[y0][:, x1] - x[y0][:, x0]) * lx
    bottom = x[y1][:, x0] + (x[y1][:, x1] - x[y1][:, x0]) * lx
    out = top + (bottom - top) * ly[:, None, None]
    return np.clip(out, 0, 255).astype(np.uint8)


def as_rgb_uint8(image: Any) -> np.ndarray:
    """A uint8 [H, W, 3] array; grayscale [H, W] or [H, W, 1] is repeated to three channels."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 image, got dtype {image.dtype}")
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"expected an image [H, W, 3] (or grayscale), got shape {image.shape}")
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    return np.ascontiguousarray(image)


def _size_dict(value: Any, field: str, default_to_square: bool) -> dict[str, int]:
    """transformers' `get_size_dict` for the formats preprocessor configs use."""
    if isinstance(value, int):
        if default_to_square:
            return {"height": value, "width": value}
        return {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    if isinstance(value, dict) and (
        set(value) == {"shortest_edge"} or set(value) == {"height", "width"}
    ):
        return {k: int(v) for k, v in value.items()}
    raise ValueError(
        f"{PREPROCESSOR_FILE}: {field}={value!r} is not supported "
        '(an int, [h, w], {"shortest_edge": s} or {"height": h, "width": w})'
    )


def preprocessing_from_config(
    config: dict[str, Any], kind: str, image_size: int
) -> ImagePreprocessing:
    """The preprocessing a preprocessor_config.json dict describes (defaults: `_defaults`)."""
    c = {**_defaults(kind, image_size), **config}
    shortest_edge = resize_to = crop = None
    if c["do_resize"]:
        # CLIP's and SigLIP's processors both read a bare int as the shortest edge.
        size = _size_dict(c["size"], "size", default_to_square=False)
        if "shortest_edge" in size:
            shortest_edge = size["shortest_edge"]
        else:
            resize_to = (size["height"], size["width"])
    if c["do_center_crop"]:
        if c["crop_size"] is None:
            raise ValueError(f"{PREPROCESSOR_FILE}: do_center_crop is set but crop_size is missing")
        crop_size = _size_dict(c["crop_size"], "crop_size", default_to_square=True)
        if "height" not in crop_size:
            raise ValueError(f"{PREPROCESSOR_FILE}: crop_size needs height and width")
        crop = (crop_size["height"], crop_size["width"])
    if c["resample"] not in (*RESAMPLE_CODES, TF_BILINEAR):
        raise ValueError(
            f"{PREPROCESSOR_FILE}: resample={c['resample']!r}; expected a Pillow filter code "
            f"{sorted(RESAMPLE_CODES)} or {TF_BILINEAR!r}"
        )
    mean = std = None
    if c["do_normalize"]:
        mean, std = _channels(c["image_mean"], "image_mean"), _channels(c["image_std"], "image_std")
    return ImagePreprocessing(
        shortest_edge=shortest_edge,
        resize_to=resize_to,
        resample=c["resample"] if c["resample"] == TF_BILINEAR else int(c["resample"]),
        crop=crop,
        rescale_factor=float(c["rescale_factor"]) if c["do_rescale"] else None,
        mean=mean,
        std=std,
    )


def _channels(value: Any, field: str) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3:
        raise ValueError(f"{PREPROCESSOR_FILE}: {field}={value!r}: expected 3 channel values")
    return tuple(float(v) for v in values)


def load_preprocessing(path: str | Path, kind: str, image_size: int) -> ImagePreprocessing:
    """The preprocessing of checkpoint directory `path` (the class defaults without the file)."""
    file = Path(path) / PREPROCESSOR_FILE
    if not file.is_file():
        return preprocessing_from_config({}, kind, image_size)
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    return preprocessing_from_config(config, kind, image_size)
