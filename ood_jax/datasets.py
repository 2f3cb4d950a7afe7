"""The one entry to our TFDS datasets: build them, load them, name their classes.

This is the only module that imports `tfds_builders` (which registers the builders with TFDS);
the builders import only `ood_jax.data`, so there is no import circle, and everything else (the
trainer, export, mining, the CLI) comes here for a dataset. A build never reuses data it cannot
vouch for: it is staged beside the dataset with its `BuildRecord` and moved into place whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pathlib
import shutil
import sys
import uuid
from typing import Iterator, Sequence

import tensorflow_datasets as tfds
from tensorflow_datasets.core import constants as tfds_constants
from tensorflow_datasets.core.utils import tqdm_utils

import tfds_builders
from ood_jax import files
from ood_jax.data import builders, building, corrupted

NAMES = tfds_builders.NAMES
# Procedurally rendered: built on first use when a config asks for it (`build_if_missing`).
SYNTHETIC = ("synthetic_shifts",)
# A prepared dataset under corruptions; its configs are named by the request they build.
CORRUPTED = "corrupted"

# TFDS names its own partial builds `incomplete.XXXXXX_VERSION`; ours share the prefix, so one
# sweep finds both. A dataset moved aside by --overwrite is `replaced.XXXX_VERSION` until the
# new one is in place.
_PARTIAL = tfds_constants.INCOMPLETE_PREFIX
_STAGING = f"{_PARTIAL}ood-jax-"
_REPLACED = "replaced."
# Held (flock) by a running build in its staging directory, so a second build leaves it alone.
_LOCK = "ood_jax_build.lock"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _builder_cls(name: str):
    try:
        return tfds.builder_cls(name)
    except tfds.core.registered.DatasetNotFoundError:
        raise building.BuildError(
            f"unknown dataset {name!r}; ours are {', '.join(NAMES)}"
        ) from None


def configs(name: str) -> tuple[str, ...]:
    """The config names of dataset `name` (empty for a builder without configs)."""
    return tuple(c.name for c in _builder_cls(name).BUILDER_CONFIGS)


def _check_config(builder_cls, name: str, config: str | None) -> None:
    configs = [c.name for c in builder_cls.BUILDER_CONFIGS]
    # With several configs and none the default, no choice would be the user's.
    if config is None and len(configs) > 1 and "default" not in configs:
        raise building.BuildError(f"{name}: choose a config with --config: {', '.join(configs)}")
    if config is not None and config not in configs:
        custom = getattr(builder_cls, "CUSTOM_CONFIG", None)
        hint = f"; a set of your own is --config {custom} --name NAME" if custom else ""
        raise building.BuildError(
            f"{name}: unknown config {config!r}; its configs are {', '.join(configs)} "
            f"(--config){hint}"
        )


def _build_config(builder_cls, name: str, config: str | None, custom_name: str | None):
    """What a build passes as the builder's `config`: the name of one of its configs or, for a
    set built under a name of its own (`--config custom --name NAME`), the builder's config
    object for that name, which TFDS writes to DATA_DIR/NAME/<custom name>/VERSION."""
    if custom_name is None:
        _check_config(builder_cls, name, config)
        return config
    custom = getattr(builder_cls, "CUSTOM_CONFIG", None)
    if custom is None or config != custom:
        needs = f"--config {custom}" if custom else f"a builder with custom sets, not {name}"
        raise building.BuildError(f"--name {custom_name}: only a custom set is named ({needs})")
    return builder_cls.custom_config(custom_name)


def _load_config(builder_cls, name: str, config: str | None):
    """What a reader passes as `config`: a config's name, or a custom set's config by its name
    (a custom set differs from the builder's custom config only in its name)."""
    if name == CORRUPTED:
        if config is None:
            raise building.BuildError(f"{name}: name the build, {name}/CONFIG")
        return builder_cls.config_named(config)
    configs = [c.name for c in builder_cls.BUILDER_CONFIGS]
    if config is not None and config not in configs and hasattr(builder_cls, "CUSTOM_CONFIG"):
        return builder_cls.custom_config(config)
    _check_config(builder_cls, name, config)
    return config


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


def _make_builder(builder_cls, data_dir: str, config, on_error: str):
    kwargs = {"data_dir": data_dir, "config": config}
    if issubclass(builder_cls, builders.SourceBuilder):
        kwargs["on_error"] = on_error
    return builder_cls(**kwargs)


def build(
    name: str,
    data_dir: str,
    source: str | None = None,
    config: str | None = None,
    on_error: str = "fail",
    overwrite: bool = False,
    custom_name: str | None = None,
    beam_runner: str | None = None,
    beam_options: str | Sequence[str] | None = None,
    corruption: dict | None = None,
) -> tfds.core.DatasetBuilder:
    """Builds dataset `name` (config `config`) from `source` into `data_dir`.

    `custom_name` builds a custom set (foci's `custom`) under a name of its own, so several
    live side by side; it is read back as "NAME/<custom name>".

    `beam_runner` ("DirectRunner", "FlinkRunner", ...) builds on Apache Beam through TFDS, with
    `beam_options` ("--opt=v --opt2=v", or a list of flags) for the pipeline; the records are
    those of a build in this process. `source` and `data_dir` must then be on a filesystem the
    workers share (`ood_jax.data.beam`).

    `corruption` builds "corrupted": {"dataset": NAME[/CONFIG] prepared in `data_dir`,
    "corruptions", "severities" ("all" by default) and "splits" (all by default)}, comma-
    separated strings or lists (`ood_jax.data.corrupted.Request`); it is read back as
    "corrupted/<the config name it prints>".

    Returns the prepared builder with `.provenance` (its `BuildRecord`), `.reused` (True when
    the dataset was already built from this source and nothing was done) and `.report` (what
    this build skipped, dropped or clipped; None when reused). Raises `BuildError` when
    `data_dir` holds this dataset built from another source, unless `overwrite`.
    """
    builder_cls = _builder_cls(name)
    if name == CORRUPTED or corruption is not None:
        named = config or custom_name
        config = _corruption_config(builder_cls, name, data_dir, named, corruption)
    else:
        config = _build_config(builder_cls, name, config, custom_name)
    _check_writable(data_dir)
    download_config = _download_config(source, beam_runner, beam_options)
    make = functools.partial(_make_builder, builder_cls, config=config, on_error=on_error)
    data_root = os.path.expanduser(data_dir)
    builder = make(data_root)
    dataset_dir = pathlib.Path(builder.data_dir)
    _clean_partial_builds(dataset_dir.parent)
    # is_prepared() logs a warning for a directory that is not there, which is the usual case.
    exists = dataset_dir.exists()
    prepared = exists and builder.is_prepared()
    if prepared and not overwrite:
        return _reuse(builder, source)
    origin = builder.origin(source)
    if exists and not prepared:
        _say(f"replacing {dataset_dir}, which holds no readable dataset")
    record, report = _build_staged(make, data_root, dataset_dir, origin, on_error, download_config)
    built = make(data_root)
    built.provenance, built.reused, built.report = record, False, report
    return built


def _corruption_config(
    builder_cls, name: str, data_dir: str, named: str | None, corruption: dict | None
):
    """The config that builds the request `corruption` (`build`'s doc) as "corrupted"."""
    if name != CORRUPTED:
        raise building.BuildError(f"--dataset and --corruptions are for {CORRUPTED}, not {name}")
    if named is not None:
        raise building.BuildError(
            f"{name}: its config is named after the request (--dataset, --corruptions, "
            "--severities, --splits), not chosen with --config or --name"
        )
    if not corruption or not corruption.get("dataset"):
        raise building.BuildError(f"{name}: pass --dataset, the prepared dataset to corrupt")
    source = load(corruption["dataset"], data_dir)
    try:
        request = corrupted.Request.create(
            corruption["dataset"],
            source.info.splits,
            corruption.get("corruptions") or "all",
            corruption.get("severities") or "all",
            corruption.get("splits"),
        )
    except ValueError as e:
        raise building.BuildError(str(e)) from None
    return builder_cls.request_config(request, source.data_dir)


def _download_config(
    source: str | None, beam_runner: str | None, beam_options: str | Sequence[str] | None
):
    if beam_runner is None:
        if beam_options is not None:
            raise building.BuildError("--beam-options needs --beam-runner, the runner they are for")
        return tfds.download.DownloadConfig(manual_dir=source) if source else None
    from ood_jax.data import beam

    return tfds.download.DownloadConfig(
        manual_dir=source, beam_runner=beam_runner, beam_options=beam.options(beam_options or [])
    )


# ---------------------------------------------------------------------------------------------
# A dataset that is already there.
# ---------------------------------------------------------------------------------------------


def _reuse(builder, source: str | None) -> tfds.core.DatasetBuilder:
    """The prepared `builder` if it was built from `source`; a BuildError naming both if not."""
    dataset_dir = pathlib.Path(builder.data_dir)
    record = building.BuildRecord.read(dataset_dir)
    if record is None:
        return _reuse_unrecorded(builder, dataset_dir)
    # The directory first: another one is refused without reading (or hashing) anything in it.
    if record.source != builder.source_path(source):
        why = f"--source {source} is another directory"
    else:
        why = builder.origin(source).difference(record)
    if why is not None:
        raise building.BuildError(
            f"{_full_name(builder)}: {dataset_dir} was built from {record.made_from} on "
            f"{record.built_at}; {why}. Pass --overwrite to replace it, or choose another "
            "--data-dir"
        )
    builder.provenance, builder.reused, builder.report = record, True, None
    return builder


def _reuse_unrecorded(builder, dataset_dir: pathlib.Path) -> tfds.core.DatasetBuilder:
    # A synthetic dataset is a function of its config, so one an older ood-jax rendered is
    # still what the config asks for; a source build's origin cannot be known.
    if not isinstance(builder, builders.SourceBuilder):
        builder.provenance, builder.reused, builder.report = None, True, None
        return builder
    raise building.BuildError(
        f"{_full_name(builder)}: {dataset_dir} was built by an older ood-jax, which kept no "
        f"record ({building.RECORD_FILE}) of its source, so it cannot be matched with --source;"
        " pass --overwrite to rebuild it (it still loads as it is)"
    )


def _full_name(builder) -> str:
    config = f"/{builder.builder_config.name}" if builder.builder_config else ""
    return f"{builder.name}{config}"


# ---------------------------------------------------------------------------------------------
# Building beside the dataset, then moving it into place.
# ---------------------------------------------------------------------------------------------


def _build_staged(
    make,
    data_root: str,
    dataset_dir: pathlib.Path,
    origin: building.Origin,
    on_error: str,
    download_config,
) -> tuple[building.BuildRecord, building.BuildReport]:
    """Builds into a staging directory, records the build, moves it to `dataset_dir`."""
    existed, placed = dataset_dir.exists(), False
    try:
        with _staging(dataset_dir.parent) as staging:
            staged = make(str(staging))
            _prepare(staged, download_config)
            splits = {k: v.num_examples for k, v in staged.info.splits.items()}
            summary = staged.report.summary(splits)
            record = building.BuildRecord.create(staged, origin, on_error, summary)
            record.write(pathlib.Path(staged.data_dir))
            _copy_default_config(staging, pathlib.Path(data_root), staged.name)
            _move_into_place(pathlib.Path(staged.data_dir), dataset_dir)
            placed = True
    except KeyboardInterrupt as interrupt:
        if placed:
            said = (
                f"the build is complete in {dataset_dir}; a replaced dataset left beside it is "
                "removed at the next build"
            )
        else:
            kept = "still holds the previous dataset" if existed else "was not written"
            said = (
                f"nothing kept: the partial build was removed and {dataset_dir} {kept}; rerun "
                "the same command to build it"
            )
        # The message is the one line `cli.main` prints; the report (if any) rides along.
        stopped = KeyboardInterrupt(said)
        stopped.build_report = getattr(interrupt, "build_report", None)
        raise stopped from None
    return record, staged.report


def _prepare(builder, download_config) -> None:
    """TFDS's download_and_prepare with our one progress bar; errors carry the build report."""
    builder.show_progress = True
    try:
        with _without_tfds_bars():
            builder.download_and_prepare(download_config=download_config)
    except BaseException as error:
        # What was skipped before the failure is printed with the error (`cli._build`).
        if not builder.report.is_empty():
            error.build_report = builder.report.summary()
        raise
    finally:
        builder.close_progress()


@contextlib.contextmanager
def _without_tfds_bars() -> Iterator[None]:
    # TFDS draws a bar per split for generating and another for shuffling (57 for
    # synthetic_shifts/tiny); our builders draw one for the whole build instead.
    was_active = getattr(tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(was_active)


@contextlib.contextmanager
def _staging(parent: pathlib.Path) -> Iterator[pathlib.Path]:
    """A fresh staging data dir under `parent`, locked while in use and removed afterwards."""
    path = parent / f"{_STAGING}{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    try:
        with open(path / _LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield path
    finally:
        _remove_staging(path)


def _remove_staging(path: pathlib.Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        # Raising here would hide the build's own outcome; the next build sweeps it instead.
        _say(f"could not remove the staging directory {path} ({e}); the next build removes it")


def _copy_default_config(staging: pathlib.Path, data_root: pathlib.Path, name: str) -> None:
    # TFDS keeps a builder's default config in NAME/.config/, which lets a reader without our
    # code open "NAME" without naming a config; it was written inside the staging data dir.
    written = staging / name / ".config" / tfds_constants.METADATA_FILENAME
    if written.exists():
        files.write_atomic(data_root / name / ".config" / written.name, written.read_bytes())


def _move_into_place(new: pathlib.Path, dataset_dir: pathlib.Path) -> None:
    """Renames `new` to `dataset_dir`; an existing dataset is moved aside first, then deleted.

    Between the two renames no dataset is there; a run killed then leaves the old one as
    `replaced.*`, which the next build restores (`_clean_partial_builds`).
    """
    if not dataset_dir.exists():
        try:
            os.rename(new, dataset_dir)
        except OSError:
            if not dataset_dir.exists():
                raise
            raise building.BuildError(
                f"{dataset_dir} was written by another build while this one ran; rerun the "
                "command to compare it with this source"
            ) from None
        return
    aside = dataset_dir.with_name(f"{_REPLACED}{uuid.uuid4().hex[:12]}_{dataset_dir.name}")
    os.rename(dataset_dir, aside)
    os.rename(new, dataset_dir)
    shutil.rmtree(aside)


def _clean_partial_builds(parent: pathlib.Path) -> None:
    """Removes the partial builds a killed run left in `parent` (DATA_DIR/NAME[/CONFIG])."""
    for path in sorted(parent.glob(f"{_PARTIAL}*")):
        if _in_use(path):
            _say(f"left {path} alone: another build is writing it")
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        _say(f"removed a partial build left by an interrupted run: {path}")
    for aside in sorted(parent.glob(f"{_REPLACED}*")):
        original = aside.with_name(aside.name.split("_", 1)[-1])
        if original.exists():
            shutil.rmtree(aside)
            _say(f"removed a dataset replaced by an interrupted --overwrite: {aside}")
        else:
            os.rename(aside, original)
            _say(f"restored {original}, which an interrupted --overwrite had moved aside")


def _in_use(path: pathlib.Path) -> bool:
    """Whether a running build holds the lock in staging directory `path`."""
    lock_path = path / _LOCK
    if not lock_path.is_file():
        return False
    with open(lock_path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


# ---------------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------------


def load(name: str, data_dir: str, build_if_missing: bool = False) -> tfds.core.DatasetBuilder:
    """The prepared dataset "NAME" or "NAME/CONFIG" in `data_dir`.

    A synthetic dataset is built when missing if `build_if_missing`; any other missing dataset
    is an error that gives the command that builds it.
    """
    data_dir = os.path.expanduser(data_dir)
    dataset, _, config = name.partition("/")
    builder_cls = _builder_cls(dataset)
    chosen = _load_config(builder_cls, dataset, config or None)
    builder = _make_builder(builder_cls, data_dir, chosen, on_error="fail")
    if builder.is_prepared():
        return builder
    if build_if_missing and dataset in SYNTHETIC:
        return build(dataset, data_dir=data_dir, config=config or None)
    if dataset == CORRUPTED:
        raise FileNotFoundError(
            f"{name} is not prepared in {data_dir}; `ood-jax build {CORRUPTED} --dataset "
            f"NAME[/CONFIG] --corruptions ... --severities ... --data-dir {data_dir}` builds one "
            "and prints its name"
        )
    config_flag = f" --config {config}" if config else ""
    what = ""
    if isinstance(chosen, tfds.core.BuilderConfig):  # a custom set under a name of its own
        config_flag = f" --config {builder_cls.CUSTOM_CONFIG} --name {config}"
        # It may be a mistyped config, so the configs are named too.
        what = f" (no config of {dataset}: {', '.join(configs(dataset))}; nor a custom set)"
    source = "" if dataset in SYNTHETIC else " --source SRC"
    raise FileNotFoundError(
        f"{name} is not prepared in {data_dir}{what}; run "
        f"`ood-jax build {dataset}{source}{config_flag} --data-dir {data_dir}`"
    )


def class_names(name: str, data_dir: str) -> list[str]:
    """The detection label names of the prepared dataset `name` (objects/label), in label order."""
    return list(load(name, data_dir).info.features["objects"]["label"].names)
