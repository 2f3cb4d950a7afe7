"""ood_jax.malloc: when the entry points restart, and that the restarted process really reuses
freed memory instead of faulting it in again."""

import json
import os
import platform
import subprocess
import sys

import pytest

from ood_jax import malloc

GLIBC = ("glibc", "2.36")

# Touches a 256 MiB malloc'd block, frees it, mallocs and touches it again, and prints the minor
# page faults of the second touch (one per 4 KiB page unless the pages were kept).
CHILD = r"""
import ctypes, json, os, resource, sys
from ood_jax import malloc
malloc.restart_keeping_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 256 << 20
def touch():
    block = libc.malloc(ctypes.c_size_t(size))
    ctypes.memset(block, 1, size)
    return block
libc.free(ctypes.c_void_p(touch()))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.free(ctypes.c_void_p(touch()))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({
    "faults": faults, "tunables": os.environ.get("GLIBC_TUNABLES", ""), "argv": sys.argv[1:],
    "malloc": malloc.describe(), "default_environ": malloc.default_environ(),
}))
"""


def test_restart_sets_what_keeps_freed_memory():
    tunables = malloc.restart_tunables({}, GLIBC, "madvise", True)
    assert malloc.parse_tunables(tunables) == {**malloc.KEEP_FREED, **malloc.HUGE_PAGES}


def test_huge_pages_only_asked_for_in_madvise_mode_and_recent_glibc():
    for mode in ("always", "never", None):
        assert (
            malloc.parse_tunables(malloc.restart_tunables({}, GLIBC, mode, True))
            == malloc.KEEP_FREED
        )
    old = malloc.restart_tunables({}, ("glibc", "2.31"), "madvise", True)
    assert malloc.parse_tunables(old) == malloc.KEEP_FREED


def test_users_tunables_are_kept_and_completed():
    environ = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.rtld.nns=8"}
    tunables = malloc.parse_tunables(malloc.restart_tunables(environ, GLIBC, "never", True))
    assert tunables["glibc.malloc.arena_max"] == "4"
    assert tunables["glibc.rtld.nns"] == "8"
    assert tunables["glibc.malloc.mmap_max"] == "0"


@pytest.mark.parametrize(
    "environ, libc",
    [
        ({"OOD_JAX_MALLOC": "system"}, GLIBC),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, GLIBC),
        ({"LD_PRELOAD": "libfoo.so libtcmalloc_minimal.so.4"}, GLIBC),
        ({}, ("", "")),  # musl, macOS
        ({"GLIBC_TUNABLES": malloc.restart_tunables({}, GLIBC, "madvise", True)}, GLIBC),
    ],
)
def test_no_restart(environ, libc):
    assert malloc.restart_tunables(environ, libc, "madvise", True) is None


def test_no_restart_when_jax_computes_on_an_accelerator():
    assert malloc.restart_tunables({}, GLIBC, "madvise", on_cpu=False) is None
    assert not malloc.computes_on_cpu({"JAX_PLATFORMS": "cuda,cpu"})
    assert malloc.computes_on_cpu({"JAX_PLATFORMS": "cpu"})


def _child(env_update):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(env_update)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "--flag", "x y"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out), env


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_restarted_process_reuses_freed_pages():
    pages = (256 << 20) // 4096
    kept, env = _child({"GLIBC_TUNABLES": "glibc.rtld.nns=8"})
    assert malloc.parse_tunables(kept["tunables"]).items() >= malloc.KEEP_FREED.items()
    assert "glibc.rtld.nns=8" in kept["tunables"]
    assert "keeping freed memory" in kept["malloc"]
    assert kept["argv"] == ["--flag", "x y"]  # arguments survive the restart
    assert kept["faults"] < pages // 100, kept["faults"]
    # A reference child gets the environment the process started with, and glibc's default.
    assert kept["default_environ"] == {**env, "OOD_JAX_MALLOC": "system"}

    default, env = _child({"OOD_JAX_MALLOC": "system"})
    assert default["tunables"] == "" and "glibc's default" in default["malloc"]
    # What the restart saves: every page faulted in again.
    assert default["faults"] > pages // 2, default["faults"]
    assert default["default_environ"] == env


@pytest.mark.slow
def test_entry_point_restarts(tmp_path):
    """`ood-jax` itself runs under the tunables (checked through the child's environment)."""
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "from ood_jax import __main__ as entry, cli\n"
        "cli.main = lambda: print(os.environ.get('GLIBC_TUNABLES', ''))\n"
        "entry.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    expected = malloc.restart_tunables(
        env, platform.libc_ver(), malloc.thp_mode(), malloc.computes_on_cpu(env)
    )
    assert out == (expected or "")
