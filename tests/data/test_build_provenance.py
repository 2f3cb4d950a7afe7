"""`ood-jax build` never passes off stale, empty or half-written data as a finished dataset.

Each build records its source in the dataset (`ood_jax_build.json`); a rebuild from the same
source does nothing and prints the stored summary, one from another source is refused unless
`--overwrite`, which swaps the new dataset in only once it is complete. A build that would write
an empty split fails naming it, with the skip report printed; partial builds of killed runs are
removed at the next build. Most cases run the real entry point (`cli.main`) as a user would.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from ood_jax import __version__, cli, datasets
from ood_jax.data import building

RECORD = "ood_jax_build.json"  # the build record, beside TFDS's dataset_info.json


def error_line(argv: list[str]) -> str:
    """The message `cli.main(argv)` exits with; it must be one line starting with `error:`."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith("error: "), message
    assert "\n" not in message and "Traceback" not in message, message
    return message


def _image(path: pathlib.Path, shade: int, width: int = 20, height: int = 16) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((height, width, 3), shade, np.uint8)).save(path, format="JPEG")


def make_counts(src: pathlib.Path, images: int = 2, splits=("train",)) -> pathlib.Path:
    """A COUNTS release of `images` snow images per split, each with one box past the edge."""
    for split in splits:
        records, annotations = [], []
        for i in range(images):
            name = f"{split}_{i}.jpg"
            _image(src / "images" / name, 30 * i)
            records.append(
                {"id": i + 1, "file_name": name, "width": 20, "height": 16, "domain": "snow"}
            )
            annotations.append(
                {"id": 100 + i, "image_id": i + 1, "category_id": 1, "bbox": [16, 2, 9, 5]}
            )
        coco = {
            "images": records,
            "annotations": annotations,
            "categories": [{"id": 1, "name": "person"}],
        }
        (src / "annotations").mkdir(parents=True, exist_ok=True)
        (src / "annotations" / f"{split}.json").write_text(json.dumps(coco))
    return src


def make_foci(src: pathlib.Path, images: int = 2) -> pathlib.Path:
    """A FOCI `custom` source: `images` questions with four options each."""
    classes = ["cat", "dog", "cow", "hen"]
    entries: dict[str, list] = {}
    for i in range(images):
        label = classes[i % 4]
        _image(src / "photos" / f"{i}.jpg", 40 * i)
        options = [classes[(i + k) % 4] for k in range(4)]
        entries.setdefault(label, []).append(
            {"image": f"photos/{i}.jpg", "options": options, "groundtruth": label}
        )
    (src / "options.json").write_text(json.dumps(entries))
    return src


