"""Box math: format conversions and IoU geometry.

Formats (last axis 4, any leading batch dims):
  * cxcywh: normalized [cx, cy, w, h], what the models predict.
  * yxyx:   normalized [ymin, xmin, ymax, xmax], what TFDS stores.
  * xyxy:   [xmin, ymin, xmax, ymax], what the IoU geometry works on.
  * xywh:   [x, y, w, h], COCO JSON when absolute.

Conversions accept numpy arrays, jax arrays and tf.Tensors and return the same
framework, so the tf.data pipeline and the JAX model share one implementation.
Geometry is jnp only.
"""

from typing import TYPE_CHECKING, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

Boxes = Union[np.ndarray, jax.Array, "tf.Tensor"]
Size = Union[float, np.ndarray, jax.Array, "tf.Tensor"]


def _is_tf(x: Boxes) -> bool:
    # Checking the type's module avoids importing tensorflow for jax/numpy users.
    return type(x).__module__.startswith("tensorflow")


def _stack(parts: Sequence[Boxes], like: Boxes) -> Boxes:
    if _is_tf(like):
        import tensorflow as tf

        return tf.stack(parts, axis=-1)
    if isinstance(like, jax.Array):
        return jnp.stack(parts, axis=-1)
    return np.stack(parts, axis=-1)


def _clip(x: Boxes, hi: float) -> Boxes:
    if _is_tf(x):
        import tensorflow as tf

        return tf.clip_by_value(x, 0.0, hi)
    if isinstance(x, jax.Array):
        return jnp.clip(x, 0.0, hi)
    return np.clip(x, 0.0, hi)


def cxcywh_to_xyxy(b: Boxes) -> Boxes:
    """[cx, cy, w, h] -> [xmin, ymin, xmax, ymax]."""
    cx, cy, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return _stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], b)


def xyxy_to_cxcywh(b: Boxes) -> Boxes:
    """[xmin, ymin, xmax, ymax] -> [cx, cy, w, h]."""
    x0, y0, x1, y1 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return _stack([0.5 * (x0 + x1), 0.5 * (y0 + y1), x1 - x0, y1 - y0], b)


def yxyx_to_xyxy(b: Boxes) -> Boxes:
    """[ymin, xmin, ymax, xmax] -> [xmin, ymin, xmax, ymax]."""
    return _stack([b[..., 1], b[..., 0], b[..., 3], b[..., 2]], b)


def xyxy_to_yxyx(b: Boxes) -> Boxes:
    """[xmin, ymin, xmax, ymax] -> [ymin, xmin, ymax, xmax]."""
    # The swap is its own inverse.
    return yxyx_to_xyxy(b)


def cxcywh_to_yxyx(b: Boxes) -> Boxes:
    """[cx, cy, w, h] -> [ymin, xmin, ymax, xmax]."""
    return xyxy_to_yxyx(cxcywh_to_xyxy(b))


def yxyx_to_cxcywh(b: Boxes) -> Boxes:
    """[ymin, xmin, ymax, xmax] -> [cx, cy, w, h]."""
    return xyxy_to_cxcywh(yxyx_to_xyxy(b))


def xywh_to_xyxy(b: Boxes) -> Boxes:
    """[x, y, w, h] -> [xmin, ymin, xmax, ymax]."""
    x, y, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return _stack([x, y, x + w, y + h], b)


def xyxy_to_xywh(b: Boxes) -> Boxes:
    """[xmin, ymin, xmax, ymax] -> [x, y, w, h]."""
    x0, y0, x1, y1 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return _stack([x0, y0, x1 - x0, y1 - y0], b)


def scale(b: Boxes, height: Size, width: Size) -> Boxes:
    """Normalized -> absolute for boxes with x at indices 0, 2 (xyxy, cxcywh, xywh)."""
    return _stack([b[..., 0] * width, b[..., 1] * height, b[..., 2] * width, b[..., 3] * height], b)


def unscale(b: Boxes, height: Size, width: Size) -> Boxes:
    """Inverse of `scale`."""
    return _stack([b[..., 0] / width, b[..., 1] / height, b[..., 2] / width, b[..., 3] / height], b)


def cxcywh_to_coco(b: Boxes, height: Size, width: Size) -> Boxes:
    """Normalized [cx, cy, w, h] -> absolute COCO [x, y, w, h]."""
    return xyxy_to_xywh(scale(cxcywh_to_xyxy(b), height, width))


def coco_to_cxcywh(b: Boxes, height: Size, width: Size) -> Boxes:
    """Absolute COCO [x, y, w, h] -> normalized [cx, cy, w, h]."""
    return xyxy_to_cxcywh(unscale(xywh_to_xyxy(b), height, width))


def clip_xyxy(b: Boxes, max_x: float = 1.0, max_y: float = 1.0) -> Boxes:
    """Clip xyxy boxes to [0, max_x] x [0, max_y]."""
    x0, y0, x1, y1 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return _stack([_clip(x0, max_x), _clip(y0, max_y), _clip(x1, max_x), _clip(y1, max_y)], b)


def area(b: jax.Array) -> jax.Array:
    """Area of xyxy boxes [..., 4] -> [...]; inverted boxes have area 0."""
    return jnp.maximum(b[..., 2] - b[..., 0], 0.0) * jnp.maximum(b[..., 3] - b[..., 1], 0.0)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    # Double `where` so that neither the value nor the gradient sees 0/0.
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _areas(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Intersection, union and enclosing-box areas of broadcast-aligned xyxy boxes."""
    lo = jnp.maximum(a[..., :2], b[..., :2])
    hi = jnp.minimum(a[..., 2:], b[..., 2:])
    inter = area(jnp.concatenate([lo, hi], axis=-1))
    union = area(a) + area(b) - inter
    outer_lo = jnp.minimum(a[..., :2], b[..., :2])
    outer_hi = jnp.maximum(a[..., 2:], b[..., 2:])
    enclosing = area(jnp.concatenate([outer_lo, outer_hi], axis=-1))
    return inter, union, enclosing


def pairwise_iou(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """IoU and union of all pairs: a [..., N, 4], b [..., M, 4] xyxy -> both [..., N, M]."""
    inter, union, _ = _areas(a[..., :, None, :], b[..., None, :, :])
    return _safe_div(inter, union), union


def pairwise_giou(a: jax.Array, b: jax.Array) -> jax.Array:
    """Generalized IoU of all pairs: a [..., N, 4], b [..., M, 4] xyxy -> [..., N, M]."""
    return elementwise_giou(a[..., :, None, :], b[..., None, :, :])


def elementwise_iou(a: jax.Array, b: jax.Array) -> jax.Array:
    """IoU of aligned pairs: a, b [..., 4] xyxy -> [...]."""
    inter, union, _ = _areas(a, b)
    return _safe_div(inter, union)


def elementwise_giou(a: jax.Array, b: jax.Array) -> jax.Array:
    """Generalized IoU of aligned pairs: a, b [..., 4] xyxy -> [...] in [-1, 1]."""
    inter, union, enclosing = _areas(a, b)
    return _safe_div(inter, union) - _safe_div(enclosing - union, enclosing)
