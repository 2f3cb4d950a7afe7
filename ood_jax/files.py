"""Writing files (and directories) so that a reader sees the old one or the whole new one, never
half of one."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import uuid
from collections.abc import Iterator, Sequence
from typing import Any


def write_atomic(path: str | os.PathLike, data: bytes | str) -> pathlib.Path:
    """Writes `data` beside `path` under a unique name, syncs it and renames it into place.

    A failure (or a kill) at any point leaves the previous file, if any, and no partial one.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    # os.open rather than tempfile: the file gets the permissions the umask gives, not 0600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> pathlib.Path:
    return write_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, records: Any) -> pathlib.Path:
    """One JSON object per line."""
    return write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def export_directory(out_dir: str | os.PathLike, kind: str, markers: Sequence[str]) -> pathlib.Path:
    """`out_dir` as an absolute path, refused (FileExistsError naming it) when it exists and is
    not a previous `kind` export, i.e. lacks one of the `markers` files: replacing it would
    delete what someone else put there."""
    out_dir = pathlib.Path(out_dir).absolute()
    if out_dir.exists() and not all((out_dir / name).is_file() for name in markers):
        raise FileExistsError(
            f"--out {out_dir}: exists and is no {kind} (no {' and '.join(markers)}); name a new "
            "directory"
        )
    return out_dir


@contextlib.contextmanager
def replaced_directory(out_dir: str | os.PathLike) -> Iterator[pathlib.Path]:
    """A staging directory beside `out_dir` to write into; when the block ends without an error
    it takes `out_dir`'s place (the previous one, if any, removed), otherwise it is removed."""
    out_dir = pathlib.Path(out_dir).absolute()
    staging = out_dir.with_name(f"{out_dir.name}.incomplete-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        yield staging
        if out_dir.exists():
            old = out_dir.with_name(f"{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            out_dir.rename(old)
            staging.rename(out_dir)
            shutil.rmtree(old)
        else:
            staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
