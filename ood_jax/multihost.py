"""Several processes, one job: joining it, noticing a lost process, and stopping for preemption.

A job is joined (`initialize`) when the environment names one, as `ood-jax launch` does, or when
a config asks for it (`config.distributed`: JAX finds the job in the cluster's own variables).
Each process beats in the coordinator's key-value store and watches the others' beats, so a lost
process is named in one line and the others exit with `LOST_EXIT_CODE`; on SIGTERM every process
saves the same step and exits with `PREEMPTED_EXIT_CODE` (docs/guide/multihost.md).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # JAX's own name for it
NUM_PROCESSES_ENV = "OOD_JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "OOD_JAX_PROCESS_ID"
LOST_AFTER_ENV = "OOD_JAX_LOST_AFTER_S"
DEFAULT_LOST_AFTER_S = 60.0

LOST_EXIT_CODE = 75  # EX_TEMPFAIL: rerunning the same command resumes
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as the shell reports a terminated process
PEER_FAILED_EXIT_CODE = 1

_BEAT_S = 1.0
_KEY = "ood_jax/heartbeat/"
_DONE = "done"
_FAILED = "failed"

_watchdog: _Watchdog | None = None
_barriers = 0  # barriers passed: each gets an id of its own
_exchanges = 0  # every_process calls, likewise
_sigterm = threading.Event()


def initialize(*, cluster: bool = False) -> None:
    """Joins the job the environment names, or with `cluster` the one JAX detects; a single
    process otherwise. Call it before any JAX computation; later calls do nothing."""
    if jax.distributed.is_initialized():
        return
    named = os.environ.get(NUM_PROCESSES_ENV)
    if named is None and not cluster:
        return
    lost_after_s = lost_after_seconds()
    # JAX's heartbeat must outlast the watchdog's, or JAX ends the processes first, with a
    # core dump instead of a line naming the lost process. (Its shutdown barrier keeps its
    # own timeout: processes may take a while to let go of their input pipelines.)
    timeouts = {"heartbeat_timeout_seconds": int(lost_after_s) + 30}
    if named is None:
        jax.distributed.initialize(**timeouts)
    else:
        jax.distributed.initialize(
            coordinator_address=_required(COORDINATOR_ENV),
            num_processes=_integer(NUM_PROCESSES_ENV, minimum=1),
            process_id=_integer(PROCESS_ID_ENV, minimum=0),
            **timeouts,
        )
    if jax.process_count() == 1:
        return
    global _watchdog
    _watchdog = _Watchdog(lost_after_s)
    _watchdog.start()
    # Registered after jax.distributed's own exit handler, so it runs first: a process that
    # ends normally says so before the shutdown barrier, and is never taken for lost.
    atexit.register(_watchdog.stop)


def is_primary() -> bool:
    return jax.process_index() == 0


def barrier(name: str, timeout_s: float = 6 * 3600) -> None:
    """Waits until every process of the job is here; nothing with one process.

    Through the coordination service rather than a collective: a process that reaches a
    program's first collective much later than the others (it compiled instead of reading the
    compilation cache) would fail their collective library's setup, which waits 30 s.
    A lost process ends the wait through the watchdog, hence the long default timeout.
    """
    if _watchdog is None:
        return
    global _barriers
    _barriers += 1
    _watchdog.client.wait_at_barrier(f"ood_jax/{_barriers}/{name}", int(timeout_s * 1000))


def every_process(name: str, value: str, timeout_s: float = 600) -> list[str]:
    """Each process's `value`, in process order, on every process (`[value]` alone): how
    processes check that they agree before work whose collectives need them to (the same
    batches), through the coordination service."""
    if _watchdog is None:
        return [value]
    global _exchanges
    _exchanges += 1
    prefix = f"ood_jax/exchange/{_exchanges}/{name}/"
    client = _watchdog.client
    client.key_value_set(prefix + str(_watchdog.me), value)
    timeout_ms = int(timeout_s * 1000)
    return [
        client.blocking_key_value_get(prefix + str(p), timeout_ms) for p in range(_watchdog.count)
    ]


def lost_after_seconds() -> float:
    value = os.environ.get(LOST_AFTER_ENV)
    if value is None:
        return DEFAULT_LOST_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{LOST_AFTER_ENV}={value!r}: expected a positive number of seconds")
    return seconds


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"{NUM_PROCESSES_ENV} is set, so {name} must name the coordinator")
    return value


def _integer(name: str, minimum: int) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


# ------------------------------------------------------------------------------------------------
# Lost processes.
# ------------------------------------------------------------------------------------------------
# JAX stops every process with a fatal error when the coordinator (process 0) is lost, but when
# another process dies the others see a failed collective at once, or nothing at all while they
# read data, and JAX's own heartbeat ends them only after its timeout, with a core dump.


class _Watchdog(threading.Thread):
    """Beats every second in the coordinator's key-value store and reads the others' beats."""

    def __init__(self, lost_after_s: float):
        super().__init__(name="ood-jax-watchdog", daemon=True)
        from jax._src import distributed  # the client JAX connected; no public accessor

        self.client = distributed.global_state.client
        self.lost_after_s = lost_after_s
        self.me, self.count = jax.process_index(), jax.process_count()
        self.verdict = threading.Event()
        self.line = ""
        self._stopped = threading.Event()

    def run(self) -> None:
        beat = 0
        seen = {p: ("", time.monotonic()) for p in range(self.count) if p != self.me}
        while not self._stopped.wait(_BEAT_S):
            beat += 1
            self.client.key_value_set(_KEY + str(self.me), str(beat), allow_overwrite=True)
            now = time.monotonic()
            for process, (last, since) in seen.items():
                try:
                    value = self.client.key_value_try_get(_KEY + str(process))
                # A process that has not beaten yet has no key; one that never does (or whose key
                # cannot be read) goes unseen past lost_after_s and is named lost below.
                except Exception:
                    value = ""
                if value == _DONE:
                    continue
                if value == _FAILED and not self._stopped.is_set():
                    self._end(
                        f"error: process {process} of {self.count} failed (its error is above); "
                        f"process {self.me} stops too",
                        PEER_FAILED_EXIT_CODE,
                    )
                    return
                if value != last:
                    seen[process] = (value, now)
                elif now - since > self.lost_after_s and not self._stopped.is_set():
                    self._end(
                        f"error: process {process} of {self.count} is lost (no heartbeat for "
                        f"{now - since:.0f} s); process {self.me} stops too. The workdir keeps "
                        "its newest checkpoint: rerun the same command on every process to resume",
                        LOST_EXIT_CODE,
                    )
                    return

    def _end(self, line: str, code: int) -> None:
        self.line = line
        self.verdict.set()
        # From this thread: the main thread may be anywhere, a collective included.
        _exit_now(line, code)

    def stop(self, failed: bool = False) -> None:
        """Tells the others this process ended: normally, or `failed` (they stop too)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            value = _FAILED if failed else _DONE
            self.client.key_value_set(_KEY + str(self.me), value, allow_overwrite=True)
        except Exception as error:  # the coordinator is gone: nothing to tell it
            print(
                f"warning: could not tell the coordinator this process ended: {error}",
                file=sys.stderr,
            )


