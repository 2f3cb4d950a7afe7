"""FOCI's appendix D sets: ImageNet-1k's halves and flat val, GeoDE's regions, and their errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import tensorflow_datasets as tfds
from test_foci_builder import (
    _build,
    _images,
    _write_imagenet_names,
    _write_options,
    imagenet_names,
    make_food101,
    make_geode,
    make_imagenet,
)

from ood_jax.data import building
from ood_jax.data import foci as foci_source
from ood_jax.mining import foci as mining

RELEASED_IMAGENET = foci_source.released_options_file("imagenet_1k")


def _split(builder, split: str) -> dict[str, str]:
    """image/filename -> label of one split, read with plain TFDS."""
    reread = tfds.builder_from_directory(builder.data_dir)
    examples = tfds.as_numpy(reread.as_dataset(split=split))
    return {ex["image/filename"].decode(): ex["label"].decode() for ex in examples}


def test_imagenet_1k_has_foci_table_3_halves(tmp_path):
    src = tmp_path / "src"
    expected = make_imagenet(src, "imagenet_1k", RELEASED_IMAGENET, relative=True)
    builder = _build(tmp_path, "imagenet_1k", src)
    test = _split(builder, "test")
    assert test == {image: label for image, (label, _, _) in expected.items()}
    # Classes 0 and 2 (even indexes) are the train half, 1 and 7 the test half.
    halves = {"train_half": {"class 0", "class 2"}, "test_half": {"class 1", "class 7"}}
    for half, classes in halves.items():
        assert _split(builder, half) == {i: x for i, x in test.items() if x in classes}


def test_imagenet_1k_reads_the_flat_val_with_loc_val_solution(tmp_path):
    src = tmp_path / "src"
    wnids, names = foci_source.imagenet_wnids(), imagenet_names()
    _write_imagenet_names(src)
    rows = [(f"ILSVRC2012_val_{k:08d}", c) for k, c in enumerate([0, 0, 1, 3, 3, 2], start=1)]
    lines = ["ImageId,PredictionString"]
    lines += [f"{image_id},{wnids[c]} 1 2 30 40 {wnids[c]} 5 6 7 8" for image_id, c in rows]
    (src / foci_source.IMAGENET_VAL_SOLUTION).write_text("\n".join(lines) + "\n")
    labelled = [(f"val/{image_id}.JPEG", names[c]) for image_id, c in rows]
    expected = _images(src, labelled, [names[c] for c in (0, 1, 2, 3)])
    # FOCI's file names an image <wnid>/<file>, as in the val/<wnid>/ layout its loader reads.
    foci_paths = {f"val/{i}.JPEG": f"{wnids[c]}/{i}.JPEG" for i, c in rows}
    _write_options(src / RELEASED_IMAGENET, expected, foci_paths)
    builder = _build(tmp_path, "imagenet_1k", src)
    assert _split(builder, "test") == {image: label for image, (label, _, _) in expected.items()}
    assert set(_split(builder, "test_half").values()) == {"class 1", "class 3"}
    assert "LOC_val_solution.csv" in builder.provenance.files


def test_geode_has_a_split_per_region(tmp_path):
    src = tmp_path / "src"
    expected = make_geode(src)
    builder = _build(tmp_path, "geode", src)
    assert set(builder.info.splits) == {"test", "africa", "west_asia", "europe"}
    africa = _split(builder, "africa")
    assert africa == {"images/Africa/bag/tx_0.jpg": "bag", "images/Africa/dog/tx_1.jpg": "dog"}
    assert _split(builder, "west_asia")["images/WestAsia/cooking_pot/tx_3.jpg"] == "cooking pot"
    assert len(_split(builder, "test")) == len(expected)
    assert foci_source.region_split("Southeast Asia") == "southeast_asia"


def test_a_classic_set_reads_foci_s_released_file_name(tmp_path):
    src = tmp_path / "src"
    expected = make_food101(src)
    (src / "foci_options.json").rename(src / foci_source.released_options_file("food101"))
    assert len(_split(_build(tmp_path, "food101", src), "test")) == len(expected)


def test_mining_reads_the_appendix_d_sets(tmp_path):
    src = tmp_path / "src"
    expected = make_imagenet(src, "imagenet_a", "foci_options.json", relative=False)
    source = mining.read_source("imagenet_a", src)
    assert set(source.images) == set(expected)
    assert source.class_names == ("class 0", "class 1", "class 2", "class 7")


# ---------------------------------------------------------------------------------------------
# ImageNet's class names without a user's classnames.txt
# ---------------------------------------------------------------------------------------------


def test_the_shipped_class_names_are_open_clip_s():
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    shipped = foci_source.SHIPPED_IMAGENET_CLASS_NAMES.read_text().splitlines()
    assert shipped == list(IMAGENET_CLASSNAMES)


def _release_without_class_list(src, config: str, classes: dict[int, str], negatives=()):
    """SRC/<folder>/<wnid>/ of ImageNet classes (index -> the name FOCI's options give it),
    two images each, and FOCI's released options file; no classnames.txt."""
    folder, wnids = foci_source.IMAGENET_FOLDERS[config], foci_source.imagenet_wnids()
    labelled = [
        (f"{folder}/{wnids[c]}/{wnids[c]}_{k}.JPEG", name)
        for c, name in classes.items()
        for k in range(2)
    ]
    expected = _images(src, labelled, [*dict.fromkeys(classes.values()), *negatives])
    foci_names = {image: image.removeprefix(f"{folder}/") for image in expected}
    _write_options(src / foci_source.released_options_file(config), expected, foci_names)
    return expected


def test_imagenet_r_builds_from_the_release_as_users_have_it(tmp_path):
    src = tmp_path / "src"
    shipped = foci_source.SHIPPED_IMAGENET_CLASS_NAMES.read_text().splitlines()
    expected = _release_without_class_list(src, "imagenet_r", {c: shipped[c] for c in (1, 3, 4, 5)})
    builder = _build(tmp_path, "imagenet_r", src)
    assert _split(builder, "test") == {image: label for image, (label, _, _) in expected.items()}
    named = ("goldfish", "tiger shark", "hammerhead shark", "electric ray")
    assert set(_split(builder, "test").values()) == set(named)
    assert not any(name.endswith("classnames.txt") for name in builder.provenance.files)
    # Mining ranks the same classes without an options file.
    (src / foci_source.released_options_file("imagenet_r")).unlink()
    ranked = mining.read_source("imagenet_r", src).class_names
    assert ranked == named


def test_foci_s_groundtruths_name_the_classes_they_ask_about(tmp_path):
    src = tmp_path / "src"
    classes = {0: "a tench", 1: "goldfish", 2: "a great white shark", 5: "electric ray"}
    expected = _release_without_class_list(src, "imagenet_a", classes)
    builder = _build(tmp_path, "imagenet_a", src)
    assert _split(builder, "test") == {image: label for image, (label, _, _) in expected.items()}


def test_classes_named_alike_keep_their_own_halves(tmp_path):
    # The shipped list calls classes 657 and 744 both "missile"; FOCI's halves go by index.
    src = tmp_path / "src"
    shipped = foci_source.SHIPPED_IMAGENET_CLASS_NAMES.read_text().splitlines()
    assert shipped[657] == shipped[744] == "missile"
    classes = {c: shipped[c] for c in (0, 657, 744)}
    expected = _release_without_class_list(src, "imagenet_1k", classes, shipped[1:3])
    builder = _build(tmp_path, "imagenet_1k", src)
    wnids = foci_source.imagenet_wnids()
    assert set(_split(builder, "test")) == set(expected)
    assert set(_split(builder, "train_half")) == {i for i in expected if wnids[657] not in i}
    assert set(_split(builder, "test_half")) == {i for i in expected if wnids[657] in i}


def test_one_wordnet_id_named_two_ways_is_refused(tmp_path):
    src = tmp_path / "src"
    classes = {1: "goldfish", 3: "tiger shark", 4: "hammerhead shark", 5: "electric ray"}
    _release_without_class_list(src, "imagenet_r", classes)
    path = src / foci_source.released_options_file("imagenet_r")
    data = json.loads(path.read_text())
    entry = data["goldfish"].pop()
    entry["groundtruth"] = "carp"
    entry["options"][entry["options"].index("goldfish")] = "carp"
    data["carp"] = [entry]
    path.write_text(json.dumps(data))
    message = (
        rf"{re.escape(str(path))}: image \S+ is labelled 'carp', but \S+ of the same WordNet "
        "id n01443537 is labelled 'goldfish'"
    )
    with pytest.raises(building.BuildError, match=message):
        _build(tmp_path, "imagenet_r", src)


def _imagenet_r(tmp_path):
    src = tmp_path / "src"
    make_imagenet(src, "imagenet_r", "options.json", relative=True)
    return src


@pytest.mark.parametrize(
    "spoil, message",
    [
        (
            lambda src: (src / "classnames.txt").write_text("tench\n" * 999),
            r"classnames\.txt: 999 lines, expected 1000",
        ),
        (
            lambda src: (src / "classnames.txt").write_text(
                "\n".join(["tench", *imagenet_names()[1:-1], "tench"])
            ),
            r"classnames\.txt: line 1000: 'tench' is also line 1",
        ),
        (
            lambda src: (src / "imagenet-r" / "n99999999").mkdir(),
            r"imagenet-r/n99999999: 'n99999999' is not one of the 1000 ImageNet WordNet ids",
        ),
        (
            lambda src: shutil.copy(src / "options.json", src / "foci_options.json"),
            r"foci_options\.json and options\.json are both options files for foci/imagenet_r",
        ),
        (
            lambda src: (src / "options.json").unlink(),
            r"no options file for foci/imagenet_r; expected one of imagenet-rendition-ViT-L-14"
            r".*`ood-jax mine foci --dataset imagenet_r",
        ),
    ],
)
def test_imagenet_errors_name_the_file(tmp_path, spoil, message):
    src = _imagenet_r(tmp_path)
    spoil(src)
    with pytest.raises(building.BuildError, match=message):
        _build(tmp_path, "imagenet_r", src)


def test_geode_index_errors_name_the_column_and_line(tmp_path):
    src = tmp_path / "src"
    make_geode(src)
    index = src / "index.csv"
    index.write_text(index.read_text().replace("region", "area", 1))
    with pytest.raises(building.BuildError, match=r"index\.csv: no column 'region'"):
        _build(tmp_path, "geode", src)
    make_geode(tmp_path / "other")
    index = tmp_path / "other" / "index.csv"
    index.write_text(index.read_text() + "Europe/cup/tx_9.jpg,,Europe,XX\n")
    with pytest.raises(building.BuildError, match=r"index\.csv: line 8: empty file_path"):
        _build(tmp_path, "geode", tmp_path / "other")


def test_an_options_entry_outside_the_set_is_refused(tmp_path):
    src = _imagenet_r(tmp_path)
    data = json.loads((src / "options.json").read_text())
    data["class 0"][0]["image"] = "n01440764/missing.jpg"
    (src / "options.json").write_text(json.dumps(data))
    with pytest.raises(building.BuildError, match=r"image is not in the test split"):
        _build(tmp_path, "imagenet_r", src)
