"""Steps compiled before their first call, so that a long compile says what it is."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from ood_jax import multihost


class CompiledOnFirstCall:
    """A jitted function compiled ahead of its first call with each set of argument shapes,
    saying so on process 0.

    The first call of a detector's train or predict step compiles for tens of seconds on CPU
    (minutes for large models), which otherwise looks like a hang. Later calls run the
    compiled program of their shapes: one for most runs, two for the landscape and portrait
    batches of `input.orientation_window`. Arguments of another sharding than the first
    call's of the same shapes are an error there rather than a silent recompilation.
    """

    def __init__(self, jitted: Callable, what: str):
        self._jitted, self.what = jitted, what
        self._compiled: dict[tuple, Callable] = {}
        self.compile_seconds = 0.0  # all compiles together

    def __call__(self, *args):
        shapes = tuple(
            (getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in jax.tree.leaves(args)
        )
        compiled = self._compiled.get(shapes)
        if compiled is None:
            what = self.what + (" for arguments of new shapes" if self._compiled else "")
            if multihost.is_primary():
                print(f"compiling the {what} ...", flush=True)
            started = time.perf_counter()
            compiled = self._compiled[shapes] = self._jitted.lower(*args).compile()
            # Every process starts running it together (see multihost.barrier).
            multihost.barrier(f"compiled the {what}")
            seconds = time.perf_counter() - started
            self.compile_seconds += seconds
            if multihost.is_primary():
                print(f"compiled the {what} in {seconds:.1f} s", flush=True)
        return compiled(*args)
