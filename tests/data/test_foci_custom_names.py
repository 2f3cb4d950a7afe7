"""Custom FOCI sets built under names of their own live side by side in one data dir."""

from __future__ import annotations

import json
import pathlib

import pytest
import tensorflow_datasets as tfds
from test_foci_builder import _read_back, make_custom

from ood_jax import cli, datasets
from ood_jax.data import building
from ood_jax.eval.tasks.foci import Foci


def _two_sets(root: pathlib.Path) -> dict[str, set[str]]:
    """Two custom sources with different images; name -> the image paths it holds."""
    first, second = root / "first", root / "second"
    expected = make_custom(first)
    make_custom(second)
    # The second set keeps only its cats and dogs, so the two differ in their records.
    data = json.loads((second / "options.json").read_text())
    kept = {label: data[label] for label in ("cat", "dog")}
    (second / "options.json").write_text(json.dumps(kept))
    return {
        "set_a": set(expected),
        "set_b": {entry["image"] for group in kept.values() for entry in group},
    }


def _cli_build(src: pathlib.Path, data_dir: pathlib.Path, *extra: str) -> None:
    cli.main(
        ["build", "foci", "--config", "custom", "--source", str(src), "--data-dir", str(data_dir)]
        + list(extra)
    )


def test_two_named_sets_live_side_by_side(tmp_path, capsys):
    images = _two_sets(tmp_path)
    data_dir = tmp_path / "data"
    _cli_build(tmp_path / "first", data_dir, "--name", "set_a")
    _cli_build(tmp_path / "second", data_dir, "--name", "set_b")
    assert "foci/set_b 1.0.0" in capsys.readouterr().out
    for name, expected in images.items():
        directory = data_dir / "foci" / name / "1.0.0"
        # A reader without ood_jax opens it with plain TFDS.
        plain = tfds.builder_from_directory(str(directory))
        assert plain.info.config_name == name
        records = _read_back(plain)
        assert set(records) == expected
        assert {r["dataset"].decode() for r in records.values()} == {name}
        assert building.BuildRecord.read(directory).config == name
        loaded = datasets.load(f"foci/{name}", str(data_dir))
        assert loaded.info.splits["test"].num_examples == len(expected)
        # A rebuild from the same source finds its own set, not the other one.
        again = datasets.build(
            "foci", str(data_dir), str(tmp_path / ("first" if name == "set_a" else "second")),
            config="custom", custom_name=name,
        )  # fmt: skip
        assert again.reused
    # eval-mllm foci --config set_a,set_b reads each under its own name.
    benchmark = Foci(str(data_dir), ["set_a", "set_b"])
    assert benchmark.count() == sum(len(v) for v in images.values())
    asked = {item.meta["dataset"] for item in benchmark.items()}
    assert asked == {"set_a", "set_b"}


def test_without_a_name_it_stays_custom(tmp_path):
    make_custom(tmp_path / "src")
    _cli_build(tmp_path / "src", tmp_path / "data")
    records = _read_back(datasets.load("foci/custom", str(tmp_path / "data")))
    assert {r["dataset"].decode() for r in records.values()} == {"custom"}


@pytest.mark.parametrize(
    "config, name, message",
    [
        ("custom", "Set-A", r"--name 'Set-A': a custom set's name must be one lowercase word"),
        ("custom", "9lives", r"--name '9lives': a custom set's name must be one lowercase word"),
        ("custom", "food101", r"--name food101: that is foci's config food101"),
        ("food101", "mine", r"--name mine: only a custom set is named \(--config custom\)"),
    ],
)
def test_bad_names_are_refused(tmp_path, config, name, message):
    make_custom(tmp_path / "src")
    with pytest.raises(building.BuildError, match=message):
        datasets.build(
            "foci", str(tmp_path / "d"), str(tmp_path / "src"), config=config, custom_name=name
        )
    assert not (tmp_path / "d" / "foci" / name).exists()


def test_a_missing_named_set_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--config custom --name set_c --data-dir"):
        datasets.load("foci/set_c", str(tmp_path))
    with pytest.raises(building.BuildError, match=r"unknown config 'set_c'.*--name NAME"):
        datasets.build("foci", str(tmp_path), str(tmp_path), config="set_c")
