"""The resumable evaluation loop: items -> client -> DIR/predictions.jsonl -> DIR/results.{json,md}.

DIR/predictions.jsonl holds one JSON line per answered item: id, digest (SHA-256 of the prompt
and images), reply, parsed answer, correct, error (null unless the request failed) and the item's
meta. Lines are appended and flushed as replies arrive, so a killed run keeps every reply it
received; Ctrl-C ends with one line saying how many replies the file keeps. A rerun into the
same DIR:
  * drops a torn last line (a kill in the middle of a write) and sends that item again;
  * sends only items without a reply: answered items are skipped, failed ones retried;
  * refuses to mix: an item whose digest changed, or a run with another benchmark, model or
    generation budget (DIR/run.json), is an error naming what differs.
When every item of the run has been handled the file is rewritten (atomically) with one line per
item, the run's items first; records of items outside the run (beyond a --limit) are kept.

Results are written atomically at the end of every run. A run over every item writes
results.json and results.md. A run with `limit=N` that leaves items out writes
results.limitN.json and results.limitN.md beside them, never over them: they hold "limit": N,
"num_items" (at most N) and a markdown line saying they are a subset. (A limit that leaves no
item out is a full run.) "complete" is true when every item of the run, i.e. the first N for a
limited one, has a reply without a request error; it says nothing of items past the limit. A
later run without a limit sends only what the limited runs left unanswered and writes
results.json.

The items and their scoring come from a Benchmark (ood_jax.eval.tasks.base; the tasks are in
ood_jax.eval.tasks), the replies from a client of ood_jax.eval.clients.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import pathlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from ood_jax import files
from ood_jax.eval.tasks.base import Benchmark, Item
from ood_jax.eval.clients import ClientError, Request

PREDICTIONS_FILE = "predictions.jsonl"
RUN_FILE = "run.json"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def results_files(limit: int | None = None) -> tuple[str, str]:
    """(json, markdown) file names of a run's results: results.* for a run over every item,
    results.limitN.* for one over the first N only (`limit`: the "limit" of its results)."""
    if limit is None:
        return RESULTS_JSON, RESULTS_MD
    return f"results.limit{limit}.json", f"results.limit{limit}.md"


class RunError(ValueError):
    """An output directory or item set that a run cannot continue with."""


class Client(Protocol):
    def identity(self) -> dict: ...

    def generate(self, request: Request) -> str: ...


# ---------------------------------------------------------------------------------------------
# The predictions file
# ---------------------------------------------------------------------------------------------


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
        ids = list(order) + [i for i in self.records if i not in set(order)]
        text = "".join(json.dumps(self.records[i]) + "\n" for i in ids if i in self.records)
        files.write_atomic(self.path, text)


def _check_run_file(directory: pathlib.Path, identity: dict) -> None:
    path = directory / RUN_FILE
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{path}: malformed JSON ({e.msg})") from None
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
    else:
        files.write_atomic(path, json.dumps(identity, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr with the rate and time left (tqdm), or nothing when disabled."""

    def __init__(self, total: int | None, description: str, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=description, unit="item", file=sys.stderr, dynamic_ncols=True
            )

    def update(self, done: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(done)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _json_safe(value: Any) -> Any:
    """NaN (a metric over no items) becomes null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _limited(items: Iterable[Item], limit: int | None) -> Iterator[Item]:
    for k, item in enumerate(items):
        if limit is not None and k >= limit:
            return
        yield item


def _check_digests(benchmark: Benchmark, store: PredictionStore, limit: int | None) -> None:
    """Before anything is sent: every stored record must still match its item's prompt."""
    for item in _limited(benchmark.items(), limit):
        stored = store.records.get(item.id)
        if stored is not None and stored["digest"] != item.digest:
            raise RunError(
                f"{store.path}: item {item.id!r} was answered for another prompt or image "
                f"(digest {stored['digest'][:12]} there, {item.digest[:12]} now); "
                "use another --output"
            )


def _record(benchmark: Benchmark, item: Item, reply: str | None, error: str | None) -> dict:
    if reply is None:
        parsed, correct = benchmark.unanswered(item.meta)
    else:
        parsed, correct = benchmark.score(item.meta, reply)
    return {
        "id": item.id,
        "digest": item.digest,
        "reply": reply,
        "parsed": parsed,
        "correct": correct,
        "error": error,
        "meta": item.meta,
    }


class _Session:
    """What a run shares between its answering loop and its ending: store, ids, progress."""

    def __init__(
        self,
        benchmark: Benchmark,
        identity: dict,
        output: str | pathlib.Path,
        limit: int | None,
        progress: bool,
    ):
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be non-negative, got {limit}")
        self.benchmark, self.identity, self.limit = benchmark, identity, limit
        # Set by `pending` when the limit left items out: the results are then a subset's.
        self.subset = False
        self.directory = pathlib.Path(output)
        self.directory.mkdir(parents=True, exist_ok=True)
        _check_run_file(self.directory, identity)
        self.store = PredictionStore(self.directory / PREDICTIONS_FILE)
        if self.store.records:
            _check_digests(benchmark, self.store, limit)
        self.order: list[str] = []
        self.failed = 0
        total = benchmark.count()
        if total is not None and limit is not None:
            total = min(total, limit)
        self.progress = Progress(total, benchmark.name, progress)

    def pending(self) -> Iterator[Item]:
        """The run's items that still need a reply, in order; answered ones only tick the bar."""
        seen = set()
        for k, item in enumerate(self.benchmark.items()):
            if self.limit is not None and k == self.limit:
                # One item past the limit exists: this run covers a subset.
                self.subset = True
                return
            if item.id in seen:
                raise RunError(f"{self.benchmark.name}: item id {item.id!r} occurs twice")
            seen.add(item.id)
            self.order.append(item.id)
            stored = self.store.records.get(item.id)
            # The digest was checked up front; a changed item can only be new here.
            if stored is not None and stored["digest"] != item.digest:
                raise RunError(f"{self.store.path}: item {item.id!r} changed during the run")
            if stored is not None and stored["error"] is None:
                self.progress.update()
                continue
            yield item

    def record(self, item: Item, reply: str | None, error: str | None) -> None:
        self.store.append(_record(self.benchmark, item, reply, error))
        self.failed += error is not None
        self.progress.update(failed=self.failed)

    def finish(self) -> dict:
        self.progress.close()
        self.store.compact(self.order)
        records = [self.store.records[i] for i in self.order]
        limit = self.limit if self.subset else None
        results = {
            **self.identity,
            "num_items": len(records),
            **({"limit": limit} if limit is not None else {}),
            "complete": all(r["error"] is None for r in records),
            **self.benchmark.results(records),
        }
        results = _json_safe(results)
        markdown = self.benchmark.markdown(results)
        if limit is not None:
            markdown = (
                f"Subset: the first {limit} items only (--limit {limit}); a run without "
                f"--limit writes the results of every item to {RESULTS_JSON} and {RESULTS_MD}."
                f"\n\n{markdown}"
            )
        json_name, md_name = results_files(limit)
        files.write_atomic(self.directory / json_name, json.dumps(results, indent=2) + "\n")
        files.write_atomic(self.directory / md_name, markdown)
        return results

    def interrupted(self) -> KeyboardInterrupt:
        """What Ctrl-C re-raises: the one line ood_jax.cli prints says what was kept."""
        kept = sum(r["error"] is None for r in self.store.records.values())
        return KeyboardInterrupt(
            f"{kept} replies kept in {self.store.path}; rerun the same command to continue"
        )

    def abort(self) -> None:
        self.progress.close()
        self.store.close()


def run(
    benchmark: Benchmark,
    client: Client,
    output: str | pathlib.Path,
    concurrency: int = 8,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """Asks `client` every item of `benchmark` not yet answered in `output`; returns the results.

    `limit`: only the first `limit` items (results beside the full ones, see the module
    docstring). Up to `concurrency` requests are in flight (1 for clients that say so). A request
    that fails for good (`ClientError`) is recorded with its error and retried by the next run;
    any other exception stops the run after recording the replies already received, and a
    KeyboardInterrupt is re-raised with a message saying how many replies were kept, and where.
    """
    concurrency = min(concurrency, getattr(client, "concurrency_limit", concurrency))
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    session = _Session(
        benchmark, {**benchmark.identity(), **client.identity()}, output, limit, progress
    )

    def ask(item: Item) -> tuple[str | None, str | None]:
        try:
            return client.generate(item.request), None
        except ClientError as e:
            return None, str(e)

    pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="eval-mllm")
    in_flight: dict[concurrent.futures.Future, Item] = {}

    def settle(futures: Iterable[concurrent.futures.Future]) -> BaseException | None:
        """Records every finished reply; returns the first crash of a client call, if any."""
        crash = None
        for future in futures:
            item = in_flight.pop(future)
            try:
                reply, error = future.result()
            # A reply that arrived alongside must still be kept, whatever stopped another call
            # (a KeyboardInterrupt or SystemExit raised in a worker thread lands here too).
            except BaseException as e:
                crash = crash or e
                continue
            session.record(item, reply, error)
        return crash

    def drain(at_most: int) -> None:
        # Record finished requests in the main thread until no more than `at_most` are in flight.
        while len(in_flight) > at_most:
            done, _ = concurrent.futures.wait(
                in_flight, return_when=concurrent.futures.FIRST_COMPLETED
            )
            crash = settle(done)
            if crash is not None:
                raise crash

    try:
        for item in session.pending():
            in_flight[pool.submit(ask, item)] = item
            # A bounded window keeps memory flat however many items there are.
            drain(2 * concurrency - 1)
        drain(0)
    except BaseException as e:
        # Keep the replies already received; requests not yet sent are dropped.
        pool.shutdown(wait=False, cancel_futures=True)
        settle([f for f in list(in_flight) if f.done() and not f.cancelled()])
        session.abort()
        if isinstance(e, KeyboardInterrupt):
            raise session.interrupted() from e
        raise
    pool.shutdown(wait=True)
    return session.finish()


def run_batched(
    benchmark: Benchmark,
    identity: dict,
    answer_batch: Callable[[list[Item]], list[str]],
    output: str | pathlib.Path,
    batch_size: int = 64,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """`run` for answerers that work on batches (the CLIP baseline): same files, same resume."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    session = _Session(benchmark, {**benchmark.identity(), **identity}, output, limit, progress)
    batch: list[Item] = []

    def flush() -> None:
        replies = answer_batch(batch)
        if len(replies) != len(batch):
            raise RuntimeError(f"answered {len(replies)} of a batch of {len(batch)} items")
        for item, reply in zip(batch, replies):
            session.record(item, reply, None)
        batch.clear()

    try:
        for item in session.pending():
            batch.append(item)
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    except BaseException as e:
        session.abort()
        if isinstance(e, KeyboardInterrupt):
            raise session.interrupted() from e
        raise
    return session.finish()
