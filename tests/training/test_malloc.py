"""ood_jax.malloc: when the entry points restart, that the restarted process really reuses freed
memory instead of faulting it in again, and that its children start with the user's environment."""

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
    "started_with": malloc.start_environ().get("GLIBC_TUNABLES", ""),
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


def test_start_environ_reads_tunables_split_by_glibc(tmp_path, monkeypatch):
    environ = tmp_path / "environ"
    environ.write_bytes(
        b"A=1\0GLIBC_TUNABLES=glibc.malloc.mmap_max=0\0glibc.malloc.arena_max=1\0B=x=y\0"
    )
    monkeypatch.setattr(malloc, "START_ENVIRON_FILE", environ)
    assert malloc.start_environ() == {
        "A": "1",
        "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1",
        "B": "x=y",
    }


def _child(env_update):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", malloc.OPT_OUT_ENV)
    }
    env.update(env_update)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "--flag", "x y"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out), env


ON_GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


@ON_GLIBC
def test_restarted_process_reuses_freed_pages():
    pages = (256 << 20) // 4096
    kept, env = _child({"GLIBC_TUNABLES": "glibc.rtld.nns=8"})
    started_with = malloc.parse_tunables(kept["started_with"])
    assert started_with.items() >= malloc.KEEP_FREED.items()
    assert started_with["glibc.rtld.nns"] == "8"
    assert "keeping freed memory" in kept["malloc"]
    assert kept["tunables"] == "glibc.rtld.nns=8"  # the user's again, for children
    assert kept["argv"] == ["--flag", "x y"]  # arguments survive the restart
    assert kept["faults"] < pages // 100, kept["faults"]
    # A reference child gets the environment the process started with, and glibc's default.
    assert kept["default_environ"] == {**env, "OOD_JAX_MALLOC": "system"}

    default, env = _child({"OOD_JAX_MALLOC": "system"})
    assert default["tunables"] == default["started_with"] == ""
    assert "glibc's default" in default["malloc"]
    # What the restart saves: every page faulted in again.
    assert default["faults"] > pages // 2, default["faults"]
    assert default["default_environ"] == env


# `python SCRIPT COMMAND...` through `ood_jax.__main__.main`, with `ood_jax.cli` replaced by
# `run` (the real CLI only adds seconds of imports): it prints the malloc the process runs on,
# its os.environ, and the environments a subprocess and a multiprocessing (spawn) child start
# with. PREPARE is code run before main.
ENTRY = r"""
import json, multiprocessing, os, subprocess, sys, types
import ood_jax
from ood_jax import __main__ as entry, malloc
INTERPRETER = sys.executable  # for the spawned child, whatever PREPARE does

def environ():
    return dict(os.environ)

def run():
    child = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout.decode()
    spawn = multiprocessing.get_context("spawn")
    spawn.set_executable(INTERPRETER)
    with spawn.Pool(1) as pool:
        spawned = pool.apply(environ)
    print(json.dumps({
        "malloc": malloc.describe(), "environ": environ(),
        "child": dict(item.split("=", 1) for item in child.split("\0") if item),
        "spawned": spawned,
    }))

if __name__ == "__main__":
    ood_jax.cli = sys.modules["ood_jax.cli"] = types.ModuleType("ood_jax.cli")
    ood_jax.cli.main = run
    PREPARE
    entry.main()
"""


def _users_environ(tunables: str | None) -> dict[str, str]:
    """An environment under which ood-jax would restart, as a user on a CPU machine starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.pop("OOD_JAX_MALLOC", None)
    env["JAX_PLATFORMS"] = "cpu"
    # What `__main__` sets for TensorFlow and Python's locale coercion (PEP 538) would add
    # for every Python child: given here, so that any difference is the restart's.
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", TF_USE_LEGACY_KERAS="1")
    env["PYTHONCOERCECLOCALE"] = "0"
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return env


def _entry(tmp_path, args, env, prepare="pass"):
    script = tmp_path / "entry.py"
    script.write_text(ENTRY.replace("PREPARE", prepare))
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@ON_GLIBC
@pytest.mark.parametrize("tunables", [None, "glibc.rtld.nns=8"])
def test_children_of_a_restarted_command_get_the_users_environment(tmp_path, tunables):
    """`ood-jax train` runs on the tuned malloc itself; whatever it starts (a shell, a
    multiprocessing or Beam worker, a server) runs on the malloc the user chose."""
    env = _users_environ(tunables)
    out, stderr = _entry(tmp_path, ["train", "--config", "x.py"], env)
    assert "keeping freed memory" in out["malloc"], out["malloc"]
    assert out["environ"] == env  # the bookkeeping variable is gone too
    assert out["child"] == env
    assert out["spawned"] == env
    assert stderr == ""


@ON_GLIBC
@pytest.mark.parametrize(
    "args, restarts",
    [
        (["pretrain"], True),
        (["--debug", "evaluate"], True),  # --debug may come first
        (["build", "synthetic_shifts", "--data-dir", "d"], False),
        (["mine", "foci"], False),
        (["eval-mllm", "--help"], False),
        ([], False),
    ],
)
def test_only_commands_of_large_compiled_steps_restart(tmp_path, args, restarts):
    env = _users_environ(None)
    out, _ = _entry(tmp_path, args, env)
    assert ("keeping freed memory" in out["malloc"]) == restarts, out["malloc"]
    assert out["environ"] == out["child"] == env


@ON_GLIBC
def test_a_failed_restart_runs_on_with_one_warning(tmp_path):
    """The restart execs sys.executable again; an interpreter removed or replaced since the
    process started makes that exec fail, and the command runs on as started."""
    env = _users_environ("glibc.rtld.nns=8")
    gone = tmp_path / "gone" / "python"
    out, stderr = _entry(tmp_path, ["train"], env, prepare=f"sys.executable = {str(gone)!r}")
    assert stderr.count("\n") == 1 and stderr.startswith("warning: "), stderr
    assert "No such file or directory" in stderr and str(gone) in stderr
    assert "glibc's default" in out["malloc"], out["malloc"]
    assert out["environ"] == out["child"] == out["spawned"] == env


@pytest.mark.slow  # imports the whole CLI
def test_restarting_commands_are_commands():
    from ood_jax import __main__ as entry
    from ood_jax import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert entry.RESTARTS <= set(sub.choices)
    assert entry.command(["ood-jax", "--debug", "train", "--debug"]) == "train"
    assert entry.command(["ood-jax"]) is None
