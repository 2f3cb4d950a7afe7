"""glibc's malloc set to keep freed memory, for XLA:CPU's per-step buffers.

glibc reads its settings (`GLIBC_TUNABLES`) only when a process starts, so the `ood-jax` commands
that run large compiled steps (`__main__.RESTARTS`) and the benchmarks restart themselves once
with them set (`restart_keeping_freed_memory`): the process then keeps its peak heap until it
exits, as GPU allocators do. The restarted process puts the user's environment back at once, so
its children (subprocesses, multiprocessing, Beam workers) start as the user set them.
`OOD_JAX_MALLOC=system` keeps the process as started; a malloc in `LD_PRELOAD` (jemalloc,
tcmalloc, mimalloc) is left alone, and so is a process that will compute on a GPU or TPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import sys
from collections.abc import Mapping

OPT_OUT_ENV = "OOD_JAX_MALLOC"
OPT_OUT_VALUE = "system"
TUNABLES_ENV = "GLIBC_TUNABLES"
# What GLIBC_TUNABLES was before the restart ("" for unset): set only across the exec, it also
# tells the restarted process that it is one.
BEFORE_ENV = "OOD_JAX_GLIBC_TUNABLES_BEFORE"
# The environment the kernel handed this process at exec, which glibc and ld.so read; later
# changes to os.environ do not reach it.
START_ENVIRON_FILE = pathlib.Path("/proc/self/environ")
THP_MODE_FILE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

# XLA:CPU allocates a step's whole temporary buffer anew on every call (5.6 GB for a DINO train
# step at 320x320, batch 2) and frees it at the end. glibc serves anything above its mmap
# threshold (at most 32 MiB) with its own mmap and unmaps it on free, so each step faults its
# buffer in again, 4 KiB at a time: 1.3M page faults and seconds of kernel time per DINO step,
# more than the step's own arithmetic on two cores. Told never to mmap and never to trim, glibc
# hands the same pages back on the next step instead. The arenas stay as glibc makes them: one
# arena for every thread (arena_max=1) made XLA's compiles 1.4-1.6x slower and a DINO step
# slower too (bench/dino_step.py, 320x320: 4.58 s against 4.31 s; 6.05 s with glibc's default),
# and stalled the teardown of a small run's input pipeline for 15 s.
KEEP_FREED = {
    "glibc.malloc.mmap_max": "0",
    # A size_t tunable: mallopt's int could not say more than 2 GiB, less than one DINO step.
    "glibc.malloc.trim_threshold": str(1 << 40),
}
# With transparent huge pages on request (`madvise` mode): 2 MiB pages, so the first step
# faults 300x less.
HUGE_PAGES = {"glibc.malloc.hugetlb": "1"}
HUGE_PAGES_SINCE = (2, 35)
ACCELERATOR_PLUGINS = ("jax-cuda", "jax-rocm", "libtpu")


def parse_tunables(value: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in value.split(":") if item)
    return {name: setting for name, _, setting in pairs}


def _preloaded_malloc(environ: Mapping[str, str]) -> str | None:
    for path in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        if "malloc" in os.path.basename(path):
            return os.path.basename(path)
    return None


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None if it has none."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def computes_on_cpu(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether JAX will run on the CPU: JAX_PLATFORMS says so, or no GPU/TPU plugin is installed.
    On an accelerator the steps' buffers live in device memory: host memory kept would only be
    held."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    return not any(n.lower().replace("_", "-").startswith(ACCELERATOR_PLUGINS) for n in names)


def restart_tunables(
    environ: Mapping[str, str], libc: tuple[str, str], huge_page_mode: str | None, on_cpu: bool
) -> str | None:
    """The GLIBC_TUNABLES value to restart under, or None when a restart would change nothing.

    `libc` is `platform.libc_ver()`, `on_cpu` `computes_on_cpu()`. Tunables the user set
    already are kept as they are.
    """
    name, version = libc
    opted_out = environ.get(OPT_OUT_ENV) == OPT_OUT_VALUE
    if opted_out or name != "glibc" or _preloaded_malloc(environ) or not on_cpu:
        return None
    present = parse_tunables(environ.get(TUNABLES_ENV, ""))
    wanted = dict(KEEP_FREED)
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if huge_page_mode == "madvise" and parts >= HUGE_PAGES_SINCE:
        wanted.update(HUGE_PAGES)
    missing = {k: v for k, v in wanted.items() if k not in present}
    if not missing:
        return None
    return ":".join(f"{k}={v}" for k, v in {**present, **missing}.items())


# Once per process: after the restart os.environ holds the user's tunables again, and a second
# call must not read that as a process still to restart.
_restart_decided = False


def restart_keeping_freed_memory() -> None:
    """Replaces this process with itself under `restart_tunables` (same pid, arguments and
    environment otherwise); returns when there is nothing to change, in the restarted process,
    or, with one warning, when the restart fails. Call it first thing in an entry point, before
    anything has been allocated, written or started."""
    global _restart_decided
    if _restart_decided:
        return
    _restart_decided = True
    if BEFORE_ENV in os.environ:
        _put_back_users_tunables()  # glibc has read them: the restarted process
        return
    tunables = restart_tunables(os.environ, platform.libc_ver(), thp_mode(), computes_on_cpu())
    if tunables is None:
        return
    os.environ[BEFORE_ENV] = os.environ.get(TUNABLES_ENV, "")
    os.environ[TUNABLES_ENV] = tunables
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except (OSError, ValueError) as e:  # ValueError: no interpreter path (embedded Python)
        # Nothing has changed yet but the environment: run on as started, and say so once.
        _put_back_users_tunables()
        reason = getattr(e, "strerror", None) or str(e)
        print(
            f"warning: no restart to keep freed memory ({reason}: {sys.executable!r}); "
            "running on glibc's default malloc",
            file=sys.stderr,
            flush=True,
        )


def _put_back_users_tunables() -> None:
    """os.environ as the user started the process: children inherit it, and glibc reads
    tunables only at a process's start, so this process keeps the ones it started with."""
    before = os.environ.pop(BEFORE_ENV)
    if before:
        os.environ[TUNABLES_ENV] = before
    else:
        os.environ.pop(TUNABLES_ENV, None)


