"""Lets every process of a test job write JAX's persistent compilation cache, not only process 0.

JAX writes cache entries from process 0 alone (many writers contend on shared filesystems), and
on CPU the other processes' cache keys are not process 0's (they hash each process's own
devices), so without this process 1 compiled every step again in every launch of a test job
while process 0 waited for it at the first collective. Put on PYTHONPATH by the multi-process
tests only. It wraps a private JAX function once `jax._src.compiler` is imported, and leaves
JAX as it is if that function is not there.
"""

import importlib.abc
import importlib.util
import sys


def _every_process_writes(compiler) -> None:
    from jax._src import compilation_cache, config, distributed

    write_from_process_0 = getattr(compiler, "_cache_write", None)
    if write_from_process_0 is None:
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, callbacks):
        if (
            distributed.global_state.process_id == 0
            or callbacks
            or compile_time_secs < config.persistent_cache_min_compile_time_secs.value
        ):
            return write_from_process_0(
                cache_key, compile_time_secs, module_name, backend, executable, callbacks
            )
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs)
        )

    compiler._cache_write = cache_write


class _PatchCompilerOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _every_process_writes(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchCompilerOnImport())
