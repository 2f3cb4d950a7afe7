"""`uv pip install ARGS` into this Python's environment, from wherever pip is configured to
install from.

uv reads no pip configuration, so on a machine whose pip.conf (or PIP_* variables) points at a
mirror, local wheels or a constraints file, uv alone would resolve against PyPI. The package
sources and caps pip would use are passed on: index-url, extra-index-url, find-links and
constraint, each from the highest-precedence place that sets it (environment, then pip's
`install` section, then `global`), and pip's choice of the best version across all indexes.

    .venv/bin/python tools/uv_install.py -e '.[test]'
    .venv/bin/python tools/uv_install.py --print -e .   # the command, not run
"""

import ast
import os
import shlex
import shutil
import subprocess
import sys

# pip's option -> uv's; each may hold several values, separated by whitespace as in pip.conf.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
PRECEDENCE = (":env:", "install", "global")  # first wins, as pip resolves them


def pip_config() -> dict[tuple[str, str], str]:
    """`pip config list` as {(section, option): value}; it prints each value's repr."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"uv_install: `pip config list` failed: {done.stderr.strip()}")
    config = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        config[section, option] = ast.literal_eval(value)
    return config


def uv_options(config: dict[tuple[str, str], str]) -> list[str]:
    options = []
    for option, flag in OPTIONS.items():
        values = [config[s, option] for s in PRECEDENCE if (s, option) in config]
        for item in dict.fromkeys(values[0].split() if values else []):
            options += [flag, item]
    if any(flag == "--extra-index-url" for flag in options):
        options += ["--index-strategy", "unsafe-best-match"]
    return options


def main(argv: list[str]) -> None:
    show = argv[:1] == ["--print"]
    args = argv[1:] if show else argv
    # The environment's own uv (`pip install uv`), else one on PATH.
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None and not show:
        sys.exit(f"uv_install: no uv next to {sys.executable} or on PATH; `pip install uv`")
    # Bytecode as pip writes it at install: uv leaves it to the first import, which cannot write
    # it where PYTHONDONTWRITEBYTECODE is set (as on CI's machines), so every process would
    # compile each module it imports, 4.5 s of a training process's 9 s import on 2 cores.
    command = [uv or "uv", "pip", "install", "-q", "--compile-bytecode", "--python", sys.executable]
    command += uv_options(pip_config()) + args
    if show:
        print(shlex.join(command))
        return
    os.execv(uv, command)


if __name__ == "__main__":
    main(sys.argv[1:])
