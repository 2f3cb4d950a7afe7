"""Resuming a workdir: its config must be the one its checkpoints were trained with, the newest
checkpoint that restores is used, and Ctrl-C keeps the step training reached."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from ood_jax.train import checkpoint, config_checks

# The config the workdir's checkpoints were trained with.
CONFIG_FILE = "config.json"


def check_workdir_config(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, ckpt: checkpoint.Checkpointer
) -> None:
    """Refuses a workdir whose checkpoints were trained with another config, naming each changed
    field (`config_checks.check_resume`); says which changes allow_config_change let through,
    and which free ones change what is computed (`config_checks.resume_notes`: the dtype).

    A workdir without checkpoints has nothing to resume, so its config.json is simply replaced.
    """
    path = workdir / CONFIG_FILE
    if ckpt.latest_step() is None or not path.is_file():
        return
    try:
        stored = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: not the JSON config ood-jax writes ({e}); put back the config the "
            "checkpoints were trained with, or use a fresh --workdir"
        ) from None
    allowed = config_checks.check_resume(stored, config, workdir)
    if not jax.process_index() == 0:
        return
    if allowed:
        print(
            f"Using {workdir}'s checkpoints with a changed config (config.allow_config_change): "
            + config_checks.describe_changes(allowed),
            flush=True,
        )
    for note in config_checks.resume_notes(stored, config):
        print(f"Using {workdir}'s checkpoints with {note}", flush=True)


def restore_newest(
    ckpt: checkpoint.Checkpointer, abstract_state: Any, then: str
) -> checkpoint.Restored | None:
    """The newest checkpoint that restores into `abstract_state`, saying which newer ones did
    not and where they went; `then` completes that line with what happens next ("resuming
    from", "evaluating step")."""
    return say_moved_aside(ckpt.restore_newest(abstract_state), then)


def say_moved_aside(restored: checkpoint.Restored | None, then: str) -> checkpoint.Restored | None:
    """Prints a line for each newer checkpoint that did not restore; returns `restored`."""
    if restored is not None and jax.process_index() == 0:
        for failed in restored.failed:
            print(
                f"checkpoint {failed.step} could not be restored ({failed.reason}); moved to "
                f"{failed.moved_to}; {then} {restored.step}",
                flush=True,
            )
    return restored


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def keep_on_interrupt(
    ckpt: checkpoint.Checkpointer, state: Any, meta: dict, workdir: pathlib.Path
) -> str:
    """After Ctrl-C in training: saves the step it stopped at, if the state is whole (not
    donated to a step that was cut short) and finite, and says what the workdir keeps."""
    ckpt.wait()  # a save already on its way finishes
    latest = ckpt.latest_step()
    # Several processes save a step together, but each stopped at its own: only a
    # preemption (SIGTERM, multihost.preempted) brings them to the same one.
    alone = jax.process_count() == 1
    if alone and not any(leaf.is_deleted() for leaf in jax.tree.leaves(state)):
        step = int(state.step)
        if step > (latest or 0) and bool(_all_finite(state.params)):
            ckpt.save(step, state, meta, force=True)
            ckpt.wait()
            latest = step
    if latest is None:
        return f"no checkpoint saved in {workdir} yet; rerun the same command to start again"
    return f"checkpoint at step {latest} kept in {workdir}; rerun the same command to continue"
