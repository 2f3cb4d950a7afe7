"""The `ood-jax coco-eval` and `ood-jax demo` commands, run as a user would."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ood_jax import cli
from ood_jax.metrics import coco
from ood_jax.testing import coco_cases


@pytest.fixture
def case_files(tmp_path):
    gt, dets = coco_cases.random_case(seed=3, num_images=20, num_categories=4)
    gt_path, det_path = tmp_path / "gt.json", tmp_path / "dets.json"
    gt_path.write_text(json.dumps(gt))
    det_path.write_text(json.dumps(dets))
    return gt, dets, gt_path, det_path


def test_coco_eval_prints_table_and_writes_json(case_files, tmp_path, capsys):
    gt, dets, gt_path, det_path = case_files
    out = tmp_path / "out" / "result.json"
    cli.main(["coco-eval", "--gt", str(gt_path), "--detections", str(det_path), "--json", str(out)])
    printed = capsys.readouterr().out
    expected = coco.evaluate_detailed(gt, dets)
    assert f"= {expected.stats['AP']:0.3f}" in printed.splitlines()[0]
    assert len(printed.strip().splitlines()) == 12
    written = json.loads(out.read_text())
    assert written["stats"] == pytest.approx(expected.stats, abs=0)
    names = dict(zip(coco.GroundTruth.from_coco(gt).category_ids.tolist(), expected.category_names))
    assert written["per_category_ap"] == {names[k]: v for k, v in expected.per_category_ap.items()}


def test_coco_eval_names_malformed_file(case_files, tmp_path):
    _, _, gt_path, _ = case_files
    bad = tmp_path / "broken.json"
    bad.write_text('[{"image_id": 1,')
    with pytest.raises(SystemExit, match="broken.json is not valid JSON"):
        cli.main(["coco-eval", "--gt", str(gt_path), "--detections", str(bad)])


def test_coco_eval_names_bad_detection(case_files, tmp_path):
    gt, dets, gt_path, _ = case_files
    dets = [dict(d) for d in dets]
    dets[5]["bbox"] = [1.0, 2.0, 0.0, 4.0]
    bad = tmp_path / "dets.json"
    bad.write_text(json.dumps(dets))
    with pytest.raises(SystemExit, match="detection 5"):
        cli.main(["coco-eval", "--gt", str(gt_path), "--detections", str(bad)])


@pytest.mark.slow
def test_console_script_runs_demo():
    result = subprocess.run(
        [sys.executable, "-m", "ood_jax", "coco-demo", "--images", "30", "--categories", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in result.stdout


@pytest.mark.parametrize("command", ["pretrain", "train", "evaluate"])
def test_detector_commands_have_help(command, capsys, monkeypatch):
    """`ood-jax train --help` lists the flags, an example, the configs, and the chosen config's
    description (its variants) and top-level fields with their values."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--help", "--config=configs/synthetic_detr.py:smoke"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ood-jax {command} [-h] --config FILE[:arg] --workdir DIR")
    for expected in (
        "--config.FIELD=VALUE",
        f"\n  ood-jax {command} --config=",
        "configs/counts_dino_r50.py: DINO-4scale-R50 on COUNTS",
        "Variants (`:arg`): (none) the demo run; `smoke`",
        "  total_steps = 30\n",
        "  optim.{",
    ):
        assert expected in out, expected


@pytest.mark.slow
def test_tensorflow_startup_notices_are_silenced():
    """TF prints oneDNN and CPU-feature notices at import; a command that loads TF (here the
    dataset registry, before its unknown-name error) prints only its own line."""
    result = subprocess.run(
        [sys.executable, "-m", "ood_jax", "build", "nope", "--data-dir", "/tmp/unused"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TF_")},
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: unknown dataset 'nope'; ours are counts, foci, oodbench, synthetic_shifts, "
        "corrupted (--debug shows the traceback)"
    ], result.stderr


@pytest.mark.parametrize(
    "interrupt, line",
    [
        (KeyboardInterrupt(), "interrupted: stopped by Ctrl-C"),
        (
            KeyboardInterrupt("3 replies kept; rerun to continue"),
            "interrupted: 3 replies kept; rerun to continue",
        ),
    ],
)
def test_ctrl_c_ends_with_one_line(interrupt, line, monkeypatch, capsys):
    def interrupted(**kwargs):
        raise interrupt

    monkeypatch.setattr(coco_cases, "random_case", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["coco-demo", "--images", "3"])
    assert exit_info.value.code == cli.INTERRUPTED_EXIT_CODE
    assert capsys.readouterr().err.splitlines() == [line]
