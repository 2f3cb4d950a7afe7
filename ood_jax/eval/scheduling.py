"""Request scheduling: worker threads that answer jobs, and the streak of failures that stops a
run."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ood_jax.eval.clients import ClientError, Reply, Request

# Enough to tell a server that fails every request from one that fails now and then, few
# enough that a misspelled model costs seconds.
DEFAULT_MAX_CONSECUTIVE_FAILURES = 5


class Client(Protocol):
    """What the runner asks: `generate` returns a clients.Reply or the reply text, and raises
    clients.ClientError for a request that failed. A client with `accepts_run_control` true
    takes the run's RunControl as `generate(request, control)`."""

    def identity(self) -> dict: ...

    def generate(self, request: Request) -> Reply | str: ...


class RunStopped(RuntimeError):
    """Items in a row failed with the same kind of error, so the run stopped; every reply
    received is kept. `kind`: that kind ("HTTP 500", "timeout", ...); `error`: the last one's
    message; `kept`: the replies the predictions file holds."""

    def __init__(self, message: str, kind: str, error: str, kept: int):
        super().__init__(message)
        self.kind, self.error, self.kept = kind, error, kept


class LimitReached(RunStopped):
    """A limit of this invocation (--max-requests, --max-cost: `kind`) stopped the run before
    its next request; every reply received is kept, and a rerun continues."""


class Streak:
    """Items in a row whose requests failed with the same kind of error."""

    def __init__(self, limit: int):
        self.limit, self.kind, self.count, self.last = limit, None, 0, ""

    def add(self, error: ClientError | None) -> bool:
        """Counts one finished item; True when the run should stop."""
        if error is None:
            self.kind, self.count = None, 0
            return False
        if error.kind != self.kind:
            self.kind, self.count = error.kind, 0
        self.count += 1
        self.last = str(error)
        return 0 < self.limit <= self.count


class Workers:
    """`size` daemon threads answering jobs (items, or the judge's questions); (job, answer,
    error, crash) come back on `done`, from `ask(job)` -> (answer, error).

    Daemon threads, unlike ThreadPoolExecutor's (joined when the interpreter exits), let Ctrl-C
    end the process while a request is still out; `stop` also keeps them from taking more.
    """

    def __init__(self, size: int, ask: Callable[[Any], tuple[Any, ClientError | None]]):
        self._ask, self._size = ask, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        for k in range(size):
            threading.Thread(target=self._work, name=f"eval-mllm-{k}", daemon=True).start()

    def submit(self, job: Any) -> None:
        self._jobs.put(job)

    def next_done(self) -> tuple:
        # A timeout keeps the main thread where a signal can reach it on every platform.
        while True:
            try:
                return self.done.get(timeout=0.5)
            except queue.Empty:
                continue

    def stop(self) -> None:
        self._stopped.set()
        for _ in range(self._size):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopped.is_set():
                return
            try:
                answer, error = self._ask(job)
            # Whatever stops a call (a KeyboardInterrupt or SystemExit raised in this thread too)
            # goes to the main thread, which keeps the replies that arrived alongside.
            except BaseException as crash:
                # The run is over: no worker takes another job (one already queued would be
                # asked, and its reply never recorded).
                self._stopped.set()
                self.done.put((job, None, None, crash))
            else:
                self.done.put((job, answer, error, None))
