"""RUN_DIR/manifest.json: what a run was made with and what it spent, so a number can be traced.

Every run directory gets one: training and evaluation workdirs, eval-mllm outputs and mining
outputs. `collect` gathers what every run shares, the caller adds what only it knows, and
`write` / `finish` put it in place atomically; a resumed run keeps the old manifest's head under
"previous". Fields: docs/reference/manifest.md.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import socket
import subprocess
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ood_jax import __version__, files

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
RUNNING = "running"
COMPLETE = "complete"
# Distributions every manifest names; runs add their own (`collect(packages=...)`).
BASE_PACKAGES = ("jax", "jaxlib", "flax", "numpy")
# A distribution published under several names: the first one installed is reported.
_ALIASES = {"tensorflow": ("tensorflow", "tensorflow-cpu")}
# What an earlier invocation of a resumed run leaves in "previous".
PREVIOUS_KEYS = (
    "kind",
    "started",
    "ended",
    "status",
    "reason",
    "ood_jax",
    "host",
    "totals",
    "checkpoint",
)
# git on a hung network file system must not hold up a run's start.
GIT_TIMEOUT_S = 10.0
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


class ManifestError(ValueError):
    """A manifest.json that cannot be read; the message names the file."""


# ---------------------------------------------------------------------------------------------
# What every run shares
# ---------------------------------------------------------------------------------------------


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def _git(directory: pathlib.Path, *args: str) -> str | None:
    """git's output in `directory`, or None where git cannot answer."""
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    # No git, or one that hangs: the commit is unknown, which the manifest says (null); a run
    # must not fail for want of it.
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(directory: str | os.PathLike | None = None) -> dict | None:
    """{"commit": HEAD, "dirty": bool} of the git checkout `directory` (default: this package's
    source) is tracked in; None when it is in none, git is missing, or the checkout has no
    commit. "dirty": a tracked file differs from HEAD, or an untracked file lies in `directory`
    (a new module changes what runs; untracked outputs elsewhere in the checkout do not)."""
    directory = pathlib.Path(directory) if directory is not None else _PACKAGE_DIR
    # A wheel installed into a virtual environment inside some checkout is not that checkout's
    # source: the directory itself must be tracked there.
    if not (_git(directory, "ls-files", "--", ".") or "").strip():
        return None
    commit = (_git(directory, "rev-parse", "HEAD") or "").strip()
    prefix = _git(directory, "rev-parse", "--show-prefix")
    status = _git(directory, "status", "--porcelain")
    if not commit or prefix is None or status is None:
        return None
    prefix = prefix.strip()
    dirty = any(
        not line.startswith("??") or line[3:].startswith(prefix) for line in status.splitlines()
    )
    return {"commit": commit, "dirty": dirty}


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """name -> installed version (None: not installed), read from package metadata: nothing is
    imported."""
    versions = {}
    for name in dict.fromkeys(names):
        versions[name] = None
        for distribution in _ALIASES.get(name, (name,)):
            try:
                versions[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def host() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def jax_devices() -> dict:
    """The devices jax computes on; starts jax's backend if the run has not yet."""
    # Imported here: importing this module starts no jax backend, so runs that do not compute
    # with jax never start one (an HTTP evaluation would take the GPU from the server it talks to).
    import jax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "kinds": dict(collections.Counter(d.device_kind for d in devices)),
        "count": len(devices),
        "local_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "process_index": jax.process_index(),
    }


def collect(
    kind: str, *, devices: bool = False, packages: Sequence[str] = (), **fields: Any
) -> dict:
    """The manifest of a `kind` run starting now, with `fields` added (JSON-serializable).

    `devices`: list jax's devices (only for runs that compute with jax); `packages`: versions to
    report beside BASE_PACKAGES ("transformers", "torch", ...)."""
    return {
        "format": FORMAT_VERSION,
        "kind": kind,
        "status": RUNNING,
        # Tells this invocation's manifest from an earlier one's in the same directory.
        "invocation": uuid.uuid4().hex,
        "started": now(),
        "ended": None,
        "duration_s": None,
        "ood_jax": {"version": __version__, "path": str(_PACKAGE_DIR), "git": git_state()},
        "host": host(),
        "devices": jax_devices() if devices else None,
        "packages": package_versions((*BASE_PACKAGES, *packages)),
        **fields,
    }


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def read(path: str | os.PathLike) -> dict | None:
    """The manifest at `path`, or None where there is none."""
    path = pathlib.Path(path)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(
            f"{path}: not the JSON manifest ood-jax writes ({e}); move it aside to continue"
        ) from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path}: not a JSON object; move it aside to continue")
    return manifest


def _carry_previous(earlier: dict | None, manifest: dict) -> None:
    """Keeps the heads of the invocations before this one, the file's own among them."""
    if earlier is None or earlier.get("invocation") == manifest["invocation"]:
        return
    head = {k: earlier[k] for k in PREVIOUS_KEYS if k in earlier}
    manifest["previous"] = [*earlier.get("previous", []), head]


def write(directory: str | os.PathLike, manifest: dict, name: str = MANIFEST_FILE) -> pathlib.Path:
    """Writes `manifest` to DIRECTORY/NAME atomically; the first write of an invocation over an
    earlier invocation's manifest adds that one's head to `manifest["previous"]`."""
    path = pathlib.Path(directory) / name
    _carry_previous(read(path), manifest)
    return files.write_atomic(path, dumps(manifest))


