"""The device mesh and how parameters and batches are laid out on it.

A config declares the mesh once (`config.mesh`) and regex partition rules for the parameters
(`config.partition_rules`, `tree_shardings`). Batches are split along their leading dimension
over every axis of the mesh: every host feeds its own rows (`start_global`) and reads its rows of
the outputs back (`to_host_local`); where every process holds the whole input (mining's
features), `from_host_copy` and `to_host` move it on and off.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ood_jax import multihost

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


def traced_on(mesh: Mesh, fn: Callable) -> Callable:
    """`fn`, traced with `mesh` declared (as an abstract mesh), so that what it calls can split
    work over the mesh's axes (`per_batch_shard`) without being handed the mesh."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    # The compiled program keeps the function's name (jit_train_step in profiles, dumps and the
    # compilation cache); a partial has none of its own.
    inner = fn.func if isinstance(fn, functools.partial) else fn
    traced.__name__ = traced.__qualname__ = getattr(inner, "__name__", traced.__name__)
    return traced


def per_batch_shard(fn: Callable) -> Callable:
    """`fn`, a function of arrays whose leading axis is the batch, run by each device on its own
    rows with no communication, where the trace declares a mesh (`traced_on`) and the batch
    splits evenly over it; as it is otherwise.

    For work whose length depends on the data, such as the matching's while loops: on the
    global batch, a loop runs until every device's slowest example is done, and each iteration's
    exit test is a collective among all devices, a network round trip on several hosts.
    """

    def local(*args):
        mesh = jax.sharding.get_abstract_mesh()
        rows = {x.shape[0] for x in jax.tree.leaves(args)}
        if mesh.empty or len(rows) != 1 or rows.pop() % mesh.size:
            return fn(*args)
        spec = PartitionSpec(mesh.axis_names)
        # Unchecked: fn's loops start from constants, which the check would want marked
        # per-device; every output is per-device rows, which out_specs says.
        return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(*args)

    return local


def path_name(path: Sequence[Any]) -> str:
    """A parameter's name, "a/b/0/kernel", from its pytree key path (dict keys, attribute
    names and sequence indices alike): the name partition rules and optimizer groups match."""

    def part(key) -> str:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    return "/".join(part(k) for k in path)


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
    """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs) by the first matching rule.

    `rules` are [(regex, strategy)], matched in order against each parameter's path "a/b/kernel":
    "replicate" keeps a full copy on every device; "fsdp" splits the largest dimension divisible
    by the 'fsdp' axis size over it (ZeRO-3 style), and parameters with no such dimension stay
    replicated.
    """
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
        name = path_name(path)
        for pattern, strategy in compiled:
            if pattern.fullmatch(name):
                if strategy == "replicate" or not np.shape(leaf):
                    return replicated(mesh)
                return NamedSharding(mesh, _fsdp_spec(np.shape(leaf), mesh.shape["fsdp"]))
        raise ValueError(f"config.partition_rules: no rule matches parameter {name!r}")

    return jax.tree_util.tree_map_with_path(leaf_sharding, tree)


# ------------------------------------------------------------------------------------------------
# Host batches <-> global arrays.
# ------------------------------------------------------------------------------------------------


def to_global_array(
    batch: Mapping[str, np.ndarray], sharding: NamedSharding
) -> dict[str, jax.Array]:
    """Per-host batches -> global arrays whose batch dim is sharded as `sharding` says.

    `sharding` is typically `batch_sharding(mesh)`; every host passes its own local batch and
    gets arrays of the global batch.
    """
    arrays = {name: np.asarray(value) for name, value in batch.items()}
    if not jax.config.jax_enable_x64:
        for name, value in arrays.items():
            if value.dtype in (np.int64, np.uint64):
                raise ValueError(
                    f"field {name!r} is {value.dtype}, which jax without x64 would truncate; "
                    "keep it on the host"
                )
    return {
        name: jax.make_array_from_process_local_data(sharding, value)
        for name, value in arrays.items()
    }


def start_global(
    batches: Iterable[Mapping[str, np.ndarray]],
    sharding: NamedSharding,
    host_keys: Sequence[str] = (),
    n_prefetch: int = 1,
) -> Iterator[tuple[dict[str, jax.Array], dict[str, np.ndarray]]]:
    """Host batches -> (global arrays, host-only fields), `n_prefetch` batches ahead.

    The fields named in `host_keys` stay numpy arrays of this host's rows; every other field
    becomes a global array (`to_global_array`). Transfers are asynchronous, so with
    `n_prefetch` >= 1 the next batch is on its way to the devices while the current step runs.
    The sequence is the host iterator's, unchanged.
    """
    if n_prefetch < 0:
        raise ValueError(f"n_prefetch must be >= 0, got {n_prefetch}")
    host_keys = frozenset(host_keys)

    def split(batch):
        host = {k: np.asarray(v) for k, v in batch.items() if k in host_keys}
        device = to_global_array({k: v for k, v in batch.items() if k not in host_keys}, sharding)
        return device, host

    queue: collections.deque = collections.deque()
    for batch in batches:
        queue.append(split(batch))
        if len(queue) > n_prefetch:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


def process_rows(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """[first, stop): the rows of a global batch this process feeds (`to_global_array`).

    The input pipeline reads one global order and keeps these rows of each global batch, so the
    examples of a step do not depend on how many processes share it. A mesh whose devices put
    a process's rows apart (not one block) is refused.
    """
    indices = sharding.addressable_devices_indices_map((global_batch,)).values()
    rows = sorted(
        {(i[0].start or 0, global_batch if i[0].stop is None else i[0].stop) for i in indices}
    )
    first, stop = rows[0][0], rows[-1][1]
    covered = sum(b - a for a, b in rows)
    if covered != stop - first or (global_batch % (stop - first)):
        raise ValueError(
            f"config.mesh: process {jax.process_index()} holds rows {rows} of the batch, not one "
            "block; order the mesh's devices by process"
        )
    return first, stop


def process_allgather(tree: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's host arrays, concatenated along the first axis in process order.

    64-bit integers (image ids) travel as pairs of 32-bit words: jax without x64 would cut
    them to 32 bits on the way.
    """
    if jax.process_count() == 1:
        return {name: np.asarray(value) for name, value in tree.items()}
    wide = {
        name: np.asarray(value).dtype
        for name, value in tree.items()
        if np.asarray(value).dtype.itemsize == 8 and not jax.config.jax_enable_x64
    }
    sent = {
        name: np.ascontiguousarray(value).view(np.uint32) if name in wide else np.asarray(value)
        for name, value in tree.items()
    }
    gathered = multihost_utils.process_allgather(sent, tiled=True)
    return {
        name: np.asarray(value).view(wide[name]) if name in wide else np.asarray(value)
        for name, value in gathered.items()
    }


def from_host_copy(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array of `array`, which every process holds whole (mining's features, a batch of
    texts): each process transfers only the parts its devices hold."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def tree_from_host_copy(tree: Any, shardings: Any, *, source: str) -> Any:
    """`from_host_copy` of each leaf of `tree`, which every process read from `source` (weights
    in a file), onto the matching leaf of `shardings`, or onto `shardings` itself when it is
    one sharding.

    With several processes they first compare a digest of `tree`: one exchange through the
    coordination service, where `jax.device_put` would all-gather every array from every process
    (and compile a program for each) to check that they agree. The exchange needs a job joined
    by `multihost.initialize` (every `ood-jax` command's); a program that called
    `jax.distributed.initialize` itself places the arrays unchecked.
    """
    if jax.process_count() > 1:
        _check_processes_read_the_same(tree, source)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda leaf: from_host_copy(leaf, shardings), tree)
    return jax.tree.map(from_host_copy, tree, shardings)


def _check_processes_read_the_same(tree: Any, source: str) -> None:
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        leaf = np.ascontiguousarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)} {leaf.dtype} {leaf.shape}".encode())
        digest.update(leaf.reshape(-1).view(np.uint8))
    digests = multihost.every_process(f"weights/{source}", digest.hexdigest())
    differing = [p for p, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise ValueError(
            f"{source}: process {differing[0]} read other weights than process 0; every process "
            "must read the same file (one shared filesystem, or the same copy on every host)"
        )


def to_host(array: jax.Array) -> np.ndarray:
    """All of a global array on every process: gathered from the others where they hold parts."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def to_host_local(array: jax.Array, sharding: NamedSharding) -> np.ndarray:
    """The rows of a global batch-sharded array that this host fed in, e.g. model outputs."""
    local = multihost_utils.global_array_to_host_local_array(array, sharding.mesh, sharding.spec)
    return np.asarray(local)
