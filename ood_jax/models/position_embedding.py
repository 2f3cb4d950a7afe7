"""Sine position embeddings of the DETR family (Carion et al., 2020; Zhu et al., 2021; DINO).

* `sine_embedding(coords, num_features)`: per coordinate, sines and cosines of geometric
  frequencies, interleaved (DETR's layout); used on boxes and anchors too.
* `sine_position_embedding(mask, num_features, offset=...)`: the normalized embedding of an
  image's padding mask. DETR and DINO count pixel coordinates from 0 (`offset=0`), Deformable
  DETR from the pixel centres (`offset=0.5`).
"""

import math

import jax
import jax.numpy as jnp


def sine_embedding(coords: jax.Array, num_features: int, temperature: float = 10000.0) -> jax.Array:
    """[..., n] angles -> [..., n * num_features]: per coordinate, in the given order, the
    sines and cosines of coord / temperature ** (2 * (i // 2) / num_features), interleaved."""
    dim_t = jnp.arange(num_features, dtype=jnp.float32)
    dim_t = temperature ** (2 * jnp.floor(dim_t / 2) / num_features)
    angles = coords.astype(jnp.float32)[..., None] / dim_t
    pairs = jnp.stack([jnp.sin(angles[..., 0::2]), jnp.cos(angles[..., 1::2])], axis=-1)
    return pairs.reshape(*coords.shape[:-1], coords.shape[-1] * num_features)


def sine_position_embedding(
    mask: jax.Array,
    num_features: int,
    temperature: float = 10000.0,
    offset: float = 0.0,
    scale: float = 2 * math.pi,
) -> jax.Array:
    """Normalized sine embedding of a [B, h, w] padding mask -> [B, h, w, 2 * num_features]
    float32.

    Coordinates are cumulative counts of real pixels along each axis, minus `offset` (0 in DETR
    and DINO, 0.5 in Deformable DETR), divided by the count at the row/column end (+1e-6) and
    times `scale` (so in (0, 2 pi] for offset 0); y features come before x features (see
    `sine_embedding` for the layout within each).
    """
    mask = mask.astype(jnp.float32)
    y = jnp.cumsum(mask, axis=1)
    x = jnp.cumsum(mask, axis=2)
    y = (y - offset) / (y[:, -1:, :] + 1e-6) * scale
    x = (x - offset) / (x[:, :, -1:] + 1e-6) * scale
    return sine_embedding(jnp.stack([y, x], axis=-1), num_features, temperature)
