"""Steps compiled before their first call, so that a long compile says what it is."""

from __future__ import annotations

import time
from collections.abc import Callable

from ood_jax import multihost


class CompiledOnFirstCall:
    """A jitted function compiled ahead of its first call, saying so on process 0.

    The first call of a detector's train or predict step compiles for tens of seconds on CPU
    (minutes for large models), which otherwise looks like a hang. Later calls run the
    compiled program; arguments of other shapes or shardings than the first call's are an
    error there rather than a silent recompilation.
    """

    def __init__(self, jitted: Callable, what: str):
        self._jitted, self.what = jitted, what
        self._compiled: Callable | None = None
        self.compile_seconds = 0.0

    def __call__(self, *args):
        if self._compiled is None:
            if multihost.is_primary():
                print(f"compiling the {self.what} ...", flush=True)
            started = time.perf_counter()
            self._compiled = self._jitted.lower(*args).compile()
            # Every process starts running it together (see multihost.barrier).
            multihost.barrier(f"compiled the {self.what}")
            self.compile_seconds = time.perf_counter() - started
            if multihost.is_primary():
                print(f"compiled the {self.what} in {self.compile_seconds:.1f} s", flush=True)
        return self._compiled(*args)
