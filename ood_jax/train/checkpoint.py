"""Orbax checkpoints of a training run: periodic, the last N kept, restored already sharded.

The train state is a pytree (params, optimizer state, step, ...). The input pipeline is a pure
function of (seed, step), so the step alone tells a resumed run where the data continues.

A checkpoint that cannot be read (a truncated or damaged file) is not the end of a run: the
newest one that restores is used, and the unreadable newer ones are moved out of orbax's sight
into `checkpoints_failed/`, where they can still be inspected. One whose arrays have other
shapes than the run's state is not damaged but from another config: that is an error, and
nothing is moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from ood_jax import multihost

FAILED_DIR = "checkpoints_failed"


class CheckpointError(ValueError):
    """No checkpoint of a workdir restores, or one holds a state of other shapes than the run's."""


@dataclasses.dataclass(frozen=True)
class Failed:
    """A checkpoint that did not restore and was moved aside."""

    step: int
    reason: str
    moved_to: pathlib.Path


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict
    failed: tuple[Failed, ...]  # newer checkpoints that did not restore, moved aside


class Checkpointer:
    def __init__(self, workdir: str | pathlib.Path, *, every_steps: int, keep: int = 3):
        workdir = pathlib.Path(workdir).absolute()
        self.directory = workdir / "checkpoints"
        self.failed_directory = workdir / FAILED_DIR
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=every_steps, max_to_keep=keep, create=True
            ),
            # Handlers named up front (not only item names), so that a checkpoint's array
            # metadata can be read before any restore is tried (`saved_shapes`).
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

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

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{array name: (shape, dtype)} of checkpoint `step`'s state, read from its metadata."""
        tree = self._manager.item_metadata(step)["state"]
        if tree is None:
            raise FileNotFoundError(f"checkpoint {step} in {self.directory} has no state")
        return {leaf.name: (tuple(leaf.shape), leaf.dtype) for leaf in jax.tree.leaves(tree)}

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores into the shapes, dtypes and shardings of `abstract_state`.

        Reads the stored bytes once first (`_check_files`), so that a damaged checkpoint fails
        with one error. Raises CheckpointError naming the arrays when the saved shapes are not
        the state's: orbax's own error for that is a traceback advising `strict=False`, which
        would pad or truncate the weights.
        """
        _check_files(self.directory / str(step) / "state")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
        )
        with _quiet_aborted_reads():
            _check_shapes(step, self.directory, self.saved_shapes(step), abstract_state)
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        return restored.state, restored.meta

    def restore_variables(self, step: int) -> tuple[dict[str, Any], dict]:
        """(variables, meta) of checkpoint `step` for inference, as host numpy arrays: the
        params (ema_params where the run kept them, as evaluation uses them) and model_state.
        Neither the optimizer nor the training mesh is rebuilt."""
        _check_files(self.directory / str(step) / "state")
        # A PyTree handler of its own: it restores part of the state without a target.
        reader = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(create=False),
            item_names=("state", "meta"),
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        try:
            with _quiet_aborted_reads():
                tree = reader.item_metadata(step)["state"].tree
                params = "ema_params" if "ema_params" in tree else "params"
                wanted = {key: tree[key] for key in (params, "model_state")}
                as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
                restored = reader.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(
                            item=wanted, restore_args=as_numpy, partial_restore=True
                        ),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
        finally:
            reader.close()
        state = restored.state
        return {"params": state[params], **state["model_state"]}, restored.meta

    def restore_newest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that restores; None when there is none at all.

        Newer ones that fail are moved to `checkpoints_failed/` only once an older one has
        restored: if none does, the cause is more likely this program or its environment than
        every file at once, so all are left where they are and CheckpointError lists them.
        """
        return self._newest_restored(lambda step: self.restore(step, abstract_state))

    def restore_newest_variables(self) -> Restored | None:
        """`restore_newest` for `restore_variables`: the state restored is the variables."""
        return self._newest_restored(self.restore_variables)

    def _newest_restored(self, restore: Callable[[int], tuple[Any, dict]]) -> Restored | None:
        failures: list[tuple[int, str]] = []
        last_error: Exception | None = None
        for step in reversed(self.all_steps()):
            try:
                state, meta = restore(step)
            except CheckpointError:
                raise
            # A damaged checkpoint surfaces as whatever its reader raises (JSON, TensorStore,
            # orbax, OS errors); each is reported by step and reason, none is dropped.
            except Exception as error:
                failures.append((step, short_reason(error)))
                last_error = error
                continue
            failed = tuple(Failed(s, reason, self._move_aside(s)) for s, reason in failures)
            if failed:
                self._manager.reload()
            return Restored(step=step, state=state, meta=meta, failed=failed)
        if not failures:
            return None
        listed = "; ".join(f"step {s}: {reason}" for s, reason in failures)
        raise CheckpointError(
            f"no checkpoint in {self.directory} could be restored ({listed}); they are left "
            "as they are: --debug shows the traceback, a fresh --workdir starts over"
        ) from last_error

    def _move_aside(self, step: int) -> pathlib.Path:
        """Moves checkpoint `step` into `checkpoints_failed/`, where orbax does not look."""
        target = self.failed_directory / str(step)
        suffix = 1
        while target.exists():  # the same step failed before (and was trained again)
            suffix += 1
            target = self.failed_directory / f"{step}.{suffix}"
        if jax.process_index() == 0:
            self.failed_directory.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        # Every process restores from the same directory: none goes on before it is moved.
        multihost.barrier(f"checkpoint {step} moved aside")
        return target

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def short_reason(error: BaseException) -> str:
    """The innermost cause of `error`, on one line and at most 200 characters: TensorStore's
    messages carry its whole spec after the part that says what is wrong."""
    root = error
    while True:
        inner = root.__cause__ or (None if root.__suppress_context__ else root.__context__)
        if inner is None:
            break
        root = inner
    text = " ".join(str(root).split()) or "no message"
    text = f"{type(root).__name__}: {text}"
    return text if len(text) <= 200 else text[:197] + "..."


