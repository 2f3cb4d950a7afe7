"""Model selection (ood_jax/train/selection.py) and `ood-jax sweep` (ood_jax/train/sweep.py).

* the training-domain validation slice is disjoint from what a run trains on, together they
  are the training set, and it depends on the seed; a leave-one-domain-out job trains on no
  image of its domain and validates on all of them;
* each protocol's rule, on made-up records where every protocol picks another step;
* an image subset's AP from the matches equals evaluating the subset alone (the oracle slices);
* a tiny sweep (2 seeds, every protocol, 2 left-out domains, 2 steps evaluated each) through
  the CLI: each protocol selects what its rule computes from the records the runs wrote,
  mean and std are numpy's, results.md shows every protocol, `--aggregate-only` gives the same
  results, and a rerun keeps the finished jobs.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds

from ood_jax import cli, config_files, datasets
from ood_jax.data import counts
from ood_jax.metrics import coco
from ood_jax.testing import coco_cases
from ood_jax.train import config_checks, selection, sweep, train

# Trains, launches processes or starts servers: left out of `make test-fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "configs" / "synthetic_detr.py"
SEEDS = (0, 1)
TARGETS = ("sky", "dim")  # 12 training domains, 2 targets: few evaluation passes per step
LEFT_OUT = ("snow",)  # one left-out run per seed: the rule over several is tested on records
STEPS = 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    datasets.build("synthetic_shifts", str(path), config="tiny")
    return path


def sweep_argv(sweep_dir: pathlib.Path, data_dir: pathlib.Path) -> list[str]:
    return [
        "sweep",
        f"--config={CONFIG_FILE}:smoke",
        f"--workdir={sweep_dir}",
        f"--seeds={len(SEEDS)}",
        "--protocols=" + ",".join(selection.PROTOCOLS),
        "--leave-out=" + ",".join(LEFT_OUT),
        f"--config.dataset.data_dir={data_dir}",
        f"--config.dataset.target_domains={TARGETS!r}",
        f"--config.total_steps={STEPS}",
        "--config.eval_every=1",
        "--config.checkpoint_every=1",
        "--config.log_every=1",
    ]


@pytest.fixture(scope="module")
def swept(tmp_path_factory, data_dir, compile_cache):
    sweep_dir = tmp_path_factory.mktemp("sweep")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(sweep_argv(sweep_dir, data_dir))
    plan = json.loads((sweep_dir / sweep.PLAN_FILE).read_text())
    return {
        "dir": sweep_dir,
        "stdout": out.getvalue(),
        "plan": plan,
        "results": json.loads((sweep_dir / "results.json").read_text()),
        "results_md": (sweep_dir / "results.md").read_text(),
        "records": {
            job["name"]: selection.read_evaluations(sweep_dir / job["name"]) for job in plan["jobs"]
        },
    }


def smoke_config(data_dir: pathlib.Path):
    config = config_files.load(CONFIG_FILE, "smoke")
    config.dataset.data_dir = str(data_dir)
    config.dataset.target_domains = TARGETS
    return config


def image_ids(builder: tfds.core.DatasetBuilder, split: str) -> list[int]:
    dataset = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
    return [int(ex["image/id"]) for ex in dataset.as_numpy_iterator()]


def domains_of(builder: tfds.core.DatasetBuilder, split: str) -> set[str]:
    dataset = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
    return {counts.DOMAINS[int(ex["domain"])] for ex in dataset.as_numpy_iterator()}


# ------------------------------------------------------------------------------------------------
# Splits: the validation slice and the left-out domain.
# ------------------------------------------------------------------------------------------------


def rows(expression: str, name: str, n: int) -> list[int]:
    """The record positions of split `name` (n records) that `expression` reads."""
    out: list[int] = []
    for part in filter(None, expression.split("+")):
        if part == name:
            out += range(n)
        elif part.startswith(name + "["):
            low, high = part[len(name) + 1 : -1].split(":")
            out += range(int(low or 0), int(high or n))
    return out


def test_hold_out_windows_partition_each_split():
    sizes = {"train_dim": 10, "train_snow": 7, "train_sky": 1}
    for seed in range(20):
        kept, held = counts.hold_out_windows("+".join(sizes), sizes, 0.2, seed)
        for name, n in sizes.items():
            assert len(rows(held, name, n)) == round(0.2 * n), (seed, name)
            assert sorted(rows(held, name, n) + rows(kept, name, n)) == list(range(n))
    windows = {
        counts.hold_out_windows("train_dim", {"train_dim": 100}, 0.2, s)[1] for s in range(5)
    }
    assert len(windows) == 5  # the seed moves the window
    assert counts.hold_out_windows("train_dim", {"train_dim": 10}, 0.0, 3) == ("train_dim", "")


def test_validation_slice_is_disjoint_from_training_and_depends_on_the_seed(data_dir):
    config = smoke_config(data_dir)
    builder = train.load_builder(config.dataset)
    everything = image_ids(builder, train.experiment_splits(config.dataset, builder)["train"])
    config.selection.val_fraction = 0.2
    held_out = {}
    for seed in SEEDS:
        splits = train.experiment_splits(config.dataset, builder, config.selection, seed)
        trained, held_out[seed] = (
            image_ids(builder, splits["train"]),
            image_ids(builder, splits[selection.VALIDATION]),
        )
        assert not set(trained) & set(held_out[seed])
        assert sorted(trained + held_out[seed]) == sorted(everything)  # each image once
        # round(0.2 * 8) = 2 of the 8 training images of each of the 12 training domains
        assert len(held_out[seed]) == 2 * (len(counts.DOMAINS) - len(TARGETS))
    assert set(held_out[0]) != set(held_out[1])


def test_leave_one_domain_out_trains_on_none_of_its_images(data_dir):
    config = smoke_config(data_dir)
    builder = train.load_builder(config.dataset)
    config.selection.leave_out = "painting"
    splits = train.experiment_splits(config.dataset, builder, config.selection, 0)
    assert domains_of(builder, splits[selection.LEFT_OUT]) == {"painting"}
    assert "painting" not in domains_of(builder, splits["train"])
    assert len(image_ids(builder, splits[selection.LEFT_OUT])) == 8  # all of them
    config.selection.leave_out = "sky"
    with pytest.raises(ValueError, match="config.selection.leave_out: sky is a target"):
        train.experiment_splits(config.dataset, builder, config.selection, 0)


def test_selection_fractions_are_checked(data_dir):
    config = smoke_config(data_dir)
    config.selection.val_fraction = 1.0
    with pytest.raises(ValueError, match=r"config.selection.val_fraction: .*\[0, 1\)"):
        config_checks.check_numbers(config)


# ------------------------------------------------------------------------------------------------
# Rules, on made-up records.
# ------------------------------------------------------------------------------------------------


def record(step: int, validation: float, oracle: tuple[float, float], iid: float = 0.5) -> dict:
    return {
        "step": step,
        "iid": {"AP": iid},
        "per_domain": {"sky": {"AP": 0.1 * step}, "dim": {"AP": 0.2 * step}},
        "ood_average": {"AP": 0.15 * step},
        selection.VALIDATION: {"AP": validation},
        "oracle": {"sky": {"AP": oracle[0]}, "dim": {"AP": oracle[1]}},
        "oracle_average": float(np.mean(oracle)),
    }


def left_out_run(*aps: float) -> list[dict]:
    """The records of a run without some domain: its AP there at steps 1, 2, ..."""
    return [{"step": step, selection.LEFT_OUT: {"AP": ap}} for step, ap in enumerate(aps, 1)]


def test_each_rule_selects_its_step():
    records = [
        record(1, validation=0.30, oracle=(0.1, 0.1)),
        record(2, validation=0.20, oracle=(0.4, 0.2)),
        record(3, validation=0.10, oracle=(0.0, 0.1)),
        record(4, validation=0.25, oracle=(0.2, 0.3)),  # oracle 0.25: below step 2's 0.3
    ]
    left_out = {"painting": left_out_run(0, 0, 0.6, 0), "snow": left_out_run(0.2, 0, 0, 0.1)}
    chosen = {p: selection.select(p, records, left_out) for p in selection.PROTOCOLS}
    assert {p: c.step for p, c in chosen.items()} == {
        "last": 4,
        "training_domain": 1,
        "leave_one_domain_out": 3,  # mean 0.3, against 0.1, 0, 0.05
        "oracle": 2,
    }
    assert chosen["last"].value is None
    assert chosen["leave_one_domain_out"].value == pytest.approx(0.3)
    assert chosen["oracle"].record is records[1]


def test_ties_go_to_the_later_step_and_loo_uses_common_steps():
    records = [record(s, validation=0.2, oracle=(0.1, 0.1)) for s in (1, 2, 3)]
    assert selection.select("training_domain", records).step == 3
    assert selection.select("oracle", records).step == 3
    left_out = {"painting": left_out_run(0.1, 0.1, 0.5), "snow": left_out_run(0.1, 0.1)}  # no 3
    assert selection.select("leave_one_domain_out", records, left_out).step == 2
    without = [{k: v for k, v in r.items() if k != selection.VALIDATION} for r in records]
    with pytest.raises(ValueError, match="val_fraction"):
        selection.select("training_domain", without)


def test_subset_ap_equals_evaluating_the_subset_alone():
    gt, detections = coco_cases.random_case(seed=3, num_images=30, num_categories=4)
    result = coco.evaluate_detailed(gt, detections)
    mask = selection.oracle_mask(result.matches.image_ids, 0.3, seed=1, domain="sky")
    assert mask.sum() == 9
    kept = set(result.matches.image_ids[mask].tolist())
    subset_gt = {
        **gt,
        "images": [im for im in gt["images"] if im["id"] in kept],
        "annotations": [a for a in gt["annotations"] if a["image_id"] in kept],
    }
    expected = coco.evaluate(subset_gt, [d for d in detections if d["image_id"] in kept])
    got = selection.subset_ap(result.matches, mask)
    for name in ("AP", "AP50", "AP75"):
        assert got[name] == pytest.approx(expected[name], abs=1e-12), name
    # The slice is chosen by the ids, whatever order they come in.
    shuffled = result.matches.image_ids[::-1]
    assert set(shuffled[selection.oracle_mask(shuffled, 0.3, 1, "sky")].tolist()) == kept


# ------------------------------------------------------------------------------------------------
# A tiny sweep through the CLI.
# ------------------------------------------------------------------------------------------------


def test_sweep_runs_every_job_and_records_every_evaluated_step(swept):
    names = [job["name"] for job in swept["plan"]["jobs"]]
    assert names == [f"seed{s}" for s in SEEDS] + [
        f"seed{s}_loo_{d}" for s in SEEDS for d in LEFT_OUT
    ]
    for name, records in swept["records"].items():
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
        assert all(selection.VALIDATION in r for r in records), name
        assert all((selection.LEFT_OUT in r) == ("_loo_" in name) for r in records), name
        assert set(records[0]["per_domain"]) == set(TARGETS)
        # The last record is the final evaluation, which results.json reports.
        results = json.loads((swept["dir"] / name / "results.json").read_text())
        assert results["step"] == STEPS
        assert results["iid"] == records[-1]["iid"]
        assert results["per_domain"] == records[-1]["per_domain"]
    manifest = json.loads((swept["dir"] / "seed1_loo_snow" / "manifest.json").read_text())
    assert "train_snow" not in manifest["dataset"]["splits"]["train"]
    assert manifest["dataset"]["splits"][selection.LEFT_OUT] == "train_snow"


def _expected_step(protocol: str, seed: int, records: dict) -> tuple[int, float | None]:
    """The rules of selection.py's docstring, computed here from the records alone."""
    own = records[f"seed{seed}"]
    if protocol == "last":
        return own[-1]["step"], None
    if protocol == "training_domain":
        values = {r["step"]: r["validation"]["AP"] for r in own}
    elif protocol == "oracle":
        values = {r["step"]: np.mean([r["oracle"][t]["AP"] for t in TARGETS]) for r in own}
    else:
        runs = [records[f"seed{seed}_loo_{d}"] for d in LEFT_OUT]
        values = {
            r["step"]: np.mean([run[i]["left_out"]["AP"] for run in runs])
            for i, r in enumerate(own)
        }
    best = max(values.values())
    return max(s for s, v in values.items() if v == best), best


