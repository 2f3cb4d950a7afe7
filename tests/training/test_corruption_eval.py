"""mPC and rPC against a hand computation, and a detector workdir evaluated on a corrupted
synthetic_shifts/tiny (`ood_jax.train.evaluate_corrupted`).

The workdir holds one checkpoint of the smoke config's initial parameters, saved as training
saves them: what is evaluated is the same code path as for any trained run, at none of a
training run's compile time.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from ood_jax import config_files, datasets, sharding
from ood_jax.data import counts, corruptions
from ood_jax.detection import corruption_eval, evaluation
from ood_jax.metrics import robustness
from ood_jax.train import evaluate_corrupted, resume, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
CORRUPTIONS = ("gaussian_noise", "contrast")
SEVERITIES = (1, 5)
IN_DOMAIN = ("dim", "painting")


def test_mpc_and_rpc_by_hand():
    scores = {"gaussian_noise": {1: 0.30, 3: 0.10}, "fog": {3: 0.20, 1: 0.40}}
    summary = robustness.summary(0.5, scores)
    # mPC = (0.30 + 0.10 + 0.40 + 0.20) / 4 = 0.25; rPC = 0.25 / 0.5 = 0.5
    assert summary == {
        "metric": "AP",
        "clean": 0.5,
        "scores": {"gaussian_noise": {"1": 0.3, "3": 0.1}, "fog": {"1": 0.4, "3": 0.2}},
        "mPC": pytest.approx(0.25, abs=1e-15),
        "rPC": pytest.approx(0.5, abs=1e-15),
    }
    assert list(summary) == ["metric", "clean", "scores", "mPC", "rPC"]
    assert list(summary["scores"]["fog"]) == ["1", "3"]


def test_mpc_over_the_paper_grid():
    # 15 x 5 scores c / 100 + s / 1000: mean c = 7, mean s = 3, so mPC = 0.07 + 0.003.
    scores = {
        name: {s: c / 100 + s / 1000 for s in corruptions.SEVERITIES}
        for c, name in enumerate(corruptions.NAMES)
    }
    assert robustness.mpc(scores) == pytest.approx(0.073, abs=1e-12)
    assert robustness.rpc(0.073, 0.146) == pytest.approx(0.5)


def test_mpc_needs_a_full_grid_and_rpc_a_clean_score():
    with pytest.raises(ValueError, match="corruption fog has severities \\[1\\] but"):
        robustness.mpc({"snow": {1: 0.2, 2: 0.1}, "fog": {1: 0.3}})
    with pytest.raises(ValueError, match="at least one corruption"):
        robustness.mpc({})
    summary = robustness.summary(0.0, {"fog": {1: 0.0}})
    assert summary["rPC"] is None and json.loads(json.dumps(summary))["rPC"] is None


def test_write(tmp_path):
    summaries = {
        "iid": robustness.summary(0.4, {"fog": {1: 0.2}}),
        "sky": robustness.summary(0.2, {"fog": {1: 0.1}}),
    }
    robustness.write(tmp_path, summaries, headline="iid")
    assert json.loads((tmp_path / "corruptions.json").read_text()) == summaries["iid"]
    for name, summary in summaries.items():
        assert json.loads((tmp_path / "corruptions" / f"{name}.json").read_text()) == summary


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """The smoke config and a corrupted build of its dataset."""
    data_dir = tmp_path_factory.mktemp("tfds")
    config = config_files.load(CONFIG_FILE, "smoke")
    config.dataset.data_dir = str(data_dir)
    # In-domain is then test_dim + test_painting: small, as is the corrupted build, which
    # holds sky's test split and no other held-out domain's, so those are left out.
    config.dataset.target_domains = tuple(d for d in counts.DOMAINS if d not in IN_DOMAIN)
    datasets.build("synthetic_shifts", str(data_dir), config="tiny")
    request = {
        "dataset": config.dataset.name,
        "corruptions": ",".join(CORRUPTIONS),
        "severities": ",".join(map(str, SEVERITIES)),
        "splits": "test_dim,test_painting,test_sky",
    }
    built = datasets.build("corrupted", str(data_dir), corruption=request)
    return {"config": config, "dataset": f"corrupted/{built.builder_config.name}"}


def _eval_input(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    eval_input = ml_collections.ConfigDict(config.input.to_dict())
    eval_input.batch_size = config.eval_batch_size
    return eval_input


@jax.jit
def _contrast_sensitive_oracle(batch: dict) -> dict:
    """The ground truth, each box moved right by a part of its width that grows as the image's
    contrast (its per-channel standard deviation, about 0.6 on clean images) falls under 0.5."""
    mask = batch["image_mask"][..., None]
    pixels = mask.sum((1, 2))
    mean = (batch["image"] * mask).sum((1, 2)) / pixels
    std = jnp.sqrt((((batch["image"] - mean[:, None, None]) ** 2) * mask).sum((1, 2)) / pixels)
    shift = 0.5 * jnp.clip(0.5 - std.mean(-1), 0.0, 1.0)
    boxes = batch["boxes"].at[..., 0].add(shift[:, None] * batch["boxes"][..., 2])
    return {
        "boxes": boxes,
        "scores": batch["box_mask"].astype(jnp.float32),
        "labels": batch["labels"],
    }


def test_each_split_is_evaluated_on_its_own_images(data):
    """With a detector that is exact on clean images and worse the lower their contrast: AP 1
    clean and under noise, lower under contrast, lowest at severity 5. (Sky's images, whose
    clean contrast is 0.57 to 0.66; dim ones would be under 0.5 clean.)"""
    config = data["config"]
    builder = datasets.load(data["dataset"], config.dataset.data_dir)
    splits = {"sky": "test_sky"}
    data_sharding = sharding.batch_sharding(sharding.make_mesh(config.mesh))
    summaries = corruption_eval.evaluate(
        _contrast_sensitive_oracle, builder, splits, _eval_input(config), data_sharding
    )
    for summary in summaries.values():
        scores = summary["scores"]
        assert summary["clean"] == 1.0 and scores["gaussian_noise"] == {"1": 1.0, "5": 1.0}
        assert 0 < scores["contrast"]["5"] < scores["contrast"]["1"] < 1
        mpc = (2.0 + scores["contrast"]["1"] + scores["contrast"]["5"]) / 4
        assert summary["mPC"] == pytest.approx(mpc, abs=1e-12)
        assert summary["rPC"] == pytest.approx(mpc, abs=1e-12)  # clean AP is 1


@pytest.fixture(scope="module")
def run(data, tmp_path_factory, compile_cache) -> dict:
    """`evaluate_corrupted` on a workdir holding a checkpoint of the initial parameters."""
    config = data["config"]
    workdir = tmp_path_factory.mktemp("run")
    experiment = train.setup(config, workdir)
    state = train.initial_state(config, experiment)
    meta = {"config": json.loads(config.to_json_best_effort())}
    experiment.checkpointer.save(1, state, meta, force=True)
    experiment.checkpointer.close()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        summaries = evaluate_corrupted.evaluate_corrupted(config, workdir, data["dataset"])
    return {**data, "workdir": workdir, "summaries": summaries, "out": out.getvalue()}


def test_files_and_their_schema(run):
    workdir, summaries = run["workdir"], run["summaries"]
    assert list(summaries) == ["iid", "sky"]
    assert "left out snow: corrupted/" in run["out"] and "has no test_snow__clean" in run["out"]
    assert json.loads((workdir / "corruptions.json").read_text()) == summaries["iid"]
    for name, summary in summaries.items():
        written = json.loads((workdir / "corruptions" / f"{name}.json").read_text())
        assert written == summary
        assert list(written) == ["metric", "clean", "scores", "mPC", "rPC"]
        assert list(written["scores"]) == list(CORRUPTIONS)
        assert all(list(s) == ["1", "5"] for s in written["scores"].values())
        # The hand computation, from the written numbers.
        values = [v for s in written["scores"].values() for v in s.values()]
        assert written["mPC"] == pytest.approx(sum(values) / 4, abs=1e-12)
        expected_rpc = written["mPC"] / written["clean"] if written["clean"] > 0 else None
        assert written["rPC"] == pytest.approx(expected_rpc)
    table = (workdir / corruption_eval.MARKDOWN).read_text()
    assert "| Split | clean AP | mPC | rPC |" in table
    for name, summary in summaries.items():
        assert f"| {name} | {summary['clean']:.3f} | {summary['mPC']:.3f} |" in table
    assert (workdir / corruption_eval.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scores_are_each_splits_own(run):
    """The numbers equal an evaluation of the same splits as `ood-jax evaluate` runs it: the
    clean one on the source dataset itself, a corrupted one on its own split."""
    config, summaries = run["config"], run["summaries"]
    experiment = train.setup(config, run["workdir"])
    state = resume.restore_newest(
        experiment.checkpointer, experiment.abstract_state, "evaluating step"
    ).state
    eval_input = _eval_input(config)
    builder = datasets.load(run["dataset"], config.dataset.data_dir)

    def ap(dataset, split):
        loaded = evaluation.load_split(dataset, split, eval_input, experiment.data_sharding)
        predict = lambda batch: experiment.predict(state, batch)  # noqa: E731
        return evaluation.evaluate_split(predict, loaded, experiment.data_sharding).stats["AP"]

    assert summaries["sky"]["clean"] == ap(experiment.builder, "test_sky")
    noisy = ap(builder, "test_sky__gaussian_noise_5")
    assert summaries["sky"]["scores"]["gaussian_noise"]["5"] == noisy
    experiment.checkpointer.close()


def test_another_datasets_corruptions_are_refused(run, tmp_path):
    config = ml_collections.ConfigDict(run["config"].to_dict())
    config.dataset.name = "synthetic_shifts/demo"
    with pytest.raises(ValueError, match="built from synthetic_shifts/tiny, but the run trained"):
        evaluate_corrupted.evaluate_corrupted(config, tmp_path, run["dataset"])
