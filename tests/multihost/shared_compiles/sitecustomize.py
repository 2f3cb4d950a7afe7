"""Lets a CPU test job compile each of its programs once, in process 0, as a GPU or TPU job can.

With `jax_share_binary_between_hosts` (set by the tests' environment), process 0 compiles a
program over several processes' devices and hands the executable to the others through the
coordination service; the others wait for it rather than compile it too. JAX finds the
executable under the persistent cache's key, which on GPU and TPU hashes the job's topology,
the same in every process. On CPU it hashes each process's own topology, so each process looked
for another key: process 1 waited on a key process 0 never set, and without sharing it compiled
every program again on the same two cores. Here the key hashes the devices' kinds instead (the
global device assignment is hashed with the compile options), which every process sees alike;
process 0's executable runs in process 1 as it is (one SPMD program, devices bound at load). Put on PYTHONPATH by the
multi-process tests only; it replaces a private JAX function once `jax._src.cache_key` is
imported, and stops the process if that function is not there (process 1 would otherwise wait
for process 0's program until the sharing's 20-minute timeout).
"""

import importlib.abc
import importlib.util
import sys


def _hash_cpu_devices_alike(cache_key) -> None:
    hash_topology = getattr(cache_key, "_hash_accelerator_config", None)
    hash_devices = getattr(cache_key, "_hash_devices", None)
    if hash_topology is None or hash_devices is None:
        raise ImportError(
            "tests/multihost/shared_compiles: this JAX's cache_key has no _hash_accelerator_config"
            " or _hash_devices; update sitecustomize.py for it"
        )

    def hash_accelerator_config(hash_obj, accelerators):
        if all(device.platform == "cpu" for device in accelerators.flat):
            return hash_devices(hash_obj, accelerators)
        return hash_topology(hash_obj, accelerators)

    cache_key._hash_accelerator_config = hash_accelerator_config


class _PatchCacheKeyOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax._src.cache_key":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _hash_cpu_devices_alike(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchCacheKeyOnImport())
