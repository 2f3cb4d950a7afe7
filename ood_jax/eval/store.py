"""A run directory's files: DIR/predictions.jsonl (the latest record per item, appended as replies
arrive, a torn last line dropped), DIR/run.json (the run's identity, which a rerun must match, and
how its replies were last read and priced) and the names of the results files."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Iterator, Sequence

from ood_jax import files
from ood_jax.eval.tasks.base import Benchmark, Item

PREDICTIONS_FILE = "predictions.jsonl"
RUN_FILE = "run.json"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
# Identity keys added after run directories were first written, with the value every older run
# had: an older DIR/run.json without them still matches a run that uses those values.
LEGACY_IDENTITY = {
    "token_param": "max_tokens",
    "temperature": 0,
    "extra_body": {},
    "strip_think": False,
}
# What run.json holds beside the identity: how the replies are read and priced. The parse mode
# was part of the identity of older runs; it is now only the mode the results were last written
# with. Prices change no reply, so they are no part of the identity either.
SCORING_KEYS = ("parse_mode", "judge", "prices")


def results_files(limit: int | None = None, parse_mode: str | None = None) -> tuple[str, str]:
    """(json, markdown) file names of a run's results: results.* for a run over every item,
    results.limitN.* for one over the first N only (`limit`: the "limit" of its results);
    `parse_mode`: results re-scored under a mode other than the run's, results[.limitN].MODE.*."""
    stem = "results" + (f".limit{limit}" if limit is not None else "")
    stem += f".{parse_mode}" if parse_mode is not None else ""
    return f"{stem}.json", f"{stem}.md"


class RunError(ValueError):
    """An output directory or item set that a run cannot continue with."""


class PredictionStore:
    """DIR/predictions.jsonl: the latest record per item id, appended to as replies arrive."""

    def __init__(self, path: pathlib.Path, repair: bool = True):
        """Loads `path` if it exists; `repair` cuts a torn last line off the file (else it is
        only ignored, for readers that must not change the file)."""
        self.path = path
        self.records: dict[str, dict] = {}
        self.torn_line_dropped = False
        if path.exists():
            self._load(repair)
        self._file = None

    def _load(self, repair: bool) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            # A kill mid-write leaves a last line without its newline: drop it; it is re-sent.
            if repair:
                with open(self.path, "r+b") as f:
                    f.truncate(end)
            self.torn_line_dropped = True
        try:
            text = data[:end].decode()
        except UnicodeDecodeError as e:
            raise RunError(f"{self.path}: not UTF-8 text ({e})") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunError(f"{self.path}: line {number}: malformed JSON ({e.msg})") from None
            if not isinstance(record, dict) or not {"id", "digest"} <= record.keys():
                raise RunError(f"{self.path}: line {number}: a record needs 'id' and 'digest'")
            self.records[record["id"]] = record

    def append(self, record: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        # One write of a whole line, flushed at once: the OS has it even if the process dies.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records[record["id"]] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def compact(self, order: Sequence[str]) -> None:
        """Rewrites the file with one line per id: `order` first, then any other ids kept."""
        self.close()
        in_order = set(order)
        ids = list(order) + [i for i in self.records if i not in in_order]
        text = "".join(json.dumps(self.records[i]) + "\n" for i in ids if i in self.records)
        files.write_atomic(self.path, text)


def read_run_file(directory: pathlib.Path) -> dict | None:
    """DIR/run.json, or None where there is none yet."""
    path = directory / RUN_FILE
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{path}: malformed JSON ({e.msg})") from None
    if not isinstance(run, dict):
        raise RunError(f"{path}: not a JSON object")
    return run


def run_identity(run: dict) -> dict:
    """The identity in a run.json: what a rerun must match (the scoring keys left out)."""
    return {k: v for k, v in run.items() if k not in SCORING_KEYS}


def check_run_file(directory: pathlib.Path, identity: dict) -> dict | None:
    """The stored run.json (None when new), after checking that it holds this run's identity."""
    stored = read_run_file(directory)
    if stored is None:
        return None
    previous = {
        **{k: v for k, v in LEGACY_IDENTITY.items() if k in identity},
        **run_identity(stored),
    }
    differs = sorted(
        k for k in identity.keys() | previous.keys() if identity.get(k) != previous.get(k)
    )
    if differs:
        detail = ", ".join(
            f"{k}: {previous.get(k)!r} there, {identity.get(k)!r} now" for k in differs
        )
        raise RunError(
            f"{directory} holds predictions of another run ({detail}); use another --output"
        )
    return stored


def _limited(items: Iterable[Item], limit: int | None) -> Iterator[Item]:
    for k, item in enumerate(items):
        if limit is not None and k >= limit:
            return
        yield item


def check_digests(benchmark: Benchmark, store: PredictionStore, limit: int | None) -> None:
    """Before anything is sent: every stored record must still match its item's prompt."""
    for item in _limited(benchmark.items(), limit):
        stored = store.records.get(item.id)
        if stored is not None and stored["digest"] != item.digest:
            raise RunError(
                f"{store.path}: item {item.id!r} was answered for another prompt or image "
                f"(digest {stored['digest'][:12]} there, {item.digest[:12]} now); "
                "use another --output"
            )


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------


def read_results(path: pathlib.Path) -> dict:
    """A results.json object; RunError naming the file when it is missing or malformed."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{path}: malformed JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise RunError(f"{path}: not a JSON object")
    return value


def finished_records(directory: pathlib.Path, results: dict, results_path: pathlib.Path) -> list:
    """The records a finished run's results cover: the first num_items of predictions.jsonl
    (a run ends by rewriting the file with its own items first)."""
    n = results.get("num_items")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise RunError(f"{results_path}: field 'num_items' must be a count, got {n!r}")
    path = directory / PREDICTIONS_FILE
    if not path.exists():
        raise RunError(f"{path}: not found")
    records = list(PredictionStore(path, repair=False).records.values())
    if len(records) < n:
        raise RunError(
            f"{path} holds {len(records)} records, fewer than the {n} items {results_path} counts"
        )
    for record in records[:n]:
        for field in ("reply", "error", "meta"):
            if field not in record:
                raise RunError(f"{path}: item {record['id']!r}: missing field {field!r}")
    return records[:n]