def test_each_protocol_selects_the_step_its_rule_says(swept):
    records = swept["records"]
    for protocol, result in swept["results"]["protocols"].items():
        assert [e["seed"] for e in result["per_seed"]] == list(SEEDS)
        for entry in result["per_seed"]:
            step, value = _expected_step(protocol, entry["seed"], records)
            assert entry["step"] == step, (protocol, entry)
            assert entry["value"] == pytest.approx(value), (protocol, entry)
            reported = records[f"seed{entry['seed']}"][step - 1]
            assert entry["iid"] == reported["iid"]["AP"]
            assert entry["per_domain"] == {t: reported["per_domain"][t]["AP"] for t in TARGETS}
            assert entry["ood_average"] == pytest.approx(
                np.mean([reported["per_domain"][t]["AP"] for t in TARGETS])
            )


def test_mean_and_std_over_seeds_are_numpys(swept):
    for protocol, result in swept["results"]["protocols"].items():
        for column in ("iid", *TARGETS, "ood_average"):
            values = [
                e["per_domain"][column] if column in TARGETS else e[column]
                for e in result["per_seed"]
            ]
            assert result["mean"][column] == pytest.approx(np.mean(values)), (protocol, column)
            assert result["std"][column] == pytest.approx(np.std(values, ddof=1)), (
                protocol,
                column,
            )


