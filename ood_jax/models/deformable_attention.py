"""Multi-scale deformable attention (Zhu et al., 2021), in pure JAX.

Each query attends to `num_points` sampled locations per head and feature level around a
reference point instead of to every key. `multi_scale_deformable_attention` is the op (one
gather of value rows, fixed shapes, optionally recomputed in the backward pass),
`MultiScaleDeformableAttention` the layer, and `multi_scale_deformable_attention_reference` a
slow independent implementation that tests check the op against.
"""

import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

SpatialShapes = Sequence[tuple[int, int]]

_xavier = nn.initializers.xavier_uniform()


def _check_shapes(
    value: jax.Array,
    spatial_shapes: SpatialShapes,
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
) -> None:
    batch, num_keys, num_heads, _ = value.shape
    if sum(h * w for h, w in spatial_shapes) != num_keys:
        raise ValueError(
            f"spatial_shapes {tuple(spatial_shapes)} hold {sum(h * w for h, w in spatial_shapes)} "
            f"keys but value has {num_keys}"
        )
    if sampling_locations.ndim != 6 or sampling_locations.shape[-1] != 2:
        raise ValueError(
            "sampling_locations must be [batch, queries, heads, levels, points, 2], got "
            f"{sampling_locations.shape}"
        )
    b, _, h, levels, _, _ = sampling_locations.shape
    if (b, h, levels) != (batch, num_heads, len(spatial_shapes)):
        raise ValueError(
            f"sampling_locations {sampling_locations.shape} disagree with value {value.shape} "
            f"and {len(spatial_shapes)} levels"
        )
    if attention_weights.shape != sampling_locations.shape[:-1]:
        raise ValueError(
            f"attention_weights {attention_weights.shape} must be sampling_locations' shape "
            f"without the last axis, {sampling_locations.shape[:-1]}"
        )


def _bilinear_taps(locations: jax.Array, height: int, width: int) -> tuple[jax.Array, jax.Array]:
    """Row index within a level and weight of the 4 neighbours of each (x, y) location.

    locations [..., 2] -> (indices [..., 4] int32 into the level's height * width keys,
    weights [..., 4]). Neighbours outside the level get weight 0 and an in-bounds index.
    """
    x = locations[..., 0] * width - 0.5
    y = locations[..., 1] * height - 0.5
    x0, y0 = jnp.floor(x), jnp.floor(y)
    fx, fy = x - x0, y - y0
    x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
    xs = jnp.stack([x0, x0 + 1, x0, x0 + 1], axis=-1)
    ys = jnp.stack([y0, y0, y0 + 1, y0 + 1], axis=-1)
    wx = jnp.stack([1 - fx, fx, 1 - fx, fx], axis=-1)
    wy = jnp.stack([1 - fy, 1 - fy, fy, fy], axis=-1)
    inside = (xs >= 0) & (xs < width) & (ys >= 0) & (ys < height)
    weights = jnp.where(inside, wx * wy, 0.0)
    indices = jnp.clip(ys, 0, height - 1) * width + jnp.clip(xs, 0, width - 1)
    return indices, weights


def _sampling_taps(
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
    spatial_shapes: tuple[tuple[int, int], ...],
    num_keys: int,
) -> tuple[jax.Array, jax.Array]:
    """(float32 weights, int32 rows of the flattened [B * keys * heads, head_dim] value table)
    of every bilinear neighbour of every sample, each [B, Q, heads, levels * points * 4]."""
    batch, num_queries, num_heads, _, num_points, _ = sampling_locations.shape
    # Coordinates in float32 whatever the compute dtype: a bfloat16 location is off by up to a
    # pixel on a 100-pixel level.
    sampling_locations = sampling_locations.astype(jnp.float32)

    indices, weights, start = [], [], 0
    for level, (height, width) in enumerate(spatial_shapes):
        idx, w = _bilinear_taps(sampling_locations[:, :, :, level], height, width)
        indices.append(idx + start)
        weights.append(w)
        start += height * width
    # [B, Q, heads, levels, points, 4] -> [B, Q, heads, taps]
    taps = len(spatial_shapes) * num_points * 4
    keys = jnp.stack(indices, axis=3).reshape(batch, num_queries, num_heads, taps)
    weights = jnp.stack(weights, axis=3) * attention_weights.astype(jnp.float32)[..., None]
    weights = weights.reshape(batch, num_queries, num_heads, taps)

    # value stays in its [B, keys, heads, head_dim] layout: row (b * keys + k) * heads + h of
    # the flattened table is key k of head h, so no transpose is needed before the gather.
    batch_offset = (jnp.arange(batch, dtype=jnp.int32) * num_keys)[:, None, None, None]
    head_offset = jnp.arange(num_heads, dtype=jnp.int32)[None, None, :, None]
    return weights, (keys + batch_offset) * num_heads + head_offset


