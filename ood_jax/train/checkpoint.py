"""Orbax checkpoints of a training run: periodic, the last N kept, restored already sharded.

The train state is a pytree (params, optimizer state, step, ...). The input pipeline is a pure
function of (seed, step), so the step alone tells a resumed run where the data continues.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, workdir: str | pathlib.Path, *, every_steps: int, keep: int = 3):
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=every_steps, max_to_keep=keep, create=True
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would save without `force`."""
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Saves if `step` is due (or `force`); returns whether a save started."""
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores into the shapes, dtypes and shardings of `abstract_state`."""
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
        )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, restored.meta

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
