"""Every subcommand's --help shows at least one example, and every example parses.

The subcommands are found by walking `ood_jax.cli.build_parser()`, so a command added later is
checked without being listed here. An example is a help line starting with "ood-jax "; a line
ending in "\\" continues on the next. Each is parsed by the real parser, which proves its
subcommand and flags exist; a config command's example also loads its config with its overrides.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex

import pytest

from ood_jax import cli
from ood_jax.cli import train

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out.append(((*path, name), child))
                out.extend(_subcommands(child, (*path, name)))
    return out


SUBCOMMANDS = dict(_subcommands(cli.build_parser()))


def _help(path: tuple[str, ...]) -> str:
    if path[0] in train.CONFIG_COMMANDS:
        return train.config_help(path[0], [])
    return SUBCOMMANDS[path].format_help()


def _examples(help_text: str) -> list[str]:
    """The example command lines of a help text, continuation lines joined."""
    examples, current = [], None
    for line in help_text.splitlines():
        line = line.strip()
        if current is None and not line.startswith("ood-jax "):
            continue
        current = line if current is None else f"{current} {line}"
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        else:
            examples.append(current)
            current = None
    assert current is None, f"an example ends in a continuation: {current!r}"
    return examples


def test_every_command_is_found():
    # The walk reaches nested subcommands, not only the top level.
    assert {("eval-mllm",), ("mine", "oodg"), ("stats", "clip-conditional"), ("train",)} <= set(
        SUBCOMMANDS
    )


@pytest.mark.parametrize("path", sorted(SUBCOMMANDS), ids=" ".join)
def test_help_has_an_example_that_parses(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples name configs/ relative to the repository
    help_text = _help(path)
    command = "ood-jax " + " ".join(path)
    examples = [e for e in _examples(help_text) if e == command or e.startswith(command + " ")]
    if "example" not in help_text.lower() or not examples:
        pytest.fail(f"`{command} --help` shows no example")
    for example in examples:
        argv = shlex.split(example)[1:]
        try:
            args = cli.parse_args(argv)
        except SystemExit as stopped:
            if "--help" in argv and stopped.code == 0:
                continue
            pytest.fail(f"`{example}` does not parse: {capsys.readouterr().err.strip()}")
        assert callable(args.run), example