def make_oodbench(src: pathlib.Path, split_lines) -> pathlib.Path:
    """An OODBench source: three COCO images with a cat each, and the given splits.jsonl."""
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in (1, 2, 3)]
    for i in (1, 2, 3):
        _image(src / "images" / f"{i}.jpg", 50 * i)
    annotations = [
        {"id": i, "image_id": i, "category_id": 1, "bbox": [1, 1, 4, 4]} for i in (1, 2, 3)
    ]
    categories = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]
    (src / "annotations.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    lines = [json.dumps({"image_id": i, "category": c, "split": s}) for i, c, s in split_lines]
    (src / "splits.jsonl").write_text("".join(line + "\n" for line in lines))
    return src


ALL_SPLITS = [(1, "cat", "ID"), (2, "dog", "OOD-S"), (3, "cat", "OOD-H")]


def build_argv(name: str, data_dir: pathlib.Path, source=None, *extra: str) -> list[str]:
    argv = ["build", name, "--data-dir", str(data_dir), *extra]
    return argv + (["--source", str(source)] if source is not None else [])


def _train_snow_ids(data_dir: pathlib.Path) -> list[int]:
    builder = tfds.builder_from_directory(str(data_dir / "counts" / "1.1.0"))
    return sorted(int(r["image/id"]) for r in tfds.as_numpy(builder.as_dataset("train_snow")))


@pytest.fixture(scope="module")
def counts_build(tmp_path_factory):
    """COUNTS built once from source A (2 images, 2 boxes clipped), through the CLI."""
    tmp = tmp_path_factory.mktemp("counts")
    source = make_counts(tmp / "a")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        cli.main(build_argv("counts", tmp / "data", source))
    return source, tmp / "data", stdout.getvalue()


# ------------------------------------------------------------------------------------------------
# 1. Provenance: the same source does nothing, another one is refused, --overwrite is atomic.
# ------------------------------------------------------------------------------------------------


def test_the_build_records_its_source(counts_build):
    source, data_dir, printed = counts_build
    record = json.loads((data_dir / "counts" / "1.1.0" / RECORD).read_text())
    annotation = (source / "annotations" / "train.json").read_bytes()
    assert record["source"] == str(source.resolve())
    # Annotation files only, never images, each by its SHA-256.
    assert record["files"] == {"annotations/train.json": hashlib.sha256(annotation).hexdigest()}
    assert (record["builder"], record["config"], record["version"]) == ("counts", None, "1.1.0")
    assert record["ood_jax_version"] == __version__
    built_at = datetime.datetime.fromisoformat(record["built_at"])
    assert built_at.utcoffset() == datetime.timedelta(0)
    assert record["examples_per_split"] == {"train_snow": 2}
    assert "boxes clipped to the image: 2" in record["summary"]
    assert record["summary"] in printed


def test_rebuild_from_another_source_is_refused(counts_build, tmp_path):
    """The issue's case: a second build from /nonexistent exited 0 with the first build's data
    and a summary that was not true."""
    source, data_dir, _ = counts_build
    other = make_counts(tmp_path / "b", images=3)
    for wrong in (tmp_path / "nonexistent", other):
        message = error_line(build_argv("counts", data_dir, wrong))
        record = json.loads((data_dir / "counts" / "1.1.0" / RECORD).read_text())
        assert f"{data_dir / 'counts' / '1.1.0'} was built from {source.resolve()}" in message
        assert f"on {record['built_at']}" in message and "--overwrite" in message
        assert f"--source {wrong} is another directory" in message
    assert _train_snow_ids(data_dir) == [1, 2]


def test_rebuild_from_the_same_source_prints_the_stored_summary(counts_build, capsys):
    source, data_dir, first = counts_build
    record = json.loads((data_dir / "counts" / "1.1.0" / RECORD).read_text())
    cli.main(build_argv("counts", data_dir, source))
    printed = capsys.readouterr().out
    assert (
        f"counts: already built from {source.resolve()} on {record['built_at']}, nothing to do"
        in printed
    )
    assert record["summary"] in printed and "boxes clipped to the image: 2" in printed
    assert json.loads((data_dir / "counts" / "1.1.0" / RECORD).read_text()) == record


def test_changed_annotation_file_is_refused_naming_it(tmp_path):
    source = make_counts(tmp_path / "src")
    datasets.build("counts", str(tmp_path / "data"), source=str(source))
    train = source / "annotations" / "train.json"
    coco = json.loads(train.read_text())
    coco["annotations"][0]["bbox"] = [1, 1, 3, 3]
    train.write_text(json.dumps(coco))
    message = error_line(build_argv("counts", tmp_path / "data", source))
    assert "its annotations/train.json changed since" in message and "--overwrite" in message


def test_dataset_without_a_record_asks_for_overwrite(tmp_path):
    source = make_counts(tmp_path / "src")
    builder = datasets.build("counts", str(tmp_path / "data"), source=str(source))
    (pathlib.Path(builder.data_dir) / RECORD).unlink()  # as an older ood-jax left it
    message = error_line(build_argv("counts", tmp_path / "data", source))
    assert f"{builder.data_dir} was built by an older ood-jax, which kept no record" in message
    assert "pass --overwrite to rebuild it" in message
    rebuilt = datasets.build("counts", str(tmp_path / "data"), source=str(source), overwrite=True)
    assert rebuilt.provenance.source == str(source.resolve())


def test_overwrite_replaces_the_dataset(tmp_path, capsys):
    data_dir = tmp_path / "data"
    datasets.build("counts", str(data_dir), source=str(make_counts(tmp_path / "a")))
    other = make_counts(tmp_path / "b", images=3)
    cli.main(build_argv("counts", data_dir, other, "--overwrite"))
    assert "examples written: 3 in 1 splits" in capsys.readouterr().out
    assert _train_snow_ids(data_dir) == [1, 2, 3]
    record = json.loads((data_dir / "counts" / "1.1.0" / RECORD).read_text())
    assert record["source"] == str(other.resolve())
    assert sorted(p.name for p in (data_dir / "counts").iterdir()) == ["1.1.0"]


def test_failed_overwrite_keeps_the_old_dataset(tmp_path):
    data_dir = tmp_path / "data"
    source = make_counts(tmp_path / "a")
    datasets.build("counts", str(data_dir), source=str(source))
    record = (data_dir / "counts" / "1.1.0" / RECORD).read_text()
    corrupt = make_counts(tmp_path / "b", images=3)
    coco = json.loads((corrupt / "annotations" / "train.json").read_text())
    coco["images"][2]["domain"] = "underwater"
    (corrupt / "annotations" / "train.json").write_text(json.dumps(coco))
    message = error_line(build_argv("counts", data_dir, corrupt, "--overwrite"))
    assert "images[2] (id 3): unknown domain 'underwater'" in message
    assert _train_snow_ids(data_dir) == [1, 2]
    assert (data_dir / "counts" / "1.1.0" / RECORD).read_text() == record
    assert sorted(p.name for p in (data_dir / "counts").iterdir()) == ["1.1.0"]


def test_interrupted_build_says_what_was_kept(tmp_path, capsys, monkeypatch):
    data_dir = tmp_path / "data"

    def interrupt(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(building, "read_image", interrupt)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(build_argv("counts", data_dir, make_counts(tmp_path / "src")))
    assert exit_info.value.code == cli.INTERRUPTED_EXIT_CODE
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"interrupted: nothing kept: the partial build was removed and "
        f"{data_dir / 'counts' / '1.1.0'} was not written; rerun the same command to build it"
    )
    assert list((data_dir / "counts").iterdir()) == []


# ------------------------------------------------------------------------------------------------
# 2. A build that would write an empty split, or nothing, fails naming why.
# ------------------------------------------------------------------------------------------------


def test_empty_splits_file_fails(tmp_path):
    source = make_oodbench(tmp_path / "src", [])
    message = error_line(build_argv("oodbench", tmp_path / "data", source))
    assert f"{source / 'splits.jsonl'}: no instances, so every split would be empty" in message
    assert not (tmp_path / "data" / "oodbench" / "default" / "1.0.0").exists()


def test_split_label_without_lines_fails(tmp_path):
    source = make_oodbench(tmp_path / "src", ALL_SPLITS[:2])
    message = error_line(build_argv("oodbench", tmp_path / "data", source))
    assert (
        f"split ood_h would be empty: {source / 'splits.jsonl'} has no line with split 'OOD-H'"
        in message
    )


def test_empty_coco_file_fails_naming_it(tmp_path):
    """An empty train.json made every train_* split vanish without a word."""
    source = make_counts(tmp_path / "src", splits=("train", "val"))
    train = source / "annotations" / "train.json"
    train.write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    message = error_line(build_argv("counts", tmp_path / "data", source))
    assert f"{train}: no images, so every train_* split would be empty" in message


def test_empty_options_file_fails_naming_it(tmp_path):
    source = make_foci(tmp_path / "src")
    (source / "options.json").write_text("{}")
    message = error_line(build_argv("foci", tmp_path / "data", source, "--config", "custom"))
    assert f"{source / 'options.json'}: no entries, so split test would be empty" in message


def test_every_image_skipped_fails_and_the_skip_report_is_printed(tmp_path, capsys):
    """It ended in TFDS's `AssertionError: No examples were yielded` and lost the skip list."""
    source = make_foci(tmp_path / "src")
    for path in (source / "photos").iterdir():
        path.write_bytes(b"not a jpeg")
    argv = build_argv("foci", tmp_path / "data", source, "--config", "custom", "--on-error", "skip")
    message = error_line(argv)
    assert "split test: every image was skipped (2), so it has no examples" in message
    err = capsys.readouterr().err
    assert "build report until it stopped:\nimages skipped: 2\n" in err
    for name in ("0.jpg", "1.jpg"):
        assert f"  {source / 'photos' / name}: corrupt or unreadable image" in err
    assert list((tmp_path / "data" / "foci" / "custom").iterdir()) == []


# ------------------------------------------------------------------------------------------------
# 3. Partial builds left by a killed run are removed at the next build of the same dataset.
# ------------------------------------------------------------------------------------------------


def test_stale_partial_builds_are_removed_saying_so(tmp_path, capsys):
    dataset_dir = tmp_path / "data" / "counts"
    # What TFDS 4.9 leaves after a kill (incomplete.XXXXXX_VERSION), and what our staging does.
    stale = [dataset_dir / "incomplete.Q3ZK1D_1.1.0", dataset_dir / "incomplete.ood-jax-0123abcd"]
    for path in stale:
        path.mkdir(parents=True)
        (path / "counts-train_snow.tfrecord-00000-of-00001").write_bytes(b"partial")
    (stale[1] / "ood_jax_build.lock").write_text("")
    cli.main(build_argv("counts", tmp_path / "data", make_counts(tmp_path / "src")))
    err = capsys.readouterr().err
    for path in stale:
        assert f"removed a partial build left by an interrupted run: {path}\n" in err
    assert sorted(p.name for p in dataset_dir.iterdir()) == ["1.1.0"]


def test_a_running_build_is_left_alone(tmp_path, capsys):
    running = tmp_path / "data" / "counts" / "incomplete.ood-jax-feedbeef"
    running.mkdir(parents=True)
    with open(running / "ood_jax_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        datasets.build("counts", str(tmp_path / "data"), source=str(make_counts(tmp_path / "src")))
    assert f"left {running} alone: another build is writing it" in capsys.readouterr().err
    assert running.is_dir()


def test_dataset_moved_aside_by_a_killed_overwrite_is_restored(tmp_path, capsys):
    source = make_counts(tmp_path / "src")
    builder = datasets.build("counts", str(tmp_path / "data"), source=str(source))
    dataset_dir = pathlib.Path(builder.data_dir)
    # Killed between its two renames: the old dataset aside, the new one not yet in place.
    dataset_dir.rename(dataset_dir.with_name("replaced.0123abcd_1.1.0"))
    cli.main(build_argv("counts", tmp_path / "data", source))
    printed = capsys.readouterr()
    assert (
        f"restored {dataset_dir}, which an interrupted --overwrite had moved aside" in printed.err
    )
    assert "counts: already built from" in printed.out
    assert _train_snow_ids(tmp_path / "data") == [1, 2]


# ------------------------------------------------------------------------------------------------
# 4. and 5. `build --help` lists the configs; a build shows one progress bar.
# ------------------------------------------------------------------------------------------------


def test_build_help_lists_every_builders_configs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["build", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in datasets.NAMES:
        configs = datasets.configs(name)
        assert f"{name} {', '.join(configs) if configs else '(no configs)'}" in out, name
    assert "tiny, demo" in out and "default, bap" in out
    assert "examples: ood-jax build synthetic_shifts --config tiny --data-dir" in out
    assert "--overwrite" in out


@pytest.fixture(scope="module")
def synthetic_build(tmp_path_factory):
    """synthetic_shifts/tiny built through the CLI, with what it printed."""
    data_dir = tmp_path_factory.mktemp("synthetic")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        cli.main(["build", "synthetic_shifts", "--config", "tiny", "--data-dir", str(data_dir)])
    return data_dir, stdout.getvalue(), stderr.getvalue()


def test_a_build_shows_one_progress_bar(synthetic_build):
    """TFDS drew 57 bars for this build: one per split for generating and one for shuffling,
    plus one over the splits."""
    _, _, err = synthetic_build
    updates = [line.strip() for line in re.split(r"[\r\n]+", err) if line.strip()]
    bars = {m.group(1) for line in updates if (m := re.match(r"(.+?):\s+\d+%\|", line))}
    assert bars == {"synthetic_shifts/tiny"}, updates
    assert updates[-1].startswith("synthetic_shifts/tiny: 100%|") and "168/168" in updates[-1]
    assert "Generating" not in err and "Shuffling" not in err


def test_synthetic_rebuild_does_nothing(synthetic_build, capsys):
    data_dir, first, _ = synthetic_build
    record = json.loads((data_dir / "synthetic_shifts" / "tiny" / "1.0.0" / RECORD).read_text())
    assert record["source"] is None and record["files"] == {}
    assert record["settings"] == {
        "config": "tiny",
        "seed": 0,
        "size_range": [96, 128],
        "test_per_domain": 4,
        "train_per_domain": 8,
    }
    assert record["summary"] in first
    cli.main(["build", "synthetic_shifts", "--config", "tiny", "--data-dir", str(data_dir)])
    out = capsys.readouterr().out
    assert "synthetic_shifts/tiny: already built from generator settings" in out
    assert f"on {record['built_at']}, nothing to do" in out and record["summary"] in out


def test_synthetic_dataset_of_an_older_version_is_kept(synthetic_build, tmp_path, capsys):
    data_dir = tmp_path / "data"
    shutil.copytree(synthetic_build[0], data_dir)
    (data_dir / "synthetic_shifts" / "tiny" / "1.0.0" / RECORD).unlink()
    cli.main(["build", "synthetic_shifts", "--config", "tiny", "--data-dir", str(data_dir)])
    out = capsys.readouterr().out
    assert "already built by an older ood-jax, which kept no build record; nothing to do" in out
    assert "  train_dim: 8" in out


def test_load_builds_missing_synthetic_data_with_a_record(tmp_path):
    builder = datasets.load("synthetic_shifts/tiny", str(tmp_path), build_if_missing=True)
    assert builder.info.splits["test_sky"].num_examples == 4
    assert (pathlib.Path(builder.data_dir) / RECORD).is_file()
    assert datasets.load("synthetic_shifts/tiny", str(tmp_path)).data_dir == builder.data_dir
