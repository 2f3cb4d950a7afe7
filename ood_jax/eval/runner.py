"""The resumable evaluation loop: a benchmark's items -> a client -> DIR/predictions.jsonl ->
DIR/results.{json,md}. `run` asks a client (ood_jax.eval.clients) up to `concurrency` items at
a time; `run_batched` asks an answerer of whole batches (the CLIP baseline). The run directory's
files, resuming, limits and exit codes are described in the documentation (docs/)."""

from __future__ import annotations

import dataclasses
import pathlib
import queue
from collections.abc import Callable

from ood_jax.eval import accounting, run_manifest
from ood_jax.eval.clients import Abandoned, ClientError, Reply, RunControl
from ood_jax.eval.scheduling import Client, Streak, Workers
from ood_jax.eval.session import Judge, RunOptions, Session
from ood_jax.eval.tasks.base import Benchmark, Item


class _TooManyFailures(Exception):
    pass


class _LimitHit(Exception):
    def __init__(self, limit: str, why: str):
        super().__init__(why)
        self.limit, self.why = limit, why


def run(
    benchmark: Benchmark,
    client: Client,
    output: str | pathlib.Path,
    options: RunOptions = RunOptions(),
    judge: Judge | None = None,
) -> dict:
    """Asks `client` every item of `benchmark` not yet answered in `output`; returns the results.

    `judge`: the judge parse mode's judge (ood_jax.eval.judge.Judge), asked at the end about
    every reply no rule reads. A request that fails for good (`ClientError`) is recorded with
    its error and retried by the next run; too many failures in a row stop the run with
    RunStopped, a limit with LimitReached; any other exception stops it after recording the
    replies already received, and a KeyboardInterrupt is re-raised with a message saying how
    many replies were kept, and where. DIR/manifest.json is written at the start and at the
    end, however the run ends.
    """
    # ---------------------------------------------------------------- the session
    concurrency = min(
        options.concurrency, getattr(client, "concurrency_limit", options.concurrency)
    )
    options = dataclasses.replace(options, concurrency=concurrency)
    accounting.check_priced(options.limits, options.prices, pathlib.Path(output))
    identity = {**benchmark.identity(), **client.identity(), "strip_think": options.strip_think}
    about = run_manifest.client_manifest(
        client,
        options.limits,
        concurrency=concurrency,
        retry_budget=options.retry_budget,
        max_consecutive_failures=options.max_consecutive_failures,
    )
    session = Session(benchmark, identity, output, options, judge, about)

    # ---------------------------------------------------------------- the workers
    control = (
        RunControl(concurrency, options.retry_budget)
        if getattr(client, "accepts_run_control", False)
        else None
    )

    def ask(item: Item) -> tuple[Reply | None, ClientError | None]:
        try:
            if control is not None:
                return Reply.of(client.generate(item.request, control)), None
            return Reply.of(client.generate(item.request)), None
        except ClientError as e:
            return None, e

    workers = Workers(concurrency, ask)
    streak = Streak(options.max_consecutive_failures)
    in_flight = 0

    def settle(done: tuple) -> None:
        item, reply, error, crash = done
        if crash is not None:
            raise crash
        postfix = {"concurrency": control.limit.limit} if control is not None else {}
        session.record(item, reply, error, **postfix)
        if streak.add(error):
            raise _TooManyFailures

    # ---------------------------------------------------------------- asking
    try:
        hit = None
        for item in session.pending():
            # A bounded window keeps memory flat however many items there are.
            while in_flight >= 2 * concurrency - 1:
                in_flight -= 1
                settle(workers.next_done())
            # Checked before each request, against every reply settled so far (all of them
            # with concurrency 1).
            hit = options.limits.reached(session.spent, session.prices)
            if hit is not None:
                break
            workers.submit(item)
            session.sent()
            in_flight += 1
        # Requests already out finish, also after a limit: what they cost is spent.
        while in_flight:
            in_flight -= 1
            settle(workers.next_done())
        if hit is not None:
            raise _LimitHit(*hit)
    except BaseException as e:
        # Requests still out are abandoned, those not yet sent dropped; replies that already
        # came back are kept.
        if control is not None:
            control.abandon()
        workers.stop()
        _keep_finished(workers, session)
        if isinstance(e, KeyboardInterrupt):
            raise session.abort(session.interrupted()) from e
        if isinstance(e, _TooManyFailures):
            raise session.abort(session.stopped(streak)) from None
        if isinstance(e, _LimitHit):
            raise session.abort(session.limit_reached(e.limit, e.why)) from None
        session.abort(e)
        raise

    # ---------------------------------------------------------------- the results
    workers.stop()
    return session.finish()


def _keep_finished(workers: Workers, session: Session) -> None:
    while True:
        try:
            item, reply, error, crash = workers.done.get_nowait()
        except queue.Empty:
            return
        if crash is None and not isinstance(error, Abandoned):
            session.record(item, reply, error)


def run_batched(
    benchmark: Benchmark,
    identity: dict,
    answer_batch: Callable[[list[Item]], list[str]],
    output: str | pathlib.Path,
    batch_size: int = 64,
    options: RunOptions = RunOptions(),
) -> dict:
    """`run` for answerers that work on batches (the CLIP baseline): same files, same resume,
    and a manifest whose "model" is `identity` and whose devices are jax's (they compute here).
    Of `options`, the limit, progress and parse mode apply; replies are kept as they are."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    about = {"model": dict(identity), "request": {"batch_size": batch_size}, "devices": True}
    identity = {**benchmark.identity(), **identity}
    options = dataclasses.replace(options, strip_think=False)
    session = Session(benchmark, identity, output, options, None, about)
    batch: list[Item] = []

    def flush() -> None:
        replies = answer_batch(batch)
        if len(replies) != len(batch):
            raise RuntimeError(f"answered {len(replies)} of a batch of {len(batch)} items")
        session.sent(len(batch))
        for item, reply in zip(batch, replies):
            session.record(item, Reply.of(reply), None)
        batch.clear()

    try:
        for item in session.pending():
            batch.append(item)
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise session.abort(session.interrupted()) from e
        session.abort(e)
        raise
    return session.finish()
