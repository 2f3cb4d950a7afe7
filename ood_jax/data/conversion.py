"""What every `ood-jax convert` converter writes: an oodbench source, and where it came from.

A converter (convert_nuscenes, convert_cityscapes) reads a release with its official devkit and
writes, into OUT, the layout `ood_jax.data.oodbench` reads: `ood_jax_convert.json` (the
conversion's identity, versions, tables and counts), `images` (a symbolic link to the release:
no image is copied) and `annotations.json` (COCO instances). Rerunning the same conversion
rewrites OUT; any other is refused.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from ood_jax import files
from ood_jax.data import building

RECORD_FILE = "ood_jax_convert.json"
ANNOTATIONS_FILE = "annotations.json"
IMAGES_LINK = "images"


def claim(out: pathlib.Path, identity: dict[str, Any], release: pathlib.Path) -> None:
    """Refuses an OUT that holds another conversion than `identity`'s (of `release`), or files
    of unknown origin; called before the long read, so a wrong --out fails at once."""
    record_path = out / RECORD_FILE
    if record_path.exists():
        recorded = building.load_json(record_path)
        if not isinstance(recorded, dict):
            raise building.BuildError(f"{record_path}: expected a JSON object")
        for field, value in identity.items():
            if recorded.get(field) != value:
                raise building.BuildError(
                    f"{out}: holds a conversion with {field} {recorded.get(field)!r}, not "
                    f"{value!r}; convert into another --out or delete that one"
                )
    elif (out / ANNOTATIONS_FILE).exists() or os.path.lexists(out / IMAGES_LINK):
        raise building.BuildError(
            f"{out}: holds {ANNOTATIONS_FILE} or {IMAGES_LINK} without {RECORD_FILE}, so not a "
            "converter's output; convert into another --out"
        )
    link = out / IMAGES_LINK
    if os.path.lexists(link) and link.resolve() != release.resolve():
        raise building.BuildError(f"{link}: points to {link.resolve()}, not {release}")


def write(
    out: pathlib.Path,
    release: pathlib.Path,
    record: dict[str, Any],
    coco: dict[str, Any],
) -> None:
    """Writes the record, the images link to `release` (each `file_name` is the release's own
    relative path) and the COCO annotations, into an OUT that `claim` accepted."""
    # In this order, so a killed run leaves a record without annotations.json (which no reader
    # takes for a finished source, and a rerun of the same conversion completes), never
    # annotations that no record describes.
    out.mkdir(parents=True, exist_ok=True)
    files.write_json_atomic(out / RECORD_FILE, record)
    if not os.path.lexists(out / IMAGES_LINK):
        (out / IMAGES_LINK).symlink_to(release, target_is_directory=True)
    files.write_json_atomic(out / ANNOTATIONS_FILE, coco, indent=None)
