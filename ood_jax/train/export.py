"""Exports a trained detector from a workdir's checkpoint to one self-contained file, or to a
portable `jax.export` artifact (`file_format="stablehlo"`, `ood_jax.models.portable`).

The checkpoint's params (its EMA parameters when the run kept them, `config.ema_decay`, as
evaluation uses them) and model state and the config saved with it go through
`ood_jax.models.exported.write_exported`, which owns the file format (described there; format
version 1). Nothing of the optimizer is read or written. `ood_jax.models.load_exported` reads
the file back and runs it without optax, orbax or TensorFlow.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from absl import logging

from ood_jax import datasets
from ood_jax.data import pipeline
from ood_jax.models import dino_export, exported, onnx_export, portable, transformers_export
from ood_jax.train import checkpoint, model_card, resume


def restore_inference_state(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, variables, meta) of the given checkpoint of `workdir`, or of its newest that
    restores: newer damaged ones are moved aside and named, as training and evaluation do
    (`checkpoint.Checkpointer.restore_newest`). The variables are the params (ema_params where
    the checkpoint has them) and model_state, as host numpy arrays.
    """
    directory = pathlib.Path(workdir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no checkpoints directory; is {workdir} a workdir?")
    ckpt = checkpoint.Checkpointer(workdir, every_steps=1)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"{directory}: no checkpoint; train first (`ood-jax train`)")
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"{directory}: no checkpoint at step {step}; there are {steps}"
                )
            try:
                return (step, *ckpt.restore_variables(step))
            except Exception as error:
                raise checkpoint.CheckpointError(
                    f"checkpoint {step} in {directory} could not be restored "
                    f"({checkpoint.short_reason(error)}); without --step the newest that "
                    "restores is exported"
                ) from error
        restored = resume.say_moved_aside(ckpt.restore_newest_variables(), "exporting step")
    finally:
        ckpt.close()
    return restored.step, restored.state, restored.meta


def dataset_class_names(dataset: dict[str, Any]) -> list[str] | None:
    """Label names of a prepared detection dataset, or None when it is not at hand."""
    try:
        return datasets.class_names(dataset["name"], dataset["data_dir"])
    # Names are a convenience for users of the file: no failure finding them may stop an export.
    except Exception as e:
        logging.warning("exporting without class names (%s): %s", dataset.get("name"), e)
        return None


FORMATS = ("msgpack", "stablehlo", "onnx", "transformers", "pytorch")

# The formats that trace the predict function; only these have a batch size to fix.
_TRACED_WRITERS = {"stablehlo": portable.write_stablehlo, "onnx": onnx_export.write_onnx}


def export(
    workdir: str | pathlib.Path,
    out_path: str | pathlib.Path,
    step: int | None = None,
    class_names: Sequence[str] | None = None,
    file_format: str = "msgpack",
    batch_size: int | None = None,
) -> pathlib.Path:
    """Writes the model of `workdir`'s newest (or `step`'s) checkpoint to `out_path`: one
    msgpack file (`ood_jax.models.load_exported` reads it); with "stablehlo" a directory with
    the predict function as a `jax.export` artifact for cpu, cuda and tpu and its input
    contract (`ood_jax.models.portable`; `batch_size` fixes the batch, which is otherwise
    symbolic); with "onnx" a directory with the same function as an ONNX graph
    (`ood_jax.models.onnx_export`, `batch_size` likewise); with "transformers" (DETR,
    Deformable DETR) a directory transformers' `from_pretrained` loads
    (`ood_jax.models.transformers_export`); with "pytorch" (DINO) a directory with
    IDEA-Research/DINO's checkpoint.pth (`ood_jax.models.dino_export`).

    The config is the one saved with that checkpoint. `class_names` default to the labels of
    the config's dataset when it is prepared. Returns the absolute path written.
    """
    if file_format not in FORMATS:
        raise ValueError(f"unknown export format {file_format!r}; expected {' or '.join(FORMATS)}")
    if batch_size is not None and file_format not in _TRACED_WRITERS:
        raise ValueError(
            f"--batch-size applies to --format {' or '.join(_TRACED_WRITERS)}, not {file_format}"
        )
    out_path = pathlib.Path(out_path).absolute()
    if file_format == "msgpack" and out_path.is_dir():
        raise IsADirectoryError(
            f"--out {out_path}: is a directory; name the file to write, e.g. {out_path}/model.msgpack"
        )
    step, variables, meta = restore_inference_state(workdir, step)
    if "config" not in meta:
        raise ValueError(f"{workdir}: the checkpoint at step {step} was saved without its config")
    config = meta["config"]
    if class_names is None:
        class_names = dataset_class_names(config["dataset"])
    # A directory format carries the model's card; the msgpack file has no place for it.
    card = (
        {model_card.CARD_FILE: model_card.model_card(workdir, config, step, file_format)}
        if file_format != "msgpack"
        else {}
    )
    if file_format == "transformers":
        return transformers_export.write(
            out_path,
            config["model"]["name"],
            config["model"]["args"],
            config["input"],
            variables,
            class_names,
            pipeline.IMAGENET_MEAN,
            pipeline.IMAGENET_STD,
            extra_files=card,
        )
    if file_format == "pytorch":
        if config["model"]["name"] != "dino":
            raise ValueError(
                f"--format pytorch: the checkpoint's model is {config['model']['name']}; this "
                "format is IDEA-Research/DINO's checkpoint, written for dino (detr and "
                "deformable_detr go to PyTorch as --format transformers)"
            )
        return dino_export.write_official_dino(
            out_path, config["model"]["args"], variables, extra_files=card
        )
    payload = exported.make_payload(
        model_config=config["model"],
        input_config=config["input"],
        mean=pipeline.IMAGENET_MEAN,
        std=pipeline.IMAGENET_STD,
        class_names=class_names,
        variables=variables,
        step=step,
        model_name=config.get("model_name"),
    )
    if file_format in _TRACED_WRITERS:
        return _TRACED_WRITERS[file_format](
            exported.ExportedModel.from_payload(payload),
            out_path,
            batch_size=batch_size,
            extra_files=card,
        )
    return exported.write_exported(out_path, payload)
