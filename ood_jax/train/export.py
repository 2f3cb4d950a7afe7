"""Exports a trained detector from a workdir's checkpoint to one self-contained file.

The file is flax.serialization msgpack of one dict (format version 1):

  format_version  1
  model           config.model as a dict: {"name": ..., "args": {...}} for `registry.build_model`
  input           what inference needs of config.input: image_size (the padded canvas side),
                  eval_size (shorter side after resizing), max_size (cap on the longer side),
                  mean and std (per channel, applied to pixels scaled to [0, 1])
  class_names     list of str indexed by label, or None when unknown
  variables       {"params": ..., <other collections, e.g. "batch_stats">: ...} as numpy arrays
  step            the training step of the checkpoint
  model_name      config.model_name, or None

Nothing of the optimizer is read or written. `ood_jax.models.load_exported` reads the file back
and runs it without optax, orbax or TensorFlow.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import serialization

from ood_jax import files
from ood_jax.data import pipeline
from ood_jax.models import EXPORT_FORMAT_VERSION


def _checkpoint_manager(directory: pathlib.Path) -> ocp.CheckpointManager:
    # Explicit handlers let the manager read the items' metadata without a restore target.
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(create=False),
        item_names=("state", "meta"),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )


def restore_inference_state(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, variables, meta) of the newest (or the given) checkpoint of `workdir`.

    Only the params and model_state subtrees of the "state" item are read, as host numpy
    arrays, so neither the optimizer nor the training mesh has to be rebuilt.
    """
    directory = pathlib.Path(workdir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no checkpoints directory; is {workdir} a workdir?")
    manager = _checkpoint_manager(directory)
    try:
        steps = manager.all_steps()
        if not steps:
            raise FileNotFoundError(f"{directory}: no checkpoint")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise FileNotFoundError(f"{directory}: no checkpoint at step {step}; there are {steps}")
        tree = manager.item_metadata(step)["state"].tree
        wanted = {key: tree[key] for key in ("params", "model_state")}
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=wanted,
                    restore_args=jax.tree.map(
                        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted
                    ),
                    partial_restore=True,
                ),
                meta=ocp.args.JsonRestore(),
            ),
        )
    finally:
        manager.close()
    state = restored.state
    return step, {"params": state["params"], **state["model_state"]}, restored.meta


def dataset_class_names(dataset: dict[str, Any]) -> list[str] | None:
    """Label names of a prepared detection dataset, or None when it is not at hand."""
    try:
        import tensorflow_datasets as tfds

        import tfds_builders  # noqa: F401  (registers our builders with TFDS)

        builder = tfds.builder(dataset["name"], data_dir=os.path.expanduser(dataset["data_dir"]))
        if not builder.is_prepared():
            logging.warning("%s is not prepared; exporting without class names", dataset["name"])
            return None
        return list(builder.info.features["objects"]["label"].names)
    # Names are a convenience for users of the file: no failure finding them may stop an export.
    except Exception as e:
        logging.warning("no class names from %s: %s", dataset.get("name"), e)
        return None


def export(
    workdir: str | pathlib.Path,
    out_path: str | pathlib.Path,
    step: int | None = None,
    class_names: Sequence[str] | None = None,
) -> pathlib.Path:
    """Writes the model of `workdir`'s newest (or `step`'s) checkpoint to `out_path`.

    The config is the one saved with that checkpoint. `class_names` default to the labels of
    the config's dataset when it is prepared. Returns the absolute path written.
    """
    out_path = pathlib.Path(out_path).absolute()
    step, variables, meta = restore_inference_state(workdir, step)
    if "config" not in meta:
        raise ValueError(f"{workdir}: the checkpoint at step {step} was saved without its config")
    config = meta["config"]
    if class_names is None:
        class_names = dataset_class_names(config["dataset"])
    num_classes = config["model"].get("args", {}).get("num_classes")
    if class_names is not None and num_classes is not None and len(class_names) != num_classes:
        raise ValueError(
            f"{len(class_names)} class names for config.model.args.num_classes={num_classes}"
        )
    input_config = config["input"]
    payload = {
        "format_version": EXPORT_FORMAT_VERSION,
        "model": config["model"],
        "input": {
            "image_size": input_config["image_size"],
            "eval_size": input_config["eval_size"],
            "max_size": input_config["max_size"],
            "mean": list(pipeline.IMAGENET_MEAN),
            "std": list(pipeline.IMAGENET_STD),
        },
        "class_names": None if class_names is None else list(class_names),
        "variables": variables,
        "step": step,
        "model_name": config.get("model_name"),
    }
    files.write_atomic(out_path, serialization.msgpack_serialize(payload))
    return out_path