def finish(
    directory: str | os.PathLike,
    manifest: dict,
    status: str,
    name: str = MANIFEST_FILE,
    **fields: Any,
) -> dict:
    """`manifest` ended now with `status` and `fields` added, written; returns it."""
    ended = now()
    started = datetime.datetime.fromisoformat(manifest["started"])
    manifest.update(
        fields,
        status=status,
        ended=ended,
        duration_s=round((datetime.datetime.fromisoformat(ended) - started).total_seconds(), 3),
    )
    write(directory, manifest, name)
    return manifest


def ending(error: BaseException) -> dict:
    """The status (and its reason) of a run that `error` ended."""
    if isinstance(error, KeyboardInterrupt):
        # The runs' own Ctrl-C messages say what was kept.
        return {"status": "interrupted", "reason": str(error) or "Ctrl-C"}
    if isinstance(error, SystemExit):
        # The commands' one error line, "error: ...".
        return {"status": "failed", "reason": str(error.code)}
    return {"status": "failed", "reason": f"{type(error).__name__}: {error}"}


@contextlib.contextmanager
def recording(
    directory: str | os.PathLike,
    manifest: dict,
    name: str = MANIFEST_FILE,
    enabled: bool = True,
) -> Iterator[dict]:
    """Writes `manifest` now and again when the block ends: "complete" with what the block
    added to it, or the status of the exception that ended it (which is re-raised).
    `enabled` False writes nothing (processes other than the first of a multi-host run)."""
    if not enabled:
        yield manifest
        return
    write(directory, manifest, name)
    try:
        yield manifest
    except BaseException as error:
        try:
            finish(directory, manifest, name=name, **ending(error))
        except (OSError, ManifestError) as failure:
            # The run's own error is the one to show; this one goes with it.
            error.add_note(f"{pathlib.Path(directory) / name} was not updated: {failure}")
        raise
    finish(directory, manifest, COMPLETE, name=name)


# ---------------------------------------------------------------------------------------------
# Digests
# ---------------------------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_digest(root: str | os.PathLike, paths: Iterable[str | os.PathLike]) -> dict:
    """{"sha256", "files", "bytes"} of `paths` under `root`: one SHA-256 over each file's path
    relative to root and its content's SHA-256, in sorted order, so a renamed, changed, added
    or missing file changes it."""
    root = pathlib.Path(root)
    lines, size = [], 0
    for path in sorted(pathlib.Path(p) for p in paths):
        full = path if path.is_absolute() else root / path
        lines.append(f"{full.relative_to(root).as_posix()}\t{file_sha256(full)}\n")
        size += full.stat().st_size
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()
    return {"sha256": digest, "files": len(lines), "bytes": size}


def tree_digest(directory: str | os.PathLike) -> dict:
    """`files_digest` of every file under `directory` (a checkpoint step, a model directory)."""
    directory = pathlib.Path(directory).absolute()
    return files_digest(directory, (p for p in directory.rglob("*") if p.is_file()))


# Model weights as transformers, safetensors, torch, flax and jax checkpoints name them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".npz", ".h5")


def weights_digest(path: str | os.PathLike) -> dict | None:
    """`files_digest` of a model's weights: the file `path`, or the weight files
    (WEIGHT_SUFFIXES, and their *.index.json) in the directory `path`; None where `path` is
    neither. Reads every byte of them: about a second per GB, once per run."""
    # Absolute, so the files listed below are not taken as relative to `path` a second time.
    path = pathlib.Path(path).absolute()
    if path.is_file():
        return files_digest(path.parent, [path])
    if not path.is_dir():
        return None
    weights = [
        p
        for p in path.iterdir()
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json"))
    ]
    return files_digest(path, weights)


def tfds_digest(directory: Any) -> dict:
    """A built TFDS dataset's directory (DATA_DIR/NAME/CONFIG/VERSION, a pathlib or etils
    path, local or gs://): one SHA-256 over the content of its metadata files (*.json:
    dataset_info.json with every shard's length, features.json, ood-jax's build record with the
    source files' digests) and the names and sizes of its data files. Data files are not read:
    a dataset is tens of GB, read anew at every start of a run."""
    from etils import epath

    directory = epath.Path(directory)
    lines, size = [], 0
    for path in sorted(directory.iterdir(), key=lambda p: p.name):
        if path.is_dir():
            continue
        length = path.stat().length
        size += length
        if path.suffix == ".json":
            lines.append(f"{path.name}\tsha256:{hashlib.sha256(path.read_bytes()).hexdigest()}\n")
        else:
            lines.append(f"{path.name}\tbytes:{length}\n")
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()
    return {"sha256": digest, "files": len(lines), "bytes": size}


def tfds_dataset(builder: Any) -> dict:
    """A built TFDS dataset as a manifest names it: name, config, version, its directory
    (DATA_DIR/NAME/CONFIG/VERSION) and that directory's `tfds_digest` (`builder`: a tfds
    DatasetBuilder)."""
    return {
        "name": builder.name,
        "config": builder.builder_config.name if builder.builder_config else None,
        "version": str(builder.version),
        "path": str(builder.data_dir),
        "digest": tfds_digest(builder.data_path),
    }


def items_digest(pairs: Iterable[tuple[Any, Any]]) -> str:
    """One SHA-256 over (key, value) pairs, in key order: for eval-mllm's (id, digest) pairs,
    equal for two runs exactly when they hold the same ids, each with the same digest (what
    `ood-jax compare` checks item by item); for mining, the records it read."""
    lines = "".join(f"{k}\t{v}\n" for k, v in sorted(pairs))
    return hashlib.sha256(lines.encode()).hexdigest()


def _json_default(value: Any) -> Any:
    """Paths as strings; anything else JSON lacks is the caller's bug."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} in a manifest is not JSON-serializable")


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, ensure_ascii=False, default=_json_default) + "\n"
