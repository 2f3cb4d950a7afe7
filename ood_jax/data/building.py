"""What every TFDS builder of ours shares: reading source files strictly and reporting.

A builder reads a dataset's own release layout. Bad source data fails the build with the file,
record or field named (`BuildError`), except where the user chose `on_error="skip"` for
unreadable images, which are then counted. Boxes are cleaned the same way everywhere: boxes of
non-positive size are dropped, boxes past the image edge clipped, and both counted.

TFDS writes a dataset into a temporary `.incomplete` directory and renames it only when every
split is written, so a failed build never leaves something a reader could take for a dataset.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pathlib
from typing import Any, Iterable

import numpy as np
from PIL import Image

from ood_jax import boxes as box_lib

ON_ERROR_CHOICES = ("fail", "skip")


class BuildError(ValueError):
    """Source data that cannot be built; the message names the file, record or field."""


@dataclasses.dataclass
class BuildReport:
    """What a build skipped, dropped or changed, and why."""

    skipped_images: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    dropped_boxes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    clipped_boxes: int = 0
    notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def summary(self, examples_per_split: dict[str, int] | None = None) -> str:
        lines = []
        if examples_per_split is not None:
            total = sum(examples_per_split.values())
            lines.append(f"examples written: {total} in {len(examples_per_split)} splits")
            lines += [f"  {name}: {n}" for name, n in sorted(examples_per_split.items())]
        lines.append(f"images skipped: {len(self.skipped_images)}")
        lines += [f"  {path}: {reason}" for path, reason in self.skipped_images[:20]]
        if len(self.skipped_images) > 20:
            lines.append(f"  ... and {len(self.skipped_images) - 20} more")
        lines.append(f"boxes dropped: {sum(self.dropped_boxes.values())}")
        lines += [f"  {reason}: {n}" for reason, n in sorted(self.dropped_boxes.items())]
        lines.append(f"boxes clipped to the image: {self.clipped_boxes}")
        lines += [f"{note}: {n}" for note, n in sorted(self.notes.items())]
        return "\n".join(lines)


def check_on_error(on_error: str) -> str:
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
    return on_error


def read_text(path: str | pathlib.Path) -> str:
    """A source text file, which must exist and be UTF-8; errors name the file."""
    path = pathlib.Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BuildError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise BuildError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None


def load_json(path: str | pathlib.Path) -> Any:
    path = pathlib.Path(path)
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BuildError(
            f"{path}: malformed JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


def require(record: dict, fields: Iterable[str], where: str) -> None:
    """Fails naming the record and the first missing field."""
    if not isinstance(record, dict):
        raise BuildError(f"{where}: expected an object, got {type(record).__name__}")
    for field in fields:
        if field not in record:
            raise BuildError(f"{where}: missing field '{field}'")


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    jpeg: bytes
    height: int
    width: int


def read_image(path: str | pathlib.Path) -> EncodedImage:
    """Reads and fully decodes an image (so corruption is found now, not at training time).

    JPEG files are kept byte for byte; other formats are re-encoded as JPEG (quality 95).
    """
    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BuildError(f"{path}: image file not found") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            width, height = image.size
            if image.format != "JPEG" or image.mode not in ("RGB", "L"):
                buffer = io.BytesIO()
                image.convert("RGB").save(buffer, format="JPEG", quality=95)
                data = buffer.getvalue()
    except (OSError, SyntaxError, ValueError) as e:
        raise BuildError(f"{path}: corrupt or unreadable image ({e})") from None
    return EncodedImage(jpeg=data, height=height, width=width)


def read_image_or_skip(
    path: str | pathlib.Path, on_error: str, report: BuildReport
) -> EncodedImage | None:
    """`read_image`, or None (counted in the report) when on_error is "skip"."""
    try:
        return read_image(path)
    except BuildError as e:
        if on_error == "fail":
            raise
        report.skipped_images.append((str(path), str(e).split(": ", 1)[-1]))
        return None


def clean_boxes(
    xywh: np.ndarray, height: int, width: int, report: BuildReport
) -> tuple[np.ndarray, np.ndarray]:
    """Absolute COCO [x, y, w, h] -> normalized [ymin, xmin, ymax, xmax] (TFDS BBoxFeature).

    Returns (boxes [n_kept, 4] float32, kept [n] bool): boxes with non-positive width or height,
    or lying wholly outside the image, are dropped; boxes reaching past the edge are clipped.
    """
    xywh = np.asarray(xywh, np.float64).reshape(-1, 4)
    finite = np.isfinite(xywh).all(1)
    positive = finite & (xywh[:, 2] > 0) & (xywh[:, 3] > 0)
    xyxy = box_lib.xywh_to_xyxy(np.where(finite[:, None], xywh, 0.0))
    clipped = box_lib.clip_xyxy(xyxy, max_x=float(width), max_y=float(height))
    inside = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
    kept = positive & inside
    report.dropped_boxes["non-finite coordinates"] += int((~finite).sum())
    report.dropped_boxes["non-positive width or height"] += int((finite & ~positive).sum())
    report.dropped_boxes["outside the image"] += int((positive & ~inside).sum())
    report.clipped_boxes += int((kept & (clipped != xyxy).any(1)).sum())
    normalized = box_lib.unscale(clipped[kept], float(height), float(width))
    return box_lib.xyxy_to_yxyx(normalized).astype(np.float32).reshape(-1, 4), kept


class SourceBuilder:
    """Mixed into a `tfds.core.GeneratorBasedBuilder` that reads a release from `--source`.

    Adds the `on_error` choice and a `BuildReport`; the source directory arrives as TFDS's
    manual directory. (A mixin, not a builder subclass, so TFDS registers no extra dataset.)
    """

    MANUAL_DOWNLOAD_INSTRUCTIONS = "Pass the directory holding the release with --source."

    def __init__(self, *, on_error: str = "fail", **kwargs):
        self.on_error = check_on_error(on_error)
        self.report = BuildReport()
        super().__init__(**kwargs)

    def source_dir(self, dl_manager) -> pathlib.Path:
        manual = getattr(dl_manager, "_manual_dir", None)
        if manual is None or not pathlib.Path(manual).is_dir():
            raise BuildError(
                f"{self.name}: source directory {manual} does not exist (pass --source)"
            )
        return pathlib.Path(manual)