def _gather_sum(table: jax.Array, rows: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over taps of weight * table row -> [B, Q, heads * head_dim] in the table's dtype."""
    sampled = table.at[rows].get(mode="promise_in_bounds")
    out = jnp.einsum(
        "bqht,bqhtd->bqhd",
        weights.astype(table.dtype),
        sampled,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(*rows.shape[:2], -1).astype(table.dtype)


# The four bilinear neighbours of every sample are fetched by one gather with indices computed up
# front, not a loop of gathers per level or neighbour; out-of-level neighbours get weight 0 and
# an in-bounds index (grid_sample's zero padding without a dynamic shape), and bilinear and
# attention weights fold into one weight per row, so the reduction is one weighted sum.
def _deformable_sample(
    value: jax.Array,
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
    spatial_shapes: tuple[tuple[int, int], ...],
) -> jax.Array:
    batch, num_keys, num_heads, head_dim = value.shape
    weights, rows = _sampling_taps(sampling_locations, attention_weights, spatial_shapes, num_keys)
    return _gather_sum(value.reshape(batch * num_keys * num_heads, head_dim), rows, weights)


def _query_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, Q, ...] -> [ceil(Q / chunk), B, chunk, ...], zero-padded."""
    batch, num_queries = x.shape[:2]
    count = -(-num_queries // chunk)
    pad = [(0, 0), (0, count * chunk - num_queries)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad).reshape(batch, count, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _from_chunks(x: jax.Array, num_queries: int) -> jax.Array:
    """`_query_chunks`' inverse: [chunks, B, chunk, ...] -> [B, Q, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :num_queries]


# The gathered [B, Q, heads, levels * points * 4, head_dim] rows are a deformable encoder's largest
# activation by far (2.9 GB per layer at 800x1333, batch 2). The chunk loop also keeps XLA's CSE
# from merging the recomputed gather back into the forward pass (measured on CPU: with a single
# chunk the loop is inlined and the rows are kept after all). Forward values are the plain op's,
# bit for bit.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _recomputed_sample(
    value: jax.Array,
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
    spatial_shapes: tuple[tuple[int, int], ...],
    chunk: int,
) -> jax.Array:
    """`_deformable_sample`, `chunk` queries at a time, whose backward pass keeps only the
    inputs and recomputes the gather (Deformable DETR's CUDA kernel does the same): no
    [B, Q, heads, taps, head_dim] buffer outlives a chunk, in either direction."""
    num_queries = sampling_locations.shape[1]

    def forward(chunk_inputs: tuple[jax.Array, jax.Array]) -> jax.Array:
        return _deformable_sample(value, *chunk_inputs, spatial_shapes)

    chunks = [_query_chunks(x, chunk) for x in (sampling_locations, attention_weights)]
    return _from_chunks(jax.lax.map(forward, tuple(chunks)), num_queries)


def _recomputed_sample_fwd(value, sampling_locations, attention_weights, spatial_shapes, chunk):
    out = _recomputed_sample(value, sampling_locations, attention_weights, spatial_shapes, chunk)
    return out, (value, sampling_locations, attention_weights)


