"""CPU seconds of each test, its own process's and its children's (the processes it started and
waited for), as a pytest plugin; and a per-module summary of what it recorded.

On 2 busy cores the suite's length follows its CPU time, which per-test wall times hide: a test
that starts two processes shows its wall time, not the two cores it kept busy.

    PYTHONPATH=tools CPU_PER_TEST_DIR=/tmp/cpu python -m pytest -n 2 --dist loadfile \\
        -p cpu_per_test tests
    python tools/cpu_per_test.py /tmp/cpu
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import resource
import sys
import time

import pytest

DIR_ENV = "CPU_PER_TEST_DIR"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _directory() -> pathlib.Path:
    return pathlib.Path(os.environ.get(DIR_ENV, "cpu_per_test"))


def pytest_configure(config):
    """An earlier run's records would be summed with this run's: the controlling process (not an
    xdist worker, which starts after it) removes them before any test runs."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        for path in _directory().glob("*.jsonl"):
            path.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.time()
    yield
    record = {
        "id": item.nodeid,
        "wall": time.time() - wall,
        "own": _cpu(resource.RUSAGE_SELF) - own,
        "children": _cpu(resource.RUSAGE_CHILDREN) - children,
    }
    directory = _directory()
    directory.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(directory / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def summarize(directory: pathlib.Path, top: int = 30) -> None:
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:  # a worker killed while writing
                raise SystemExit(f"{path}:{number}: not a record ({e})") from None
    if not records:
        raise SystemExit(f"{directory}: no records (was the plugin loaded with -p cpu_per_test?)")
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in records:
        totals = modules[r["id"].split("::")[0]]
        totals[0] += r["own"]
        totals[1] += r["children"]
        totals[2] += r["wall"]
    own, children = sum(t[0] for t in modules.values()), sum(t[1] for t in modules.values())
    print(
        f"{len(records)} tests: {own + children:.0f} CPU-s ({own:.0f} own, {children:.0f} children)"
    )
    print(f"{'CPU-s':>7} {'own':>6} {'children':>8} {'wall':>6}  module")
    ranked = sorted(modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for module, (o, c, w) in ranked[:top]:
        print(f"{o + c:7.0f} {o:6.0f} {c:8.0f} {w:6.0f}  {module}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    summarize(pathlib.Path(sys.argv[1]))