def test_results_md_shows_every_protocol_and_seed(swept):
    markdown = swept["results_md"]
    for protocol, result in swept["results"]["protocols"].items():
        assert markdown.count(f"| {selection.PROTOCOLS[protocol]} |") == 1 + len(SEEDS)
        mean, std = result["mean"]["ood_average"], result["std"]["ood_average"]
        assert f"{sweep._number(mean)} ± {sweep._number(std)}" in markdown
    assert "upper bound" in markdown and "COUNTS paper" in markdown
    assert markdown.strip() in swept["stdout"]


def test_aggregate_only_gives_the_same_results(swept, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(swept["dir"], copy)
    (copy / "results.json").unlink()
    (copy / "results.md").unlink()
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["sweep", f"--workdir={copy}", "--aggregate-only"])
    assert json.loads((copy / "results.json").read_text()) == swept["results"]
    assert (copy / "results.md").read_text() == swept["results_md"]
    shutil.rmtree(copy / "seed1_loo_snow")
    with pytest.raises(SystemExit, match="seed1_loo_snow not finished"):
        cli.main(["sweep", f"--workdir={copy}", "--aggregate-only"])


def test_domainbed_conventions_aggregate_the_same_runs(swept, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(swept["dir"], copy)
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["sweep", f"--workdir={copy}", "--aggregate-only", "--conventions=domainbed"])
    results = json.loads((copy / "results.json").read_text())
    assert results["conventions"] == "domainbed"
    sources = [d for d in counts.DOMAINS if d not in TARGETS]
    for name, records in swept["records"].items():
        kept = [d for d in sources if not name.endswith(f"_loo_{d}")]
        for r in records:  # every training domain the validation slice holds, in DOMAINS order
            domains = list(r[selection.VALIDATION_BY_DOMAIN])
            assert (
                domains and set(domains) <= set(kept) and domains == sorted(domains, key=kept.index)
            )
    for entry in results["protocols"]["training_domain"]["per_seed"]:
        own = swept["records"][f"seed{entry['seed']}"]
        values = [
            np.mean([v["AP"] for v in r[selection.VALIDATION_BY_DOMAIN].values()]) for r in own
        ]
        assert entry["step"] == own[int(np.argmax(values))]["step"]  # the first of equal values
    assert results["protocols"]["oracle"]["per_seed"][0]["step"] == STEPS
    spread = results["protocols"]["last"]["standard_error"]["ood_average"]
    values = [e["ood_average"] for e in results["protocols"]["last"]["per_seed"]]
    assert spread == pytest.approx(np.std(values) / np.sqrt(len(values)))
    assert "standard error, by DomainBed's conventions" in (copy / "results.md").read_text()


def test_rerun_keeps_finished_jobs_and_refuses_other_jobs(swept, data_dir):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(sweep_argv(swept["dir"], data_dir))
    assert out.getvalue().count("has finished") == len(swept["plan"]["jobs"])
    assert json.loads((swept["dir"] / "results.json").read_text()) == swept["results"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main([*sweep_argv(swept["dir"], data_dir), "--list-jobs"])
    assert out.getvalue().split() == [job["name"] for job in swept["plan"]["jobs"]]
    with pytest.raises(SystemExit, match="holds a sweep with other seeds, jobs"):
        cli.main([*sweep_argv(swept["dir"], data_dir), "--seeds=3"])
