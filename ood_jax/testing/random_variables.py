"""Every variable of a Flax module drawn at a sensible scale, for parity tests and benches.

Drawing every leaf (biases, norms, BatchNorm statistics and embeddings too) keeps a mis-mapped
tensor from hiding behind an initializer's constant; shapes are traced, `init` never compiles.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def random_variables(module: Any, *args: Any, seed: int = 0) -> dict[str, Any]:
    """Variables of `module.init(key, *args)`'s shapes: kernels and embeddings ~ N(0, 1/fan_in),
    BatchNorm variances ~ U(0.5, 1.5), scales ~ 1 + N(0, 0.01), the rest ~ N(0, 0.01); float32
    numpy arrays."""
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        name, shape = path[-1].key, leaf.shape
        if name == "var":
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        if name in ("kernel", "embedding"):
            fan_in = np.prod(shape[:-1]) if name == "kernel" else shape[-1]
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        return ((name == "scale") + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    abstract = jax.eval_shape(module.init, jax.random.key(0), *args)
    return jax.tree_util.tree_map_with_path(draw, abstract)