def start_environ() -> dict[str, str]:
    """The environment this process was started with (what glibc's malloc and ld.so read), or
    os.environ where the system does not show it."""
    try:
        items = START_ENVIRON_FILE.read_bytes().split(b"\0")
    except OSError:
        return dict(os.environ)
    environ: dict[str, str] = {}
    last = None
    for item in map(os.fsdecode, filter(None, items)):
        # glibc (2.36 at least) parses GLIBC_TUNABLES in place, ending each tunable with a NUL
        # where its ':' was: "GLIBC_TUNABLES=a=1:b=2" reads here as "GLIBC_TUNABLES=a=1", "b=2".
        if last == TUNABLES_ENV and item.startswith("glibc."):
            environ[TUNABLES_ENV] += ":" + item
            continue
        last, _, value = item.partition("=")
        environ[last] = value
    return environ


def default_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` for a child process that should run on glibc's default malloc, as it would
    have been without the restart (a benchmark's reference side, measured by its peak RSS).
    The restart has put the user's tunables back already; this only keeps an ood-jax child
    from restarting."""
    return {**environ, OPT_OUT_ENV: OPT_OUT_VALUE}


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The malloc a process started with `environ` runs on, in words, for benchmark headers;
    by default this process's, from the environment it really started with."""
    environ = start_environ() if environ is None else environ
    preloaded = _preloaded_malloc(environ)
    if preloaded:
        return f"{preloaded} (LD_PRELOAD)"
    present = parse_tunables(environ.get(TUNABLES_ENV, ""))
    if all(present.get(k) == v for k, v in KEEP_FREED.items()):
        huge = ", huge pages" if all(present.get(k) == v for k, v in HUGE_PAGES.items()) else ""
        return f"glibc's, keeping freed memory{huge} ({OPT_OUT_ENV}={OPT_OUT_VALUE} for glibc's default)"
    return "glibc's default" if platform.libc_ver()[0] == "glibc" else "the C library's"
