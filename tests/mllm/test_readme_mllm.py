"""The offline MLLM walk-through of docs/guide/mllm.md, line for line: build, mine, two tiny
local VLMs, two eval-mllm runs, rescore and compare, each through the command it names."""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys

import pytest

from ood_jax import cli
from ood_jax.eval import store

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide" / "mllm.md"
MARKER = "(`tests/mllm/test_readme_mllm.py` runs exactly these lines.)"


def walkthrough() -> list[str]:
    """The command lines of the fenced block just above MARKER."""
    text = GUIDE.read_text()
    before = text[: text.index(MARKER)].rstrip()
    assert before.endswith("```"), "the walk-through block must end right above the marker"
    block = before[: -len("```")].rsplit("```", 1)[1]
    return [line for line in block.strip().splitlines() if line.strip()]


def test_the_documented_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    lines = walkthrough()
    assert [shlex.split(line)[:2] for line in lines[-2:]] == [
        ["ood-jax", "rescore"],
        ["ood-jax", "compare"],
    ]
    monkeypatch.chdir(tmp_path)
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "python":
            subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True)
        else:
            assert argv[0] == "ood-jax", line
            cli.main(argv[1:])
    out = capsys.readouterr().out
    for run in ("runs/llava", "runs/qwen"):
        results = json.loads((tmp_path / run / store.RESULTS_JSON).read_text())
        assert results["complete"] is True and results["num_items"] == 20
        assert (tmp_path / run / "manifest.json").is_file()
    # rescore wrote the other mode beside the run's own results; compare paired the two runs.
    assert (tmp_path / "runs/llava/results.last.json").is_file()
    assert "A: runs/llava" in out and "B: runs/qwen" in out
    assert "20 items compared" in out