def _exit_now(line: str | None, code: int) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not sys.exit: JAX's exit handler would wait at a shutdown barrier for processes that
    # are lost, or that go on to a collective this one never joins.
    os._exit(code)


def exit_failed(line: str | None, code: int) -> None:
    """Ends a process of several that failed (after `line`, with exit `code`), telling the
    others, which stop naming it rather than wait for it in their next collective. Returns
    when the process is alone: its caller ends it as usual."""
    if _watchdog is None:
        return
    _watchdog.stop(failed=True)
    if _watchdog.me == 0:
        # The coordinator's end ends the others' JAX too: first let their watchdogs read why.
        time.sleep(3 * _BEAT_S)
    _exit_now(line, code)


def stop_if_lost(error: BaseException) -> None:
    """After `error` in the main thread of a job of several processes: when it is a failed
    collective (a peer died mid-step), waits for the watchdog to name the lost process and
    exits saying so. Returns when no process is lost, so `error` is reported as usual."""
    if _watchdog is not None and isinstance(error, jax.errors.JaxRuntimeError):
        # The watchdog's thread ends the process when it names the lost one.
        _watchdog.verdict.wait(_watchdog.lost_after_s + 5 * _BEAT_S)


# ------------------------------------------------------------------------------------------------
# Preemption.
# ------------------------------------------------------------------------------------------------
# SLURM and TPU maintenance send SIGTERM. With several processes, JAX's preemption sync point
# tells every process the same step at which to save; one process alone catches SIGTERM itself.


@contextlib.contextmanager
def catching_preemption() -> Iterator[None]:
    """Within it SIGTERM asks for a save (`preempted`) rather than ending the process.

    JAX's preemption service catches SIGTERM in a job of several processes; one process alone
    catches it here, and a SIGTERM no step answered is raised again on the way out. Only the
    main thread may set a handler: called from another thread, nothing changes.
    """
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    _sigterm.clear()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _sigterm.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if _sigterm.is_set():
            _sigterm.clear()
            os.kill(os.getpid(), signal.SIGTERM)


class Preempted(Exception):
    """Training saved the step at which SIGTERM stopped it; the message says so."""


def preempted(step: int) -> bool:
    """Whether the run should save `step` and stop because SIGTERM arrived: on every process
    the same step (JAX's preemption sync point, which each process must ask at every step)."""
    if jax.process_count() > 1:
        return multihost_utils.reached_preemption_sync_point(step)
    if _sigterm.is_set():
        _sigterm.clear()  # answered: `catching_preemption` raises it no more
        return True
    return False


def preempted_line(step: int, workdir: os.PathLike | str) -> str:
    return (
        f"preempted: SIGTERM received; step {step} is saved in {workdir} on every process. "
        "Rerun the same command to resume"
    )
