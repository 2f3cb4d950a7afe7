"""Writing files so that a reader sees the old file or the whole new one, never half of one."""

from __future__ import annotations

import json
import os
import pathlib
import uuid
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
