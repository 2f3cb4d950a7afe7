"""A user's mistake ends in one `error:` line naming the file, field or value, not a traceback.

Each case runs the real `ood-jax` entry point (`cli.main`) in-process; `--debug` re-raises.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from ood_jax import cli
from ood_jax.testing import coco_cases

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "synthetic_detr.py"


def error_line(argv: list[str]) -> str:
    """The message `cli.main(argv)` exits with; it must be one line starting with `error:`."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith("error: "), message
    assert "\n" not in message and "Traceback" not in message, message
    return message


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from ood_jax import datasets

    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def detector_argv(command: str, workdir, data_dir, *extra: str) -> list[str]:
    return [
        command,
        f"--config={CONFIG}:smoke",
        f"--workdir={workdir}",
        f"--config.dataset.data_dir={data_dir}",
        *extra,
    ]


# ------------------------------------------------------------------------------------------------
# Datasets.
# ------------------------------------------------------------------------------------------------


def test_unknown_builder_config_lists_the_configs(tmp_path):
    message = error_line(
        ["build", "synthetic_shifts", "--config", "nope", "--data-dir", str(tmp_path)]
    )
    assert "unknown config 'nope'" in message and "tiny" in message and "demo" in message


def test_a_builder_with_several_configs_needs_one(tmp_path):
    message = error_line(
        ["build", "foci", "--source", str(tmp_path), "--data-dir", str(tmp_path / "out")]
    )
    assert "foci: choose a config with --config" in message and "food101" in message


def test_data_dir_under_a_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = error_line(
        ["build", "synthetic_shifts", "--config", "tiny", "--data-dir", str(blocker / "tfds")]
    )
    assert f"--data-dir {blocker / 'tfds'}" in message and "cannot be created" in message


def test_non_utf8_annotation_file_is_named(tmp_path):
    annotations = tmp_path / "src" / "annotations"
    annotations.mkdir(parents=True)
    bad = annotations / "train.json"
    bad.write_bytes(b"\xff\xfe{}")
    message = error_line(
        ["build", "counts", "--source", str(tmp_path / "src"), "--data-dir", str(tmp_path / "out")]
    )
    assert f"{bad}: not UTF-8" in message


# ------------------------------------------------------------------------------------------------
# Configs, checkpoints and exports.
# ------------------------------------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    message = error_line(["train", f"--config={tmp_path / 'nope.py'}", f"--workdir={tmp_path}"])
    assert f"config file {tmp_path / 'nope.py'} does not exist" in message


def test_unknown_config_variant(tmp_path):
    message = error_line(["train", f"--config={CONFIG}:nope", f"--workdir={tmp_path}"])
    assert "unknown variant 'nope'" in message and "smoke" in message


def test_unknown_override_field_suggests_the_close_one(tmp_path):
    message = error_line(
        ["train", f"--config={CONFIG}:smoke", f"--workdir={tmp_path}", "--config.optim.lrr=1"]
    )
    assert "--config.optim.lrr: config.optim has no field 'lrr'; did you mean lr?" in message


def test_unknown_model_name(tmp_path, data_dir):
    message = error_line(detector_argv("evaluate", tmp_path, data_dir, "--config.model.name=foo"))
    assert "config.model.name: unknown model 'foo'" in message and "detr" in message


def test_evaluate_without_a_checkpoint(tmp_path, data_dir):
    message = error_line(detector_argv("evaluate", tmp_path / "run", data_dir))
    assert "no checkpoint in" in message and "train first" in message


def test_export_without_a_checkpoint(tmp_path):
    message = error_line(["export", f"--workdir={tmp_path}", f"--out={tmp_path / 'm.msgpack'}"])
    assert f"{tmp_path / 'checkpoints'}: no checkpoints directory" in message


def test_export_out_is_a_directory(tmp_path):
    message = error_line(["export", f"--workdir={tmp_path}", f"--out={tmp_path}"])
    assert f"--out {tmp_path}: is a directory" in message


@pytest.mark.parametrize(
    "override, field",
    [
        ("total_steps=-5", "config.total_steps: must be >= 1, got -5"),
        ("input.batch_size=0", "config.input.batch_size: must be >= 1, got 0"),
        ("optim.lr=-0.1", "config.optim.lr: must be >= 0.0, got -0.1"),
        ("optim.clip_norm=0.0", "config.optim.clip_norm: must be > 0.0, got 0.0"),
    ],
)
def test_out_of_range_numbers_are_named(tmp_path, data_dir, override, field):
    message = error_line(detector_argv("train", tmp_path / "run", data_dir, f"--config.{override}"))
    assert field in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_pretrain_with_backbone_weights_given(tmp_path, data_dir):
    message = error_line(
        detector_argv(
            "pretrain",
            tmp_path / "run",
            data_dir,
            "--config.pretrain.steps=2",
            f"--config.model.backbone_weights={tmp_path / 'r18.pth'}",
        )
    )
    assert "config.model.backbone_weights is set" in message
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(["--debug", "train", f"--config={tmp_path / 'nope.py'}", f"--workdir={tmp_path}"])


# ------------------------------------------------------------------------------------------------
# COCO evaluation and statistics.
# ------------------------------------------------------------------------------------------------


def test_coco_eval_names_a_non_numeric_score(tmp_path):
    gt, detections = coco_cases.random_case(seed=1, num_images=3, num_categories=2)
    detections[1]["score"] = "high"
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dets.json").write_text(json.dumps(detections))
    message = error_line(
        [
            "coco-eval",
            "--gt",
            str(tmp_path / "gt.json"),
            "--detections",
            str(tmp_path / "dets.json"),
        ]
    )
    assert "detection 1: field 'score' is 'high', expected a number" in message


def test_stats_vector_with_a_string(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([0.1, "x", 0.3]))
    (tmp_path / "b.json").write_text(json.dumps([0.2, 0.1, 0.3]))
    message = error_line(
        ["stats", "f-test", "--x", str(tmp_path / "a.json"), "--y", str(tmp_path / "b.json")]
    )
    assert f"{tmp_path / 'a.json'}: entry 1 is 'x', expected a number" in message


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--bandwidth", "0", "must be a finite number > 0"),
        ("--permutations", "-1", "must be >= 0"),
        ("--confidence", "1.5", "must lie strictly between 0 and 1"),
    ],
)
def test_stats_numbers_are_checked(tmp_path, capsys, flag, value, expected):
    for name in ("x", "y"):
        np.save(tmp_path / f"{name}.npy", np.zeros((3, 2)))
    points = ["--x", str(tmp_path / "x.npy"), "--y", str(tmp_path / "y.npy")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["stats", "mmd", *points, flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_stats_mmd_given_json(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps([[0.0, 1.0]]))
    np.save(tmp_path / "y.npy", np.zeros((3, 2)))
    message = error_line(
        ["stats", "mmd", "--x", str(tmp_path / "x.json"), "--y", str(tmp_path / "y.npy")]
    )
    assert f"{tmp_path / 'x.json'}: expected a .npy array" in message
