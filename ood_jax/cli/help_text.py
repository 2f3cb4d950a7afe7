"""`--help` text every `ood-jax` subcommand shares: an examples epilog and filled descriptions.

Parsers that show examples use `argparse.RawDescriptionHelpFormatter`, which keeps an epilog's
lines (and a long command's "\\" continuation lines) as written but no longer wraps the
description, so descriptions are filled here.
"""

from __future__ import annotations

import textwrap

WIDTH = 79


def examples(*commands: str) -> str:
    """An epilog listing whole command lines, each of which runs as written."""
    if not commands:
        raise ValueError("a command's --help needs at least one example")
    heading = "examples:" if len(commands) > 1 else "example:"
    return "\n".join([heading, *(f"  {c}" for c in commands)])


def fill(text: str) -> str:
    return textwrap.fill(text, width=WIDTH)
