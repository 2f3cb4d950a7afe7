"""The one entry to our TFDS datasets: build them, load them, name their classes.

This is the only module that imports `tfds_builders` (which registers the builders with TFDS);
the builders in turn import only `ood_jax.data`, so there is no import circle. Everything else
(the trainer, export, mining, the CLI) comes here for a dataset.

    builder = datasets.build("counts", data_dir, source=SRC)      # -> prepared builder + .report
    builder = datasets.load("synthetic_shifts/tiny", data_dir)    # prepared, or an error saying how
    names = datasets.class_names("counts", data_dir)              # detection label names
"""

from __future__ import annotations

import os
import pathlib

import tensorflow_datasets as tfds

import tfds_builders
from ood_jax.data import building

NAMES = tfds_builders.NAMES
# Procedurally rendered: built on first use when a config asks for it (`build_if_missing`).
SYNTHETIC = ("synthetic_shifts",)


def _builder_cls(name: str):
    try:
        return tfds.builder_cls(name)
    except tfds.core.registered.DatasetNotFoundError:
        raise building.BuildError(
            f"unknown dataset {name!r}; ours are {', '.join(NAMES)}"
        ) from None


def _check_config(builder_cls, name: str, config: str | None) -> None:
    configs = [c.name for c in builder_cls.BUILDER_CONFIGS]
    # With several configs and none the default, no choice would be the user's.
    if config is None and len(configs) > 1 and "default" not in configs:
        raise building.BuildError(f"{name}: choose a config with --config: {', '.join(configs)}")
    if config is not None and config not in configs:
        raise building.BuildError(
            f"{name}: unknown config {config!r}; its configs are {', '.join(configs)} (--config)"
        )


def _check_writable(data_dir: str) -> None:
    path = pathlib.Path(data_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise building.BuildError(
            f"--data-dir {data_dir}: cannot be created ({e.strerror}); pick a writable directory"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise building.BuildError(f"--data-dir {data_dir}: not writable; pick a writable directory")


def build(
    name: str,
    data_dir: str,
    source: str | None = None,
    config: str | None = None,
    on_error: str = "fail",
) -> tfds.core.DatasetBuilder:
    """Builds dataset `name` (config `config`) from `source` into `data_dir`.

    Returns the prepared builder; sources read by our builders carry `.report` (what was
    skipped, dropped or clipped).
    """
    builder_cls = _builder_cls(name)
    _check_config(builder_cls, name, config)
    _check_writable(data_dir)
    kwargs = {"data_dir": data_dir, "config": config}
    if issubclass(builder_cls, building.SourceBuilder):
        kwargs["on_error"] = on_error
    builder = builder_cls(**kwargs)
    download_config = tfds.download.DownloadConfig(manual_dir=source) if source else None
    builder.download_and_prepare(download_config=download_config)
    return builder


def load(name: str, data_dir: str, build_if_missing: bool = False) -> tfds.core.DatasetBuilder:
    """The prepared dataset "NAME" or "NAME/CONFIG" in `data_dir`.

    A synthetic dataset is built when missing if `build_if_missing`; any other missing dataset
    is an error that gives the command that builds it.
    """
    data_dir = os.path.expanduser(data_dir)
    dataset, _, config = name.partition("/")
    _check_config(_builder_cls(dataset), dataset, config or None)
    builder = tfds.builder(name, data_dir=data_dir)
    if builder.is_prepared():
        return builder
    if build_if_missing and dataset in SYNTHETIC:
        return build(dataset, data_dir=data_dir, config=config or None)
    config_flag = f" --config {config}" if config else ""
    source = "" if dataset in SYNTHETIC else " --source SRC"
    raise FileNotFoundError(
        f"{name} is not prepared in {data_dir}; run "
        f"`ood-jax build {dataset}{source}{config_flag} --data-dir {data_dir}`"
    )


def class_names(name: str, data_dir: str) -> list[str]:
    """The detection label names of the prepared dataset `name` (objects/label), in label order."""
    return list(load(name, data_dir).info.features["objects"]["label"].names)
