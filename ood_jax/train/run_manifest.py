"""manifest.json of a detector run (ood_jax.manifest): when `train` or `evaluate` starts, the
config's digest, the dataset build and jax's devices; when it ends, the checkpoint evaluated
(a digest of its files, equal for `train` and a later `evaluate` of the same step), the
evaluated splits as `ood-jax compare-detectors` pairs them, and the headline APs."""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from ood_jax import manifest
from ood_jax.train import checkpoint

# What a detector run's manifest reports beside manifest.BASE_PACKAGES.
PACKAGES = ("optax", "orbax-checkpoint", "tensorflow", "tensorflow-datasets")


def start(
    kind: str,
    config: ml_collections.ConfigDict,
    builder: tfds.core.DatasetBuilder,
    splits: Mapping[str, str],
) -> dict:
    """manifest.json of a `kind` ("train", "evaluate") run of `config` on `splits` of `builder`
    starting now."""
    config_json = config.to_json_best_effort(sort_keys=True)
    return manifest.collect(
        kind,
        devices=True,
        packages=PACKAGES,
        config={
            "model_name": config.model_name,
            "model": config.model.name,
            "sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        },
        dataset={**manifest.tfds_dataset(builder), "splits": dict(splits)},
    )


def _checkpoint(ckpt: checkpoint.Checkpointer, step: int) -> dict:
    directory = ckpt.directory / str(step)
    return {"step": step, "path": str(directory), "digest": manifest.tree_digest(directory)}


def evaluation(results: Mapping[str, Any]) -> dict:
    """The evaluated splits as `ood-jax compare-detectors` pairs them (the images and the
    ground truth's digest) and the headline APs."""
    splits = {
        name: {
            "images": len(m.image_ids),
            "image_ids_sha256": hashlib.sha256(np.asarray(m.image_ids).tobytes()).hexdigest(),
            "ground_truth": m.ground_truth,
        }
        for name, m in results.get("matches", {}).items()
    }
    aps = {"iid_AP": results["iid"]["AP"]}
    if "ood_average" in results:
        aps["ood_AP"] = results["ood_average"]["AP"]
    return {"step": results["step"], **aps, "splits": splits}


def end(
    ckpt: checkpoint.Checkpointer,
    results: Mapping[str, Any],
    backbone: pathlib.Path | None,
) -> dict:
    """What a run adds to its manifest when it ends: the checkpoint evaluated, the evaluation,
    and the backbone's starting weights (`backbone`) where there are some."""
    fields = {
        "checkpoint": _checkpoint(ckpt, results["step"]),
        "evaluation": evaluation(results),
    }
    if backbone is not None and backbone.exists():
        fields["backbone_weights"] = {
            "path": str(backbone),
            "digest": manifest.weights_digest(backbone),
        }
    return fields
