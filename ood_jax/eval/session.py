"""A run's session: what its answering loop and its ending share. It checks the directory
against the run (run.json, the items' digests), records each reply once as it arrives, and at the
end judges, writes the results and ends the manifest, however the run ends."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ood_jax import files, manifest, progress, prompts
from ood_jax.eval import parsing, results, run_manifest, shards, store
from ood_jax.eval.accounting import Limits, Prices, Spent, stored_prices
from ood_jax.eval.clients import DEFAULT_CONCURRENCY, ClientError, Reply
from ood_jax.eval.scheduling import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    LimitReached,
    RunStopped,
    Streak,
)
from ood_jax.eval.store import RUN_FILE, PredictionStore, RunError
from ood_jax.eval.tasks.base import JUDGE_MODE, Benchmark, Item, Scoring, scored


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run asks and reads.

    Attributes:
      concurrency: requests in flight at most (1 for clients that say so; a client that takes
        a RunControl adapts below it).
      limit: only the first `limit` items (results beside the full ones: `store.results_files`).
      progress: how far the run is, on stderr (ood_jax.progress).
      retry_budget: retries the whole run may make (None: clients.RetryBudget's default).
      max_consecutive_failures: items failing in a row with the same kind of error that stop
        the run with RunStopped (0: never).
      strip_think: `<think>` blocks are taken out of replies before scoring and kept as
        reasoning (part of the run's identity).
      warnings: what the results must say about how far to trust them.
      parse_mode: how replies are read (None: the mode the directory's results were last
        written with, else the benchmark's default).
      prices: what a million prompt and completion tokens cost (None: run.json's, if any).
      limits: this invocation's --max-requests and --max-cost.
      shard: the part of the items this run asks (ood_jax.eval.shards), None for all.
    """

    concurrency: int = DEFAULT_CONCURRENCY
    limit: int | None = None
    progress: bool = True
    retry_budget: int | None = None
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES
    strip_think: bool = True
    warnings: Sequence[str] = ()
    parse_mode: str | None = None
    prices: Prices | None = None
    limits: Limits = Limits()
    shard: shards.Shard | None = None

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be non-negative, got {self.limit}")
        if self.shard is not None and self.limit is not None:
            raise ValueError(
                "--limit and --shard: a part covers its share of every item (--limit runs "
                "without --shard)"
            )
        if self.max_consecutive_failures < 0:
            raise ValueError(
                "max_consecutive_failures must be non-negative, got "
                f"{self.max_consecutive_failures}"
            )


class Judge(Protocol):
    """What a run asks of the judge mode's judge (ood_jax.eval.judge.Judge): its identity, the
    verdicts it keeps, and `complete`, which asks it about the replies still without one."""

    verdicts: Any

    def identity(self) -> dict: ...

    def complete(self, scoring: Scoring, records: Sequence[dict], progress: bool) -> None: ...


def scoring_mode(
    directory: pathlib.Path,
    benchmark: Benchmark,
    stored: dict | None,
    parse_mode: str | None,
    judge: Judge | None,
) -> Scoring:
    """The benchmark reading replies under the run's mode: `parse_mode`, else the mode the
    directory's results were last written with, else the benchmark's default."""
    mode = parse_mode or (stored or {}).get("parse_mode") or benchmark.parse_mode
    if mode == JUDGE_MODE and judge is None:
        origin = "--parse-mode judge" if parse_mode else f"{directory / RUN_FILE} says so"
        raise RunError(
            f"replies are read under parse mode judge ({origin}): that needs a judge "
            "(--judge-endpoint and --judge-model), or pick another --parse-mode"
        )
    if judge is not None and mode != JUDGE_MODE:
        raise ValueError(f"a judge applies to parse mode judge only, not {mode!r}")
    kept = (stored or {}).get("judge")
    if judge is not None and kept is not None and kept != judge.identity():
        raise RunError(
            f"{directory}'s replies were judged by another judge ({kept!r} there, "
            f"{judge.identity()!r} now); use that judge, or another --output"
        )
    try:
        return benchmark.reading(mode, judge.verdicts if judge is not None else None)
    except ValueError as e:
        raise RunError(f"{directory}: {e}") from None