def _recomputed_sample_bwd(spatial_shapes, chunk, saved, cotangent):
    value, sampling_locations, attention_weights = saved
    batch, num_keys, num_heads, head_dim = value.shape
    num_queries = sampling_locations.shape[1]
    table = value.reshape(batch * num_keys * num_heads, head_dim)

    def taps(locations: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _sampling_taps(locations, weights, spatial_shapes, num_keys)

    def step(value_grad: jax.Array, chunk_inputs):
        locations, weights, grad_out = chunk_inputs
        tap_weights, pull, rows = jax.vjp(taps, locations, weights, has_aux=True)
        grad_out = grad_out.reshape(*grad_out.shape[:2], num_heads, head_dim).astype(value.dtype)
        # out = sum_t w_t * table[row_t]: d w_t = <grad_out, table[row_t]>, and every row gets
        # w_t * grad_out scattered back.
        sampled = table.at[rows].get(mode="promise_in_bounds")
        tap_grad = jnp.einsum(
            "bqhd,bqhtd->bqht", grad_out, sampled, preferred_element_type=jnp.float32
        )
        updates = tap_weights.astype(value.dtype)[..., None] * grad_out[:, :, :, None, :]
        value_grad = value_grad.at[rows].add(updates.astype(jnp.float32), mode="promise_in_bounds")
        return value_grad, pull(tap_grad)

    chunks = (sampling_locations, attention_weights, cotangent)
    value_grad, (locations_grad, weights_grad) = jax.lax.scan(
        step,
        jnp.zeros(table.shape, jnp.float32),
        tuple(_query_chunks(x, chunk) for x in chunks),
    )
    return (
        value_grad.reshape(value.shape).astype(value.dtype),
        _from_chunks(locations_grad, num_queries).astype(sampling_locations.dtype),
        _from_chunks(weights_grad, num_queries).astype(attention_weights.dtype),
    )


_recomputed_sample.defvjp(_recomputed_sample_fwd, _recomputed_sample_bwd)


def multi_scale_deformable_attention(
    value: jax.Array,
    spatial_shapes: SpatialShapes,
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
    *,
    remat: bool = False,
    query_chunk: int = 2048,
) -> jax.Array:
    """Bilinear multi-scale sampling and weighted sum: what transformers'
    `MultiScaleDeformableAttention` computes with `grid_sample` (and Deformable DETR's CUDA
    kernel). Locations are normalized (x, y) in [0, 1] over each level's padded map, with
    grid_sample's `align_corners=False` convention (pixel centres at (i + 0.5) / size).

    Args:
      value: [B, S, heads, head_dim], the levels' keys flattened row-major and concatenated in
        level order (S = sum of h * w).
      spatial_shapes: ((h, w), ...) per level, static.
      sampling_locations: [B, Q, heads, levels, points, 2], normalized (x, y).
      attention_weights: [B, Q, heads, levels, points] (already normalized).
      remat: recompute the gather in the backward pass instead of storing its output, and
        sample `query_chunk` queries at a time (`_recomputed_sample`).
      query_chunk: queries per chunk with `remat`.

    Returns:
      [B, Q, heads * head_dim] in value's dtype (accumulated in float32).
    """
    _check_shapes(value, spatial_shapes, sampling_locations, attention_weights)
    value, sampling_locations, attention_weights = map(
        jnp.asarray, (value, sampling_locations, attention_weights)
    )
    shapes = tuple((int(h), int(w)) for h, w in spatial_shapes)
    if remat:
        chunk = min(query_chunk, sampling_locations.shape[1])
        return _recomputed_sample(value, sampling_locations, attention_weights, shapes, chunk)
    return _deformable_sample(value, sampling_locations, attention_weights, shapes)


def multi_scale_deformable_attention_reference(
    value: jax.Array,
    spatial_shapes: SpatialShapes,
    sampling_locations: jax.Array,
    attention_weights: jax.Array,
) -> jax.Array:
    """The op through `map_coordinates` (order 1, zero fill), one image at a time. Tests only."""
    _check_shapes(value, spatial_shapes, sampling_locations, attention_weights)
    batch, _, num_heads, head_dim = value.shape
    num_queries = sampling_locations.shape[1]

    def sample_image(image: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        # image [h, w, head_dim]; x, y [Q, points] in pixels -> [Q, points, head_dim]
        def channel(c: jax.Array) -> jax.Array:
            return jax.scipy.ndimage.map_coordinates(c, [y, x], order=1, mode="constant")

        return jax.vmap(channel, in_axes=-1, out_axes=-1)(image)

    out = jnp.zeros((batch, num_queries, num_heads, head_dim), jnp.float32)
    start = 0
    for level, (height, width) in enumerate(spatial_shapes):
        level_value = value[:, start : start + height * width].reshape(
            batch, height, width, num_heads, head_dim
        )
        start += height * width
        loc = sampling_locations[:, :, :, level].astype(jnp.float32)  # [B, Q, heads, points, 2]
        x = loc[..., 0] * width - 0.5
        y = loc[..., 1] * height - 0.5
        # vmap over batch and heads: image [h, w, d], coordinates [Q, points].
        per_head = jax.vmap(sample_image, in_axes=(2, 1, 1), out_axes=1)
        sampled = jax.vmap(per_head)(level_value.astype(jnp.float32), x, y)  # [B, Q, heads, P, d]
        w = attention_weights[:, :, :, level].astype(jnp.float32)  # [B, Q, heads, points]
        out = out + jnp.einsum("bqhpd,bqhp->bqhd", sampled, w)
    return out.reshape(batch, num_queries, num_heads * head_dim).astype(value.dtype)


def _offset_bias_init(
    num_heads: int, num_levels: int, num_points: int
) -> nn.initializers.Initializer:
    """Deformable DETR's start: head h looks along direction 2 pi h / heads, point p at p + 1."""

    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        del key
        thetas = np.arange(num_heads, dtype=np.float32) * (2.0 * math.pi / num_heads)
        grid = np.stack([np.cos(thetas), np.sin(thetas)], -1)
        grid = grid / np.abs(grid).max(-1, keepdims=True)
        grid = np.tile(grid[:, None, None, :], (1, num_levels, num_points, 1))
        grid = grid * np.arange(1, num_points + 1, dtype=np.float32)[None, None, :, None]
        return jnp.asarray(grid.reshape(shape), dtype)

    return init


class MultiScaleDeformableAttention(nn.Module):
    """Deformable attention layer: value projection (padded keys zeroed), sampling offsets and
    attention weights (softmax over levels x points, per head) from the query, locations from
    2-d reference points (offsets in the level's pixels) or 4-d reference boxes (offsets
    relative to the box size), the op, and the output projection. Parameter names and
    initialization follow transformers' `DeformableDetrMultiscaleDeformableAttention`.

    Attributes:
      num_heads, num_levels, num_points: heads, feature levels and sampled points per head and
        level.
      remat: recompute the sampling gather in the backward pass (saves the largest activation).
      dtype: compute dtype; parameters stay float32.
    """

    num_heads: int = 8
    num_levels: int = 4
    num_points: int = 4
    remat: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        reference_points: jax.Array,
        value_input: jax.Array,
        value_mask: jax.Array | None,
        spatial_shapes: SpatialShapes,
    ) -> jax.Array:
        """query [B, Q, D] (position embedding already added); reference_points [B, Q, levels,
        2 or 4] normalized (x, y) or (cx, cy, w, h); value_input [B, S, D]; value_mask [B, S]
        True for real keys (None: all real). Returns [B, Q, D]."""
        batch, num_queries, dim = query.shape
        heads, levels, points = self.num_heads, self.num_levels, self.num_points
        if dim % heads:
            raise ValueError(f"d_model {dim} is not divisible by num_heads {heads}")
        if len(spatial_shapes) != levels:
            raise ValueError(f"{len(spatial_shapes)} spatial shapes for num_levels={levels}")
        if reference_points.shape[-2] != levels or reference_points.shape[-1] not in (2, 4):
            raise ValueError(
                f"reference_points must be [B, Q, {levels}, 2 or 4], got {reference_points.shape}"
            )

        value = nn.Dense(dim, dtype=self.dtype, kernel_init=_xavier, name="value_proj")(value_input)
        if value_mask is not None:
            value = jnp.where(value_mask[..., None], value, 0)
        value = value.reshape(batch, value.shape[1], heads, dim // heads)

        offsets = nn.Dense(
            heads * levels * points * 2,
            kernel_init=nn.initializers.zeros,
            bias_init=_offset_bias_init(heads, levels, points),
            name="sampling_offsets",
        )(query.astype(jnp.float32))
        offsets = offsets.reshape(batch, num_queries, heads, levels, points, 2)
        logits = nn.Dense(
            heads * levels * points,
            kernel_init=nn.initializers.zeros,
            bias_init=nn.initializers.zeros,
            name="attention_weights",
        )(query.astype(jnp.float32))
        weights = jax.nn.softmax(logits.reshape(batch, num_queries, heads, levels * points), -1)
        weights = weights.reshape(batch, num_queries, heads, levels, points)

        reference_points = reference_points.astype(jnp.float32)[:, :, None, :, None, :]
        if reference_points.shape[-1] == 2:
            # Offsets are in pixels of each level: normalize by (width, height).
            normalizer = jnp.asarray([(w, h) for h, w in spatial_shapes], jnp.float32)
            locations = reference_points + offsets / normalizer[None, None, None, :, None, :]
        else:
            # Offsets are relative to the reference box: half its size per unit of points.
            locations = (
                reference_points[..., :2] + offsets / points * reference_points[..., 2:] * 0.5
            )
        out = multi_scale_deformable_attention(
            value, spatial_shapes, locations, weights, remat=self.remat
        )
        return nn.Dense(dim, dtype=self.dtype, kernel_init=_xavier, name="output_proj")(out)