def _is_echo(unraisable: Any) -> bool:
    value, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    closed_loop = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
    return closed_loop or (code is not None and "orbax" in code.co_filename)


@contextlib.contextmanager
def _quiet_aborted_reads(settle_s: float = 0.5, limit_s: float = 10.0):
    """Keeps the echoes of a failed restore off stderr; the failure itself is raised as usual.

    Orbax reads a checkpoint's arrays in parallel on an event loop that it closes as soon as
    one read fails (`_check_files` finds most damage before that, not a file whose bytes decode
    wrongly). Each read still in flight then completes into the closed loop: TensorStore
    reports `RuntimeError: Event loop is closed` and the abandoned coroutine its copy of the
    failure, each through sys.unraisablehook, some only when the interpreter exits: hundreds of
    tracebacks for one damaged file. After a failure, those two kinds stay filtered for the
    rest of the process; every other unraisable exception goes to the hook as before.
    """
    last_echo = [time.monotonic()]
    previous = sys.unraisablehook

    def on_unraisable(unraisable: Any) -> None:
        if _is_echo(unraisable):
            last_echo[0] = time.monotonic()
        else:
            previous(unraisable)

    sys.unraisablehook = on_unraisable
    try:
        yield
    except Exception:
        started = last_echo[0] = time.monotonic()
        while time.monotonic() - started < limit_s:
            gc.collect()
            if time.monotonic() - last_echo[0] >= settle_s:
                break
            time.sleep(0.05)
        raise
    else:
        sys.unraisablehook = previous


def _check_files(state_directory: pathlib.Path, batch: int = 64) -> None:
    """Reads every stored value of an OCDBT checkpoint once, a batch of keys at a time, and
    raises the first read that fails.

    Orbax reads all arrays at once, and one failed read (a truncated file) leaves the others
    in flight on an event loop it has closed: each then prints a traceback, hundreds to
    thousands of lines for one damaged file, some at interpreter exit. Read here first, the
    damage is found without that, and the files are in the page cache for the restore.
    """
    if not (state_directory / "manifest.ocdbt").exists():
        return  # not an OCDBT checkpoint: orbax reads it file by file
    spec = {"driver": "ocdbt", "base": f"file://{state_directory.absolute()}/"}
    store = ts.KvStore.open(spec).result()
    keys = store.list().result()
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        for key, read in zip(chunk, [store.read(key) for key in chunk]):
            try:
                read.result()
            except ValueError as e:  # TensorStore's errors are ValueErrors naming no array
                array = key.decode(errors="replace").split("/")[0]
                raise ValueError(f"array {array}: {e}") from None


def _names_and_shapes(abstract_state: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype)} with orbax's names: the path's keys, attributes and indices
    joined by dots (e.g. `opt_state.1.inner_states.transformer.inner_state.0.mu.encoder...`)."""

    def part(key: Any) -> str:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                return str(getattr(key, attribute))
        raise TypeError(f"unexpected pytree key {key!r}")

    return {
        ".".join(part(k) for k in path): (tuple(leaf.shape), leaf.dtype)
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state)
    }


def _check_shapes(step: int, directory: pathlib.Path, saved: dict, abstract_state: Any) -> None:
    expected = _names_and_shapes(abstract_state)
    # Parameters first: they say what changed; their optimizer moments repeat it.
    names = sorted(saved.keys() | expected.keys(), key=lambda n: (not n.startswith("params."), n))
    differences = [
        f"{name} {_describe(saved.get(name), expected.get(name))}"
        for name in names
        if saved.get(name) != expected.get(name)
    ]
    if not differences:
        return
    shown = ", ".join(differences[:3])
    more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
    raise CheckpointError(
        f"checkpoint {step} in {directory} holds a train state of other shapes than this "
        f"config builds ({shown}{more}): it was trained with another model config; use a "
        "fresh --workdir, or the config it was trained with"
    )


def _describe(saved: tuple | None, expected: tuple | None) -> str:
    """`[32] -> [64]`, `float32 -> bfloat16`, or `(absent) -> [64]`."""
    if saved is None or expected is None or saved[0] != expected[0]:
        return f"{_shape(saved)} -> {_shape(expected)}"
    return f"{saved[1]} -> {expected[1]}"


def _shape(shape_and_dtype: tuple | None) -> str:
    return "(absent)" if shape_and_dtype is None else str(list(shape_and_dtype[0]))
