"""`make` installs with uv from wherever pip is configured to install from (tools/uv_install.py),
as on a machine with a mirror, local wheels and a constraints file."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "uv_install.py"


def uv_options(conf: pathlib.Path | None, **environ: str) -> list[str]:
    """The options of the uv command the script would run, pip reading `conf` last (os.devnull:
    no file at all, this machine's own included) and `environ`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf or os.devnull), **environ)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--print", "-e", "."],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    command = shlex.split(done.stdout)
    assert command[1:7] == [
        "pip",
        "install",
        "-q",
        "--compile-bytecode",
        "--python",
        sys.executable,
    ]
    assert command[-2:] == ["-e", "."]
    return command[7:-2]


def test_every_source_and_cap_pip_reads_is_passed_on(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\n"
        "index-url = https://mirror.example/simple\n"
        "extra-index-url = file:///srv/a/simple\n"
        "    file:///srv/b/simple\n"
        "find-links = /srv/wheels\n"
        "constraint = /etc/global-caps.txt\n"
        "timeout = 60\n"
        "[install]\n"
        "constraint = /etc/caps.txt\n"
    )
    # The environment wins over the files, pip's install section over its global one.
    options = uv_options(conf, PIP_FIND_LINKS="/env/wheels /env/wheels /more/wheels")
    assert options == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///srv/a/simple",
        "--extra-index-url", "file:///srv/b/simple",
        "--find-links", "/env/wheels",
        "--find-links", "/more/wheels",
        "--constraint", "/etc/caps.txt",
        # pip takes the best version from all its indexes; uv, by default, from the first.
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


def test_no_configuration_no_options():
    assert uv_options(None) == []
