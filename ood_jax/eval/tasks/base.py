"""What every task of `ood-jax eval-mllm` shares: the Item, the Scoring interface (replies and
records to results, without the data, so that `ood-jax rescore` needs none) and the Benchmark
(a Scoring with items), the parse modes, reading built TFDS datasets, and the summaries and
tables the results are made of."""

from __future__ import annotations

import abc
import collections
import copy
import hashlib
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ood_jax import prompts, stats
from ood_jax.data import iteration
from ood_jax.eval import parsing
from ood_jax.eval.clients import ImageInput, Request

JUDGE_MODE = "judge"
PARSE_MODES = (*parsing.CHOICE_MODES, JUDGE_MODE)
# What the judge mode reads by rule before it asks the judge: a letter standing alone or an
# option named in full, the rules VLMEvalKit tries before its judge too.
JUDGE_RULE_MODE = "strict"
CONFIDENCE = 0.95
INTERVALS = {"method": "clopper-pearson", "confidence": CONFIDENCE}
CI_LABEL = f"{100 * CONFIDENCE:g}% CI"


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


class Verdicts(Protocol):
    """A judge's verdicts, as the judge mode reads them (ood_jax.eval.judge.Verdicts)."""

    def identity(self) -> dict: ...

    def lookup(self, options: Sequence[str], reply: str) -> tuple[bool, int | None]:
        """(judged, the option it named or None); judged is False while no verdict is kept."""
        ...


class Scoring(abc.ABC):
    """How one benchmark reads replies and what it makes of the records: needs no data.

    `parse_modes`: the modes its replies can be read under (empty: one fixed reading);
    `parse_mode`: the mode this instance reads under (the class's value is the default);
    `judge`: the verdicts the judge mode reads, when a judge was used.
    """

    name: str
    parse_modes: tuple[str, ...] = ()
    parse_mode: str | None = None
    judge: Verdicts | None = None

    def identity(self) -> dict:
        """What must match for a rerun to add to an output directory's predictions."""
        return {"benchmark": self.name}

    def reading(self, parse_mode: str | None, judge: Verdicts | None = None) -> "Scoring":
        """This scoring reading replies under `parse_mode` (None: the default) with `judge`."""
        if not self.parse_modes:
            if parse_mode is not None:
                raise ValueError(f"{self.name} reads its replies one way: it has no parse modes")
            return self
        mode = parse_mode or type(self).parse_mode
        if mode not in self.parse_modes:
            raise ValueError(
                f"{self.name} reads replies under parse mode {', '.join(self.parse_modes)}; "
                f"got {mode!r}"
            )
        if mode == JUDGE_MODE and judge is None:
            raise ValueError("parse mode judge needs a judge's verdicts")
        out = copy.copy(self)
        out.parse_mode, out.judge = mode, judge
        return out

    def choice_options(self, meta: dict) -> Sequence[str] | None:
        """The options a reply to this item chooses among; None where it is no such choice."""
        return None

    def read_choice(self, meta: dict, reply: str) -> int | None:
        """The option a reply chooses under this scoring's parse mode (for choice_options)."""
        options = self.choice_options(meta)
        if self.parse_mode != JUDGE_MODE:
            return parsing.read_choice(reply, options, self.parse_mode)
        parsed = parsing.read_choice(reply, options, JUDGE_RULE_MODE)
        if parsed is None and reply.strip():
            _, parsed = self.judge.lookup(options, reply)
        return parsed

    def needs_judge(self, record: dict) -> Sequence[str] | None:
        """The options to judge a record's reply against, when no rule reads it; else None."""
        if record["error"] is not None or not (record["reply"] or "").strip():
            return None
        options = self.choice_options(record["meta"])
        if options is None:
            return None
        if parsing.read_choice(record["reply"], options, JUDGE_RULE_MODE) is not None:
            return None
        return options

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

    def headline(self, records: Sequence[dict]) -> tuple[str, int, int] | None:
        """(what, correct, items) of the number the parser audit follows across parse modes;
        None for a benchmark read one way."""
        return None


class Benchmark(Scoring):
    """Items, scoring and results of one benchmark."""

    # Generation budget when the user gives none: enough for the expected answer format.
    default_max_tokens: int

    def count(self) -> int | None:
        """The number of items, when known without reading them."""
        return None

    def max_images_per_item(self) -> int:
        """The most images one item's prompt carries (where a template may move them)."""
        return 1

    @abc.abstractmethod
    def items(self) -> Iterator[Item]: ...


def scored(scoring: Scoring, record: dict) -> dict:
    """`record` with its parsed answer and verdict read again from its reply by `scoring`: the
    one place a prediction is scored, whether as it arrives, at a run's end or re-scored."""
    if record["error"] is not None:
        parsed, correct = scoring.unanswered(record["meta"])
    else:
        parsed, correct = scoring.score(record["meta"], record["reply"] or "")
    return {**record, "parsed": parsed, "correct": correct}


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
        for record in iteration.numpy_iterator(dataset):
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


def interval(correct: int, n: int) -> list[float] | None:
    """The exact (Clopper-Pearson) CONFIDENCE interval of `correct` of `n`; None for no items."""
    return list(stats.clopper_pearson(correct, n, CONFIDENCE)) if n else None


def answer_summary(records: Sequence[dict]) -> dict:
    """Accuracy over all records (failures and unread replies are wrong), its interval and the
    counts."""
    n = len(records)
    failed = sum(r["error"] is not None for r in records)
    unread = sum(r["error"] is None and r["parsed"] is None for r in records)
    correct = sum(bool(r["correct"]) for r in records)
    return {
        "accuracy": correct / n if n else float("nan"),
        "accuracy_ci": interval(correct, n),
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


def pct_ci(value: float | None, ci: Sequence[float] | None) -> str:
    """A percentage and its interval: "43.48 [23.19, 65.51]"."""
    if ci is None:
        return pct(value)
    return f"{pct(value)} [{pct(ci[0])}, {pct(ci[1])}]"


def frac_ci(value: float | None, ci: Sequence[float] | None) -> str:
    """A fraction and its interval: "0.435 [0.232, 0.655]"."""
    if ci is None:
        return frac(value)
    return f"{frac(value)} [{frac(ci[0])}, {frac(ci[1])}]"


INTERVALS_NOTE = f"Brackets: exact (Clopper-Pearson) {CI_LABEL}s over the items counted."


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def group_by(records: Sequence[dict], key: str) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = collections.defaultdict(list)
    for record in records:
        groups[record["meta"][key]].append(record)
    return groups
