"""A resumable on-disk cache of embeddings keyed by example id.

`EmbeddingCache.compute` returns the embeddings of a list of ids, fetching and encoding only the
ones no shard holds yet, `shard_size` at a time, each group written as a shard before the next
is started: a run killed part way loses at most the shard in progress, and its rerun returns
what an uninterrupted run would. manifest.json records the scorer's identity, so embeddings of
two models never mix. Usage: docs/guide/scorer-models.md.
"""

import hashlib
import io
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ood_jax import files, multihost

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 1 recorded a width "dim"; 2 records the per-id shape, and reads 1
SHARD_PATTERN = re.compile(r"shard-(\d{6})\.npz")


def _canonical(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity as it reads back from JSON (tuples become lists, keys sorted)."""
    return json.loads(json.dumps(dict(identity), sort_keys=True))


class EmbeddingCache:
    """Embeddings of examples, by id, in shards under `directory`.

    Each id's embedding has one fixed shape per cache: [D] for a pooled embedding, or [Q, D]
    for a scorer with several per image (BLIP-2's query tokens). A shard is an npz of "ids" and
    float32 "embeddings". One writer at a time: with several processes every one computes and
    the first writes, so the directory must be one they all see.

    Args:
      directory: created if missing.
      shard_size: ids fetched, encoded and written together.
      identity: JSON-serializable description of what produced the embeddings (e.g.
        `Scorer.identity`, plus anything else that changes them, such as text templates).

    Raises:
      ValueError: the directory holds a cache of another identity, or an unreadable manifest.
    """

    def __init__(self, directory: str | Path, shard_size: int = 1024, *, identity: Mapping):
        if shard_size < 1:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.directory = Path(directory)
        self.shard_size = int(shard_size)
        self.identity = _canonical(identity)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest = self._open_manifest()

    # ------------------------------------------------------------------ manifest

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        if multihost.is_primary():
            text = json.dumps(manifest, indent=2, sort_keys=True).encode()
            files.write_atomic(self.manifest_path, text)

    def _open_manifest(self) -> dict[str, Any]:
        path = self.manifest_path
        if not path.exists():
            if self.shard_paths():
                raise ValueError(f"{self.directory}: shards without a {MANIFEST}; not a cache")
            manifest = {"format_version": FORMAT_VERSION, "identity": self.identity, "shape": None}
            self._write_manifest(manifest)
            return manifest
        try:
            manifest = json.loads(path.read_text())
            version, identity = manifest["format_version"], manifest["identity"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not an embedding cache manifest ({e!r})") from None
        if version not in (1, FORMAT_VERSION):
            raise ValueError(
                f"{path}: format_version {version!r}; this reads 1 and {FORMAT_VERSION}"
            )
        if identity != self.identity:
            raise ValueError(
                f"{path}: this cache holds embeddings of another scorer:\n"
                f"  cached:    {json.dumps(identity, sort_keys=True)}\n"
                f"  requested: {json.dumps(self.identity, sort_keys=True)}\n"
                "use another directory (or delete this one to recompute)"
            )
        if version == 1:
            dim = manifest.pop("dim", None)
            manifest = {**manifest, "format_version": FORMAT_VERSION}
            manifest["shape"] = None if dim is None else [dim]
        return manifest

    # ------------------------------------------------------------------ shards

    def shard_paths(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if SHARD_PATTERN.fullmatch(p.name))

    def _read_ids(self, path: Path) -> np.ndarray:
        try:
            with np.load(path, allow_pickle=False) as shard:
                return shard["ids"]
        except Exception as e:
            raise ValueError(f"{path}: unreadable cache shard ({e!r})") from e

    def _read_embeddings(self, path: Path) -> np.ndarray:
        try:
            with np.load(path, allow_pickle=False) as shard:
                return shard["embeddings"]
        except Exception as e:
            raise ValueError(f"{path}: unreadable cache shard ({e!r})") from e

    def _write_shard(self, ids: Sequence[str], embeddings: np.ndarray) -> None:
        if not multihost.is_primary():
            return
        numbers = [int(SHARD_PATTERN.fullmatch(p.name).group(1)) for p in self.shard_paths()]
        path = self.directory / f"shard-{max(numbers, default=-1) + 1:06d}.npz"
        ids_array = np.asarray(list(ids), dtype=str)
        # Written beside its final name and renamed: a shard is whole or absent.
        buffer = io.BytesIO()
        np.savez(buffer, ids=ids_array, embeddings=embeddings)
        files.write_atomic(path, buffer.getvalue())

    def index(self) -> dict[str, tuple[Path, int]]:
        """id -> (shard, row) of everything cached."""
        out: dict[str, tuple[Path, int]] = {}
        for path in self.shard_paths():
            for row, key in enumerate(self._read_ids(path).tolist()):
                out.setdefault(key, (path, row))
        return out

    # ------------------------------------------------------------------ compute

    def compute(
        self,
        ids: Iterable[Any],
        fetch_fn: Callable[[list[str]], Any],
        encode_fn: Callable[[Any], np.ndarray],
    ) -> np.ndarray:
        """float32 [len(ids), *shape] embeddings of `ids`, in order, computing only the missing ones.

        Args:
          ids: example ids (compared as strings; repeats are computed once).
          fetch_fn: a list of missing ids, as given -> what `encode_fn` takes (e.g. images).
          encode_fn: fetched examples -> [n, ...] embeddings, one per id, of one shape.
        """
        ids = list(ids)
        keys = [str(i) for i in ids]
        index = self.index()
        missing = {}  # key -> the id as given, first occurrence, in order
        for key, id_ in zip(keys, ids):
            if key not in index:
                missing.setdefault(key, id_)
        missing_keys = list(missing)
        self._check_processes_agree(missing_keys)
        computed: list[np.ndarray] = []  # read back from memory, not from the shards written
        for start in range(0, len(missing_keys), self.shard_size):
            chunk = missing_keys[start : start + self.shard_size]
            fetched = fetch_fn([missing[key] for key in chunk])
            embeddings = self._checked(np.asarray(encode_fn(fetched)), len(chunk))
            self._write_shard(chunk, embeddings)
            index.update({key: (len(computed), row) for row, key in enumerate(chunk)})
            computed.append(embeddings)
        return self._gather(keys, index, computed)

    def _check_processes_agree(self, missing_keys: Sequence[str]) -> None:
        """Every process must encode the same batches (they are split over all devices)."""
        digest = hashlib.sha256("\n".join(missing_keys).encode()).hexdigest()
        digests = multihost.every_process(f"cache/{self.directory}", digest)
        differing = [p for p, d in enumerate(digests) if d != digests[0]]
        if differing:
            raise ValueError(
                f"{self.directory}: process {differing[0]} finds other embeddings cached than "
                "process 0; with several processes the cache must be one directory they all "
                "see (a shared filesystem)"
            )

    def _checked(self, embeddings: np.ndarray, rows: int) -> np.ndarray:
        shape = self.manifest["shape"]
        if embeddings.ndim < 2 or embeddings.shape[0] != rows:
            raise ValueError(
                f"encode_fn returned shape {embeddings.shape} for {rows} ids; expected [{rows}, D]"
            )
        if shape is None:
            self.manifest = {**self.manifest, "shape": list(embeddings.shape[1:])}
            self._write_manifest(self.manifest)
        elif list(embeddings.shape[1:]) != shape:
            raise ValueError(
                f"encode_fn returned embeddings of shape {list(embeddings.shape[1:])}; "
                f"{self.manifest_path} says {shape}"
            )
        return embeddings.astype(np.float32, copy=False)

    def _gather(
        self,
        keys: Sequence[str],
        index: Mapping[str, tuple[Path | int, int]],
        computed: Sequence[np.ndarray],
    ) -> np.ndarray:
        """The embeddings of `keys`, each from a shard (a path) or from `computed` (a number)."""
        shape = self.manifest["shape"] or [0]
        out = np.zeros((len(keys), *shape), np.float32)
        by_source: dict[Path | int, list[tuple[int, int]]] = {}
        for i, key in enumerate(keys):
            source, row = index[key]
            by_source.setdefault(source, []).append((i, row))
        for source, pairs in by_source.items():
            if isinstance(source, int):
                embeddings = computed[source]
            else:
                embeddings = self._read_embeddings(source)
            if list(embeddings.shape[1:]) != shape:
                raise ValueError(
                    f"{source}: embeddings of shape {embeddings.shape}, expected [n, "
                    f"{', '.join(map(str, shape))}]"
                )
            targets, rows = map(list, zip(*pairs))
            out[targets] = embeddings[rows]
        return out
