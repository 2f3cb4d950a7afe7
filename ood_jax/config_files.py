"""Config files are Python files with `get_config(arg)`, loaded by path as `--config=` does.

Configs build on each other by loading a sibling file (`load(sibling(__file__, "x.py"), arg)`):
they are data in files, not an importable package.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections


def load(path: str | pathlib.Path, arg: str | None = None) -> ml_collections.ConfigDict:
    """The `get_config(arg)` of the config file at `path`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_ood_jax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # As absl's config flags: a file written for them may take no argument at all.
    return module.get_config(arg) if arg else module.get_config()


def load_spec(spec: str) -> ml_collections.ConfigDict:
    """`path/to/config.py[:arg]` -> its config."""
    path, _, arg = spec.partition(":")
    return load(path, arg)


def sibling(config_file: str, name: str) -> pathlib.Path:
    """The config file `name` next to `config_file` (a config's `__file__`)."""
    return pathlib.Path(config_file).with_name(name)