# ---------------------------------------------------------------------------------------------
# The session
# ---------------------------------------------------------------------------------------------


class Session:
    """What a run shares between its answering loop and its ending: store, ids, progress, what
    this invocation spent, and the manifest."""

    def __init__(
        self,
        benchmark: Benchmark,
        identity: dict,
        output: str | pathlib.Path,
        options: RunOptions,
        judge: Judge | None,
        about: dict,
    ):
        """`about`: the manifest's fields for this kind of run (`model`, `request`, and
        `packages` and `devices` for manifest.collect)."""
        if options.shard is not None:
            identity = {**identity, "shard": options.shard.to_json()}
        self.benchmark, self.identity = benchmark, identity
        self.options, self.judge = options, judge
        # Set by `pending` when the limit left items out: the results are then a subset's.
        self.subset = False
        self.directory = pathlib.Path(output)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_file = store.check_run_file(self.directory, identity)
        self.scoring = scoring_mode(
            self.directory, benchmark, self.run_file, options.parse_mode, judge
        )
        self.prices = options.prices or stored_prices(self.run_file, self.directory / RUN_FILE)
        self._write_run_file(
            judge=judge.identity() if judge is not None else None,
            # A new run records its mode at once, so that a killed one resumes with it.
            parse_mode=None if "parse_mode" in (self.run_file or {}) else self.scoring.parse_mode,
            prices=options.prices.to_json() if options.prices is not None else None,
        )
        self.store = PredictionStore(self.directory / store.PREDICTIONS_FILE)
        if self.store.records:
            store.check_digests(benchmark, self.store, options.limit)
        self.order: list[str] = []
        # Replies recorded by this session, read under its scoring already.
        self.recorded: set[str] = set()
        self.failed = 0
        self.spent = Spent()
        self.served_models: set[str] = set()
        self.manifest = self._start_manifest(about)
        total = benchmark.count() if options.shard is None else None
        if total is not None and options.limit is not None:
            total = min(total, options.limit)
        self.progress = progress.Progress(
            benchmark.name, total, verbs=("asking", "asked"), enabled=options.progress
        )

    def _start_manifest(self, about: dict) -> dict:
        about = dict(about)
        started = manifest.collect(
            "eval-mllm",
            devices=about.pop("devices", False),
            packages=about.pop("packages", ()),
            benchmark=self.benchmark.identity(),
            dataset=run_manifest.dataset(self.benchmark),
            **about,
            prompts={"version": prompts.PROMPTS_VERSION},
            parser={"version": parsing.PARSER_VERSION, "parse_mode": self.scoring.parse_mode},
            judge=self.judge.identity() if self.judge is not None else None,
            strip_think=self.options.strip_think,
            limit=self.options.limit,
            prices=self.prices.to_json() if self.prices is not None else None,
        )
        try:
            manifest.write(self.directory, started)
        except manifest.ManifestError as e:
            raise RunError(str(e)) from None
        return started

    def _end_manifest(self, status: str, **fields: Any) -> None:
        manifest.finish(
            self.directory,
            self.manifest,
            status,
            served_models=sorted(self.served_models),
            totals=self.spent.to_json(self.prices),
            **fields,
        )

    def _write_run_file(self, **scoring: Any) -> None:
        """run.json: this run's identity (an older file, which matched it, gains the keys it
        lacked), then the scoring keys (a new judge, the results' mode, the prices); written
        when changed."""
        kept = {k: v for k, v in (self.run_file or {}).items() if k in store.SCORING_KEYS}
        kept.update({k: v for k, v in scoring.items() if v is not None})
        content = {**self.identity, **kept}
        if content != self.run_file:
            files.write_atomic(self.directory / RUN_FILE, json.dumps(content, indent=2) + "\n")
            self.run_file = content

    def pending(self) -> Iterator[Item]:
        """The run's items that still need a reply, in order; answered ones only tick the bar."""
        seen = set()
        shard, every_item = self.options.shard, []
        for k, item in enumerate(self.benchmark.items()):
            if self.options.limit is not None and k == self.options.limit:
                # One item past the limit exists: this run covers a subset.
                self.subset = True
                return
            if item.id in seen:
                raise RunError(f"{self.benchmark.name}: item id {item.id!r} occurs twice")
            seen.add(item.id)
            if shard is not None:
                every_item.append((item.id, item.digest))
                if not shard.holds(item):
                    continue
            self.order.append(item.id)
            stored = self.store.records.get(item.id)
            # The digest was checked up front; a changed item can only be new here.
            if stored is not None and stored["digest"] != item.digest:
                raise RunError(f"{self.store.path}: item {item.id!r} changed during the run")
            if stored is not None and stored["error"] is None:
                self.progress.update()
                continue
            yield item
        if shard is not None:  # every item seen: what the merge checks the parts against
            shards.write_all_items(self.directory, every_item)

    def sent(self, requests: int = 1) -> None:
        self.spent.requests += requests

    def record(
        self, item: Item, reply: Reply | None, error: ClientError | None, **postfix: Any
    ) -> None:
        self.store.append(
            results.make_record(self.scoring, item, reply, error, self.options.strip_think)
        )
        self.recorded.add(item.id)
        self.failed += error is not None
        self.spent.received(item.id, reply, error)
        if reply is not None and reply.model:
            self.served_models.add(reply.model)
        self.progress.update(failed=self.failed, **postfix)

    def finish(self) -> dict:
        """Judges, re-reads every reply, writes the results and ends the manifest."""
        try:
            written, json_name = self._write_results()
        except BaseException as error:
            self._end_manifest(**run_manifest.ending(error))
            raise
        records = [self.store.records[i] for i in self.order]
        self._end_manifest(
            "complete" if written["complete"] else "incomplete",
            items={
                "count": len(records),
                "digest": manifest.items_digest((r["id"], r["digest"]) for r in records),
            },
            results={
                "file": json_name,
                "num_items": written["num_items"],
                "complete": written["complete"],
                "usage": written.get("usage", {}),
                **({"cost": written["cost"]["total"]} if "cost" in written else {}),
            },
        )
        return written

    def _write_results(self) -> tuple[dict, str]:
        self.progress.close()
        records = [self.store.records[i] for i in self.order]
        if self.judge is not None:
            self.judge.complete(self.scoring, records, self.options.progress)
        # Replies of earlier runs read again under this run's mode, which may differ from the
        # one they were first read with (and every reply once judged): predictions.jsonl then
        # says what the results count.
        for record in records:
            if self.judge is not None or record["id"] not in self.recorded:
                self.store.records[record["id"]] = scored(self.scoring, record)
        self.store.compact(self.order)
        records = [self.store.records[i] for i in self.order]
        limit = self.options.limit if self.subset else None
        made, markdown = results.build_results(
            self.scoring, self.identity, records, limit, self.options.warnings, self.prices
        )
        json_name, md_name = store.results_files(limit)
        files.write_atomic(self.directory / json_name, json.dumps(made, indent=2) + "\n")
        files.write_atomic(self.directory / md_name, markdown)
        self._write_run_file(parse_mode=self.scoring.parse_mode)
        return made, json_name

    def kept(self) -> int:
        return sum(r["error"] is None for r in self.store.records.values())

    def interrupted(self) -> KeyboardInterrupt:
        """What Ctrl-C re-raises: the one line ood_jax.cli prints says what was kept."""
        return KeyboardInterrupt(
            f"{self.kept()} replies kept in {self.store.path}; rerun the same command to continue"
        )

    def stopped(self, streak: Streak) -> RunStopped:
        kept = self.kept()
        return RunStopped(
            f"{streak.count} items in a row failed with {streak.kind} (the last: {streak.last}); "
            f"{kept} replies kept in {self.store.path}",
            streak.kind,
            streak.last,
            kept,
        )

    def limit_reached(self, limit: str, why: str) -> LimitReached:
        kept = self.kept()
        return LimitReached(f"{why}; {kept} replies kept in {self.store.path}", limit, why, kept)

    def abort(self, error: BaseException) -> BaseException:
        """Closes what the run has open and ends the manifest with `error`'s status; returns
        `error`, for the caller to raise."""
        self.progress.close()
        self.store.close()
        self._end_manifest(**run_manifest.ending(error))
        return error
