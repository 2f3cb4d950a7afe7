"""The device mesh and how parameters and batches are laid out on it.

A config declares the mesh once (`config.mesh`, axis name -> size, -1 for "the rest") and a list
of regex partition rules (`config.partition_rules`, [(regex, strategy)]), matched in order
against each parameter's path "a/b/kernel". Strategies:
  * "replicate": a full copy on every device;
  * "fsdp": the largest dimension divisible by the 'fsdp' axis size is split over it (ZeRO-3
    style); parameters with no such dimension stay replicated.
Batches are split along their leading dimension over every axis of the mesh, so 'fsdp' devices
also share the data-parallel work.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STRATEGIES = ("replicate", "fsdp")


def make_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the named axes; one size may be -1 to take the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    if sizes.count(-1) > 1:
        raise ValueError(f"config.mesh: at most one axis may be -1, got {list(axes)}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"config.mesh: {len(devices)} devices do not divide by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"config.mesh: axes {dict(zip(names, sizes))} need {int(np.prod(sizes))} devices, "
            f"have {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), tuple(names))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over all mesh axes."""
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _fsdp_spec(shape: Sequence[int], axis_size: int) -> PartitionSpec:
    candidates = [
        (dim, i) for i, dim in enumerate(shape) if dim % axis_size == 0 and dim >= axis_size
    ]
    if axis_size == 1 or not candidates:
        return PartitionSpec()
    _, axis = max(candidates)
    spec = [None] * len(shape)
    spec[axis] = "fsdp"
    return PartitionSpec(*spec)


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, str]]) -> Any:
    """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs) by the first matching rule."""
    compiled = []
    for pattern, strategy in rules:
        if strategy not in STRATEGIES:
            raise ValueError(
                f"config.partition_rules: unknown strategy {strategy!r} for {pattern!r}"
            )
        if strategy == "fsdp" and "fsdp" not in mesh.axis_names:
            raise ValueError(
                f"config.partition_rules: {pattern!r} asks for fsdp but the mesh has no 'fsdp' axis"
            )
        compiled.append((re.compile(pattern), strategy))

    def leaf_sharding(path, leaf):
        name = _path_name(path)
        for pattern, strategy in compiled:
            if pattern.fullmatch(name):
                if strategy == "replicate" or not np.shape(leaf):
                    return replicated(mesh)
                return NamedSharding(mesh, _fsdp_spec(np.shape(leaf), mesh.shape["fsdp"]))
        raise ValueError(f"config.partition_rules: no rule matches parameter {name!r}")

    return jax.tree_util.tree_map_with_path(leaf_sharding, tree)
