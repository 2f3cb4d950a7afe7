"""What every task of `ood-jax eval-mllm` shares: the item, the Benchmark interface (what
eval/runner.py and eval/clip_baseline.py drive; the tasks in tasks/foci.py, tasks/oodbench.py and
tasks/counts_oodg.py implement it), reading built TFDS datasets, and the summaries and tables the
results are made of.

Every reply that cannot be read, and every request that failed, counts as a wrong answer; how
many there were is reported next to each number.
"""

from __future__ import annotations

import abc
import collections
import hashlib
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

from ood_jax import prompts
from ood_jax.eval.clients import ImageInput, Request


class ItemsError(ValueError):
    """Benchmark data that cannot be evaluated; the message names the file, record and field."""


class Item:
    """One question: its id, what is sent, and what scoring needs (`meta`, JSON-serializable)."""

    __slots__ = ("id", "request", "meta", "_digest")

    def __init__(self, id: str, request: Request, meta: dict):
        self.id, self.request, self.meta = id, request, meta
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """SHA-256 of the prompt text and the images' bytes: what the model is asked."""
        if self._digest is None:
            content = {
                "prompt": self.request.prompt,
                "images": [image.sha256 for image in self.request.images],
            }
            self._digest = hashlib.sha256(json.dumps(content).encode()).hexdigest()
        return self._digest


class Benchmark(abc.ABC):
    """Items, scoring and results of one benchmark."""

    name: str
    # Generation budget when the user gives none: enough for the expected answer format.
    default_max_tokens: int

    def identity(self) -> dict:
        """What must match for a rerun to add to an output directory's predictions."""
        return {"benchmark": self.name}

    def count(self) -> int | None:
        """The number of items, when known without reading them."""
        return None

    def max_images_per_item(self) -> int:
        """The most images one item's prompt carries (where a template may move them)."""
        return 1

    @abc.abstractmethod
    def items(self) -> Iterator[Item]: ...

    @abc.abstractmethod
    def score(self, meta: dict, reply: str) -> tuple[Any, bool | None]:
        """(parsed answer, JSON-serializable; correct, or None where an item has no verdict)."""

    def unanswered(self, meta: dict) -> tuple[Any, bool | None]:
        """(parsed, correct) recorded for an item whose request failed: no answer, wrong."""
        return None, False

    @abc.abstractmethod
    def results(self, records: Sequence[dict]) -> dict:
        """Metrics from prediction records (each with meta, parsed, correct and error)."""

    @abc.abstractmethod
    def markdown(self, results: dict) -> str: ...


# ---------------------------------------------------------------------------------------------
# TFDS records
# ---------------------------------------------------------------------------------------------


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split("."))


def dataset_dir(data_dir: str | pathlib.Path, name: str, config: str) -> pathlib.Path:
    """DATA_DIR/NAME/CONFIG/<newest version>: a finished TFDS build (it has dataset_info.json)."""
    root = pathlib.Path(data_dir) / name / config
    versions = [
        p
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir()
        and all(s.isdigit() for s in p.name.split("."))
        and (p / "dataset_info.json").exists()
    ]
    if not versions:
        raise ItemsError(
            f"{root}: no built dataset (expected {root}/<version>/dataset_info.json; "
            f"build it with `ood-jax build {name} --config {config} --data-dir {data_dir}`)"
        )
    return max(versions, key=lambda p: _version_key(p.name))


def built_configs(data_dir: str | pathlib.Path, name: str) -> list[str]:
    root = pathlib.Path(data_dir) / name
    configs = sorted(
        p.name
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir() and any((v / "dataset_info.json").exists() for v in p.iterdir())
    )
    if not configs:
        raise ItemsError(f"{root}: no built {name} dataset under it")
    return configs


def tfds_records(directory: pathlib.Path, splits: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """(split, record) for every example in file order, images left as their encoded bytes."""
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(str(directory))
    for split in splits:
        if split not in builder.info.splits:
            continue
        dataset = builder.as_dataset(
            split=split, shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()}
        )
        for record in tfds.as_numpy(dataset):
            yield split, record


def split_sizes(directory: pathlib.Path, splits: Sequence[str]) -> int:
    info = json.loads((directory / "dataset_info.json").read_text())
    sizes = {}
    for split in info.get("splits", ()):
        sizes[split["name"]] = sum(int(n) for n in split.get("shardLengths", ()))
    return sum(sizes.get(split, 0) for split in splits)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def image_request(question: str, encoded: bytes, where: str) -> Request:
    """One image, then the question: the usual single-image turn (FOCI and OODBench print only
    the text of their prompts)."""
    image = ImageInput.from_bytes(bytes(encoded), where)
    return Request(prompts.IMAGE_PLACEHOLDER + question, (image,))


# ---------------------------------------------------------------------------------------------
# Shared summaries and table helpers
# ---------------------------------------------------------------------------------------------


def answer_summary(records: Sequence[dict]) -> dict:
    """Accuracy over all records (failures and unread replies are wrong) and their counts."""
    n = len(records)
    failed = sum(r["error"] is not None for r in records)
    unread = sum(r["error"] is None and r["parsed"] is None for r in records)
    correct = sum(bool(r["correct"]) for r in records)
    return {
        "accuracy": correct / n if n else float("nan"),
        "num_items": n,
        "num_correct": correct,
        # A reply without a readable answer and a request that never got a reply are both
        # generation failures; the second kind is also counted on its own.
        "generation_failures": failed + unread,
        "request_failures": failed,
    }


def pct(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.2f}"


def frac(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value < 0:
        return "-"
    return f"{value:.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def group_by(records: Sequence[dict], key: str) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = collections.defaultdict(list)
    for record in records:
        groups[record["meta"][key]].append(record)
    return groups
