"""Each bench in bench/ runs at its `--smoke` size and ends with its result line.

What breaks here is an API the bench calls or the shape of its last line, found by CI rather
than by the next person who runs the bench; no timing is asserted (the toy sizes mean nothing).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _bench_common():
    """bench/common.py (the result line's reader) under a name of its own: `common` alone
    could be another module on the path."""
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _bench_common()

pytestmark = pytest.mark.slow

# Measured in the fresh-clone suite run of 6397ae5 on 2 cores: dino_step ~40 s and
# detr_train_step ~30 s (toy train steps compiled), onnx_inference ~23 s (converts two toy
# detectors), paper_scorers ~14 s (four toy towers), each of the others under 11 s.
BENCHES = [
    "coco_eval",
    "ap_bootstrap",
    "client_throughput",
    "input_pipeline",
    "scorer_throughput",
    "paper_scorers",
    "dino_step",
    "detr_train_step",
    "onnx_inference",
    "iterator_teardown",
]

# The "distance from the limit" each bench adds to its result line (bench/common.py's
# device_figures and step_figures): achieved TFLOP/s, MFU as a fraction, and the peak it divides
# by (on CPU a matmul measured in the run).
FIGURES = {
    "detr_train_step": ("train_tflops", "train_mfu", "predict_tflops", "predict_mfu"),
    "dino_step": ("train_tflops", "train_mfu", "predict_tflops", "predict_mfu"),
    "scorer_throughput": ("ours_tflops", "ours_mfu", "peer_tflops"),
}


@pytest.mark.parametrize("bench", BENCHES)
def test_smoke_ends_with_result_line(bench):
    done = subprocess.run(
        [sys.executable, f"bench/{bench}.py", "--smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    record = common.parse_result_line(lines[-1])
    assert record["name"] == bench
    assert isinstance(record["ours_s"], float) and record["ours_s"] > 0
    if bench != "input_pipeline":  # no peer unless a train step's length is given
        assert isinstance(record["peer"], str)
        assert record["ratio"] == pytest.approx(record["peer_s"] / record["ours_s"], rel=1e-3)
    assert "warm-up" in record["stat"]
    if bench in FIGURES:
        for key in (*FIGURES[bench], "peak_tflops"):
            value = record[key]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
        assert record["peak_source"] in ("measured", "datasheet", "PEAK_TFLOPS")
        assert any(line.startswith("  peak for MFU: ") for line in lines)


@pytest.mark.parametrize("flag", [["--remat"], ["--dn", "20"]])
def test_dino_memory_refuses_the_timed_steps_flags(flag):
    """`--memory` measures the trainer's step with its config's remat and denoising queries: a
    flag it would not apply is one error line, not a silently different measurement."""
    done = subprocess.run(
        [sys.executable, "bench/dino_step.py", "--memory", *flag],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "error: --memory measures the trainer's step" in done.stderr.splitlines()[-1]
