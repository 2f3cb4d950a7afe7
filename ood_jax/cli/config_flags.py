"""`--config=FILE[:arg]` and `--config.field=value` on argparse: an experiment as data.

A config file's `get_config(arg)` gives the experiment; each `--config.a.b=v` override is parsed
by the type of the field it replaces, as ml_collections' absl config flags parse it (an int
field takes an int, a tuple field a Python tuple literal), and the result is locked, so a
misspelt field in code fails as a misspelt flag does.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections

from ood_jax import config_files
from ood_jax.cli import help_text

PREFIX = "--config."
_TRUE = ("true", "t", "1")
_FALSE = ("false", "f", "0")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """argv -> (the other arguments, [(field path, value text or None for a bare flag)]).

    Both `--config.a=v` and `--config.a v` are overrides; the value of the second form is the
    next argument unless that is itself a flag (then the override is bare: a bool set true)."""
    rest, overrides = [], []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(PREFIX):
            rest.append(arg)
        elif "=" in arg:
            name, value = arg[len(PREFIX) :].split("=", 1)
            overrides.append((name, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            overrides.append((arg[len(PREFIX) :], argv[i + 1]))
            i += 1
        else:
            overrides.append((arg[len(PREFIX) :], None))
        i += 1
    return rest, overrides


def _field(config: ml_collections.ConfigDict, name: str) -> tuple[ml_collections.ConfigDict, str]:
    """The ConfigDict holding `name` (dotted) and the field's key in it; one line if missing."""
    node, path = config, "config"
    parts = name.split(".")
    for depth, part in enumerate(parts, start=1):
        if not isinstance(node, ml_collections.ConfigDict):
            raise ValueError(f"--config.{name}: {path} is a {type(node).__name__}, not a config")
        if part not in node:
            close = difflib.get_close_matches(part, list(node.keys()), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"--config.{name}: {path} has no field {part!r}{hint}")
        if depth < len(parts):
            node, path = node[part], f"{path}.{part}"
    return node, parts[-1]


def _literal(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def parse_value(kind: type, text: str | None, flag: str) -> Any:
    """`text` as a value for a field of type `kind`, read as absl's config flags read it."""
    if kind is bool:
        if text is None or text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{flag}: {text!r} is not a bool (true or false)")
    if text is None:
        raise ValueError(f"{flag} needs a value ({flag}=VALUE)")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(
                f"{flag}: {text!r} is not a{'n' if kind is int else ''} {kind.__name__}"
            ) from None
    if kind is str:
        return text
    if kind is tuple:
        value = _literal(text)
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if isinstance(kind, type) and issubclass(kind, ml_collections.ConfigDict):
        value = _literal(text)
        if not isinstance(value, dict):
            raise ValueError(f"{flag}: {text!r} is not a dict literal")
        return ml_collections.ConfigDict(value)
    return _literal(text)


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str | None]]
) -> ml_collections.ConfigDict:
    """Sets each override on `config` (in place, in order) and returns it locked.

    A tuple field given more than once collects the values (`--config.x=a --config.x=b`), as
    absl's repeated tuple flags do."""
    repeated: dict[str, list] = {}
    for name, text in overrides:
        parent, leaf = _field(config, name)
        flag = f"{PREFIX}{name}"
        kind = parent.get_type(leaf)
        value = parse_value(kind, text, flag)
        if kind is tuple and sum(n == name for n, _ in overrides) > 1:
            value = tuple(repeated.setdefault(name, [])) + value
            repeated[name] = list(value)
        try:
            parent[leaf] = value
        except TypeError as e:
            raise ValueError(f"{flag}: {e}") from None
    config.lock()
    return config


def load(spec: str, overrides: Sequence[tuple[str, str | None]] = ()) -> ml_collections.ConfigDict:
    """`FILE[:arg]` with `overrides` applied: the config a command runs."""
    path, _, variant = spec.partition(":")
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"--config: config file {path} does not exist")
    return apply_overrides(config_files.load(path, variant), overrides)


def add_config_flag(
    parser: argparse.ArgumentParser, required: bool = True
) -> argparse._ArgumentGroup:
    """`--config`; its overrides are taken out of argv (`split_overrides`) before argparse runs,
    so they are described here rather than declared."""
    group = parser.add_argument_group(
        "the experiment",
        help_text.fill(
            "--config.FIELD=VALUE overrides a field of the config, parsed by the field's "
            "type: --config.total_steps=100, --config.input.scales='(64, 96)'"
        ),
    )
    group.add_argument(
        "--config",
        required=required,
        metavar="FILE[:arg]",
        help="the experiment: the config file's get_config(arg)",
    )
    return group


def describe(spec: str) -> str:
    """A config's help: its file's docstring (its variants) and top-level fields and values."""
    path, _, variant = spec.partition(":")
    config = config_files.load(path, variant)
    lines = [f"{spec}:", docstring(pathlib.Path(path)), "", "top-level fields:"]
    for key in sorted(config.keys()):
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            lines.append(f"  {key}.{{{', '.join(sorted(value.keys()))}}}")
        else:
            lines.append(f"  {key} = {value!r}")
    return "\n".join(lines)


def docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""
