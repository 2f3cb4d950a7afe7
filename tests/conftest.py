"""Test-session setup shared by every test module."""

import pathlib
import sys

# Tests are grouped in one folder per area; a test module may reuse another's helpers and
# fixtures (`from test_clients import ...`), from any folder.
for _area in sorted(pathlib.Path(__file__).parent.iterdir()):
    if _area.is_dir() and not _area.name.startswith((".", "_")):
        sys.path.insert(0, str(_area))

# triton's native library (which torchvision imports through torch._dynamo) crashes the
# process when it is loaded after TensorFlow's; loading the PyTorch references first is safe.
import timm  # noqa: E402, F401
import torchvision  # noqa: E402, F401

import contextlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402

# Tests compile with XLA:CPU's LLVM at -O1, here and in every process they start (children
# inherit the environment): half the compile time of the default (the DETR smoke train step 8.5 s
# against 17.5 s), which is most of what a test of a small model spends. The code XLA emits is
# the same program; values move in the last bits (floating-point contraction), within every
# tolerance. Set before any test touches a backend. Not -O0: on the slower 2-core machine, where
# -O1 compiles that step in 18-19 s, -O0 took 11 s but ran it 1.5-1.9x slower, and the suite's
# tests measured slower (36-39 min against 31), its several-process tests most.
LLVM_O1 = "--xla_backend_optimization_level=1"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LLVM_O1}".strip()

# As `ood_jax.__main__` does for the command line: TensorFlow skips importing Keras, 5 s of the
# import of each worker and of each script a test starts (bench/, `python -c`), on 2 cores.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


# One persistent compilation cache for the whole run, shared by pytest-xdist's workers and the
# processes tests start: most training modules compile the same smoke steps. The cache's file lock
# (JAX takes it only when the cache has a size limit) keeps one process from reading an entry
# another is still writing.
COMPILE_CACHE_DIR = "xla_cache"
COMPILE_CACHE_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_compilation_cache_max_size": 16 << 30,
}


def shared_compile_cache(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.getbasetemp()
    # Each xdist worker's basetemp is a folder of the run's own.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / COMPILE_CACHE_DIR
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """The run's persistent compilation cache, on for one module's training runs, in this process
    and (through the environment) in the processes its tests start."""
    path = str(shared_compile_cache(tmp_path_factory))
    settings = {"jax_compilation_cache_dir": path, **COMPILE_CACHE_SETTINGS}
    saved_config = {name: getattr(jax.config, name) for name in settings}
    saved_environ = {name.upper(): os.environ.get(name.upper()) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    yield path
    for name, value in saved_config.items():
        jax.config.update(name, value)
    for name, value in saved_environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    with contextlib.suppress(Exception):  # private API; only matters to later test modules
        from jax._src import compilation_cache

        compilation_cache.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def module_temp_dirs_removed(request, tmp_path_factory):
    """Removes what a module's fixtures made with tmp_path_factory once the module is done, unless
    one of its tests failed: pytest's retention policy only reaches per-test tmp_path, and the
    training runs module fixtures keep would otherwise fill a CI disk by the end of the suite."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before:
        for path in set(base.iterdir()) - before:
            if path.name == COMPILE_CACHE_DIR:  # the run's, not the module's
                continue
            if path.is_symlink():  # pytest's NAMEcurrent link to a test's directory
                path.unlink()
            else:
                shutil.rmtree(path, onerror=_warn_not_removed)


def _warn_not_removed(function, path, excinfo) -> None:
    # A file a module's process still writes may refuse removal; that is no test failure, but
    # the disk it keeps should show in the summary rather than go unnoticed.
    warnings.warn(f"could not remove {path}: {excinfo[1]}", stacklevel=1)
