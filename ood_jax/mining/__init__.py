"""Mining the benchmarks' hard parts from scorer features: FOCI options (`foci`), OODBench splits
(`oodbench`), OODG items (`oodg`), a scorer's FOCI accuracy (`zero_shot`); `jobs` runs each as
`ood-jax mine` does, with its manifest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ood_jax import sharding

DEFAULT_CHUNK_SIZE = 4096


def check_features(
    name: str, features: np.ndarray, dim: int | None = None, per_row: bool = False
) -> np.ndarray:
    """A float32 [N, D] copy of `features` (or [N, Q, D] with `per_row`: several embeddings per
    row, as BLIP-2's query tokens); ValueError naming `name` for a bad shape or value."""
    array = np.asarray(features)
    if array.ndim != 2 and not (per_row and array.ndim == 3):
        raise ValueError(f"{name} must be [N, D]{' or [N, Q, D]' * per_row}, got {array.shape}")
    if dim is not None and array.shape[-1] != dim:
        raise ValueError(f"{name} has dimension {array.shape[-1]}, expected {dim}")
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name} must hold floats, got {array.dtype}")
    if not np.isfinite(array).all():
        row = int(np.argwhere(~np.isfinite(array))[0, 0])
        raise ValueError(f"{name} row {row} is not finite")
    return array.astype(np.float32)


def check_indices(name: str, indices: np.ndarray, size: int, num_rows: int) -> np.ndarray:
    """An int32 [N] copy of `indices`, each in [0, size); ValueError naming `name` otherwise."""
    array = np.asarray(indices)
    if array.shape != (num_rows,):
        raise ValueError(f"{name} must have shape ({num_rows},), got {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {array.dtype}")
    bad = (array < 0) | (array >= size)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"{name}[{row}] = {array[row]} is outside [0, {size})")
    return array.astype(np.int32)


def map_rows_in_chunks(
    fn: Callable[..., jax.Array | tuple[jax.Array, ...]],
    rows: Sequence[np.ndarray],
    shared: Sequence[np.ndarray] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    mesh: jax.sharding.Mesh | None = None,
) -> list[np.ndarray]:
    """`fn(*row_chunks, *shared)` over fixed-size chunks of `rows`; outputs concatenated as numpy.

    `fn` must be jitted and map rows independently (output row i depends on input row i only),
    so the padding rows of the last chunk can be computed and dropped. Every chunk has the same
    shape, so `fn` compiles once, and no [N, C] similarity matrix is ever held whole. With a
    mesh, a chunk's rows are split over all its devices (`chunk_size` rounded up to a multiple
    of their number) and `shared` is replicated; the mesh may span processes, each of which
    passes the same arrays and gets every output row.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_rows = len(rows[0])
    if any(len(r) != num_rows for r in rows):
        raise ValueError(f"row arrays differ in length: {[len(r) for r in rows]}")
    if mesh is None:
        put_rows = put_shared = jax.device_put
    else:
        chunk_size = -(-chunk_size // mesh.size) * mesh.size
        row_sharding, shared_sharding = sharding.batch_sharding(mesh), sharding.replicated(mesh)
        put_rows = functools.partial(sharding.from_host_copy, sharding=row_sharding)
        put_shared = functools.partial(sharding.from_host_copy, sharding=shared_sharding)
    # Shared operands (text features) go to the devices once, not once per chunk.
    shared = [put_shared(s) for s in shared]
    outputs: list[list[np.ndarray]] = []
    for start in range(0, max(num_rows, 1), chunk_size):
        stop = min(start + chunk_size, num_rows)
        result = fn(*[put_rows(_pad_rows(r[start:stop], chunk_size)) for r in rows], *shared)
        result = result if isinstance(result, tuple) else (result,)
        if not outputs:
            outputs = [[] for _ in result]
        for collected, value in zip(outputs, result):
            collected.append(sharding.to_host(value)[: stop - start])
    return [np.concatenate(parts) for parts in outputs]


def _pad_rows(array: np.ndarray, size: int) -> np.ndarray:
    # Zero rows: finite, so the padded rows cannot raise or poison a reduction, and are dropped.
    pad = size - len(array)
    if pad == 0:
        return array
    return np.concatenate([array, np.zeros((pad, *array.shape[1:]), array.dtype)])
