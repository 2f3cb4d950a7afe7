"""What every TFDS builder of ours shares: reading source files strictly and reporting.

Bad source data fails the build naming the file, record or field (`BuildError`), unless
`on_error="skip"` lets unreadable images be skipped and counted; boxes are cleaned and counted
the same way everywhere (`clean_boxes`). A build records where it came from (`BuildRecord`),
so a rebuild can tell the same source from another. The builders' mixins are
`ood_jax.data.builders`; Beam builds, `ood_jax.data.beam`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import io
import json
import pathlib
from typing import Any, Callable, Iterable

import numpy as np
from PIL import Image

from ood_jax import __version__, files
from ood_jax import boxes as box_lib

ON_ERROR_CHOICES = ("fail", "skip")
# Written into the versioned dataset directory, next to TFDS's dataset_info.json.
RECORD_FILE = "ood_jax_build.json"


class BuildError(ValueError):
    """Source data that cannot be built; the message names the file, record or field."""


@dataclasses.dataclass
class BuildReport:
    """What a build skipped, dropped or changed, and why."""

    skipped_images: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    dropped_boxes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    clipped_boxes: int = 0
    notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    _skipped_paths: set[str] = dataclasses.field(
        default_factory=set, init=False, repr=False, compare=False
    )

    def skip(self, path: str | pathlib.Path, reason: str) -> None:
        """Counts an image as skipped; one that several records (or splits) use counts once."""
        path = str(path)
        if path not in self._skipped_paths:
            self._skipped_paths.add(path)
            self.skipped_images.append((path, reason))

    def merge(self, other: "BuildReport") -> None:
        """Adds what `other` (a Beam worker's report of later items) counted."""
        for path, reason in other.skipped_images:
            self.skip(path, reason)
        self.dropped_boxes.update(other.dropped_boxes)
        self.clipped_boxes += other.clipped_boxes
        self.notes.update(other.notes)

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

    def is_empty(self) -> bool:
        """Whether nothing was skipped, dropped, clipped or noted."""
        return not (
            self.skipped_images
            or sum(self.dropped_boxes.values())
            or self.clipped_boxes
            or sum(self.notes.values())
        )


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
    except Image.UnidentifiedImageError:
        # PIL's own message names the in-memory buffer, whose address differs between builds.
        raise BuildError(
            f"{path}: corrupt or unreadable image (not a known image format)"
        ) from None
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
        report.skip(path, str(e).split(": ", 1)[-1])
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


# TFDS cannot write an empty split, and a dataset missing one would look finished, so a builder
# fails, naming the file or split, before writing anything where it can (`_split_generators`);
# a split whose every image is skipped can only be found while it is written.
def no_examples(split: str, images: int) -> BuildError:
    """The error of a split whose every image was skipped while it was written."""
    return BuildError(
        f"split {split}: every image was skipped ({images}), so it has no examples; "
        "the build report lists them"
    )


# A builder's work on one item its `_split_generators` planned, the same in a single-process and
# a Beam build: the item's (key, example) pairs, none if it was skipped, with what was skipped or
# dropped counted in the report it is given (a worker's own, in a Beam build).
ExampleFn = Callable[[Any, BuildReport], list[tuple[Any, dict]]]


# ---------------------------------------------------------------------------------------------
# Build records: where a dataset came from.
# ---------------------------------------------------------------------------------------------


def file_digest(path: pathlib.Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (LVIS annotations are about 1 GB)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except FileNotFoundError:
        raise BuildError(f"{path}: file not found") from None
    return digest.hexdigest()


def combined_digest(digests: dict[str, str]) -> str:
    """One SHA-256 over (relative path, file digest) pairs in sorted path order."""
    digest = hashlib.sha256()
    for name in sorted(digests):
        digest.update(f"{name}\0{digests[name]}\n".encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Origin:
    """What a build is made from: a source directory and its files' digests, or settings."""

    source: str | None
    files: dict[str, str]
    settings: dict[str, Any] | None
    digest: str

    @classmethod
    def of_source(cls, src: pathlib.Path, paths: Iterable[pathlib.Path]) -> "Origin":
        files = {path.relative_to(src).as_posix(): file_digest(path) for path in paths}
        return cls(str(src), files, None, combined_digest(files))

    @classmethod
    def of_settings(cls, settings: dict[str, Any]) -> "Origin":
        # A JSON round trip, so tuples compare equal to the lists a stored record holds.
        settings = json.loads(json.dumps(settings, sort_keys=True))
        return cls(None, {}, settings, combined_digest({"settings": json.dumps(settings)}))

    def difference(self, recorded: "BuildRecord") -> str | None:
        """Why `recorded` was not built from this origin, or None if it was."""
        if recorded.source != self.source:
            return f"--source {self.source} is another directory"
        if recorded.settings != self.settings:
            return f"its generator settings {recorded.settings} are now {self.settings}"
        if recorded.digest == self.digest:
            return None
        changed = sorted(set(recorded.files) ^ set(self.files)) + sorted(
            name
            for name in set(recorded.files) & set(self.files)
            if recorded.files[name] != self.files[name]
        )
        return f"its {', '.join(changed)} changed since"


@dataclasses.dataclass(frozen=True)
class BuildRecord:
    """The provenance of one built dataset, stored as RECORD_FILE in its directory: the source
    directory and a SHA-256 of each file the builder reads other than images (each builder's
    `source_files` names them), or the generator settings of a synthetic builder."""

    builder: str
    config: str | None
    version: str
    source: str | None
    files: dict[str, str]
    settings: dict[str, Any] | None
    digest: str
    on_error: str
    ood_jax_version: str
    built_at: str
    examples_per_split: dict[str, int]
    summary: str

    @classmethod
    def create(cls, builder, origin: Origin, on_error: str, summary: str) -> "BuildRecord":
        config = builder.builder_config.name if builder.builder_config else None
        return cls(
            builder=builder.name,
            config=config,
            version=str(builder.version),
            source=origin.source,
            files=origin.files,
            settings=origin.settings,
            digest=origin.digest,
            on_error=on_error,
            ood_jax_version=__version__,
            built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            examples_per_split={k: v.num_examples for k, v in builder.info.splits.items()},
            summary=summary,
        )

    @classmethod
    def read(cls, dataset_dir: pathlib.Path) -> "BuildRecord | None":
        """The record in `dataset_dir`, or None for a dataset built without one."""
        path = pathlib.Path(dataset_dir) / RECORD_FILE
        if not path.exists():
            return None
        data = load_json(path)
        fields = [f.name for f in dataclasses.fields(cls)]
        require(data, fields, str(path))
        return cls(**{name: data[name] for name in fields})

    def write(self, dataset_dir: pathlib.Path) -> pathlib.Path:
        return files.write_json_atomic(
            pathlib.Path(dataset_dir) / RECORD_FILE, dataclasses.asdict(self)
        )

    @property
    def made_from(self) -> str:
        return self.source if self.source is not None else f"generator settings {self.settings}"
