"""A portable detector: its predict function as a serialized `jax.export` artifact.

`ood-jax export --format stablehlo` writes `predict.jax_export` (prepared images -> detections,
parameters folded in, lowered for cpu, cuda and tpu in one module) and `contract.json` (inputs,
preprocessing, outputs, class names, provenance). Loading it needs jax alone, none of ood_jax
(docs/guide/detectors.md#export-formats).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import export as jax_export

from ood_jax import files
from ood_jax.models import exported

ARTIFACT_FILE = "predict.jax_export"
CONTRACT_FILE = "contract.json"
PLATFORMS = ("cpu", "cuda", "tpu")
CONTRACT_VERSION = 1

PREPROCESSING = (
    "RGB pixels scaled to [0, 1], resized bilinearly (antialiased when shrinking) so the shorter "
    "side is eval_size unless the longer would pass max_size (then the longer is max_size; sizes "
    "rounded half to even in float32), normalized with mean and std per channel, placed at the "
    "top-left of an image_size x image_size canvas of zeros; mask True on the resized image"
)
OUTPUTS = {
    "boxes": "float32 [batch, queries, 4]: cx, cy, w, h, normalized to the resized image (times "
    "the source image's width and height: pixels)",
    "scores": "float32 [batch, queries]: the score of the query's label",
    "labels": "int32 [batch, queries]: index into class_names",
}


def input_specs(side: int, batch_size: int | None) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(images, mask) of prepared canvases of `side`: a symbolic batch "batch" unless
    `batch_size` fixes it."""
    (batch,) = jax_export.symbolic_shape("batch") if batch_size is None else (batch_size,)
    return (
        jax.ShapeDtypeStruct((batch, side, side, 3), jnp.float32),
        jax.ShapeDtypeStruct((batch, side, side), jnp.bool_),
    )


def export_predict(
    model: exported.ExportedModel,
    batch_size: int | None = None,
    platforms: Sequence[str] = PLATFORMS,
) -> jax_export.Exported:
    """The model's predict on prepared batches, exported for `platforms`."""
    predict = jax.jit(model.predict_canvas)
    return jax_export.export(predict, platforms=tuple(platforms))(
        *input_specs(model.input_config["image_size"], batch_size)
    )


def model_contract(model: exported.ExportedModel) -> dict[str, Any]:
    """What every artifact of `model` promises alike: how images are prepared, the outputs,
    class names and where the model came from."""
    c = model.input_config
    return {
        "preprocessing": {
            "rule": PREPROCESSING,
            **{key: c[key] for key in ("image_size", "eval_size", "max_size", "mean", "std")},
        },
        "outputs": OUTPUTS,
        "class_names": model.class_names,
        "model": {
            "name": model.module.__class__.__name__,
            "model_name": model.model_name,
            "step": model.step,
        },
    }


def contract(model: exported.ExportedModel, artifact: jax_export.Exported) -> dict[str, Any]:
    """What a user of the artifact needs to know, from the model and the artifact itself."""
    names = ("images", "mask")
    return {
        "contract_version": CONTRACT_VERSION,
        "artifact": ARTIFACT_FILE,
        "load": f"jax.export.deserialize(bytearray(open('{ARTIFACT_FILE}', 'rb').read()))"
        ".call(images, mask)",
        "platforms": list(artifact.platforms),
        "jax_version": jax.__version__,
        "calling_convention_version": artifact.calling_convention_version,
        "inputs": [
            {"name": name, "shape": [str(d) for d in aval.shape], "dtype": str(aval.dtype)}
            for name, aval in zip(names, artifact.in_avals)
        ],
        **model_contract(model),
    }


def write_stablehlo(
    model: exported.ExportedModel,
    out_dir: str | pathlib.Path,
    batch_size: int | None = None,
    platforms: Sequence[str] = PLATFORMS,
    extra_files: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Writes `ARTIFACT_FILE`, `CONTRACT_FILE` and `extra_files` (name -> text) into `out_dir`
    and returns it.

    All are written into a staging directory beside `out_dir` that then takes its place, so a
    reader sees the previous export or the whole new one. An `out_dir` that holds anything but
    a previous export is refused.
    """
    out_dir = files.export_directory(out_dir, "stablehlo export", [ARTIFACT_FILE, CONTRACT_FILE])
    artifact = export_predict(model, batch_size, platforms)
    with files.replaced_directory(out_dir) as staging:
        (staging / ARTIFACT_FILE).write_bytes(artifact.serialize())
        (staging / CONTRACT_FILE).write_text(json.dumps(contract(model, artifact), indent=2))
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir
