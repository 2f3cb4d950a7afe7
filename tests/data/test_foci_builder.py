"""The FOCI builder on tiny copies of each release layout, read back with plain TFDS."""

from __future__ import annotations

import collections
import functools
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from scipy import io as scipy_io

from ood_jax import cli
from ood_jax import datasets
from ood_jax.data import building
from ood_jax.data import foci as foci_source
from tfds_builders.foci import foci_dataset_builder as foci

# image path relative to SRC -> (label, options as written in the file, (height, width))
Expected = dict[str, tuple[str, list[str], tuple[int, int]]]

IMAGENET_DOMAINS = ("animal", "plant", "food", "artifact")


def _write_image(path: pathlib.Path, size: tuple[int, int], fmt: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    pixels = np.random.default_rng(width * 100 + height).integers(0, 255, (height, width, 3))
    Image.fromarray(pixels.astype(np.uint8)).save(path, format=fmt)


def _options(label: str, classes: list[str]) -> list[str]:
    # The truth first and the next three classes as negatives, like a mined FOCI entry.
    start = classes.index(label)
    return [classes[(start + k) % len(classes)] for k in range(foci_source.NUM_OPTIONS)]


def _write_options(path: pathlib.Path, expected: Expected, file_paths: dict[str, str]) -> None:
    grouped = collections.defaultdict(list)
    for image, (label, options, _) in expected.items():
        entry = {"image": file_paths.get(image, image), "options": options, "groundtruth": label}
        grouped[label].append(entry)
    path.write_text(json.dumps(grouped))


def _images(src: pathlib.Path, labelled: list[tuple[str, str]], classes: list[str]) -> Expected:
    """Writes one image per (path, label), each with its own size; returns what to expect."""
    expected = {}
    for k, (image, label) in enumerate(labelled):
        width, height = 16 + 3 * k, 12 + 2 * k
        _write_image(src / image, (width, height))
        expected[image] = (label, _options(label, classes), (height, width))
    return expected


def make_food101(src: pathlib.Path) -> Expected:
    raw = ["apple_pie", "baby_back_ribs", "beef_carpaccio", "bibimbap"]
    entries = {c: [f"{c}/{100 + k}" for k in range(2)] for c in raw}
    (src / "meta").mkdir(parents=True)
    (src / "meta" / "test.json").write_text(json.dumps(entries))
    labelled = [(f"images/{e}.jpg", c.replace("_", " ")) for c in raw for e in entries[c]]
    expected = _images(src, labelled, [c.replace("_", " ") for c in raw])
    _write_options(src / "foci_options.json", expected, {})
    return expected


def make_flowers102(src: pathlib.Path) -> Expected:
    # Labels are 1-based; 77 is 'passion flower'. Images 1, 4 and 7 are train/val only.
    labels = [1, 1, 2, 3, 77, 2, 3, 77, 1, 2, 3, 77]
    test_ids = [2, 3, 5, 6, 8, 9, 10, 11, 12]
    src.mkdir(parents=True)
    scipy_io.savemat(
        src / "setid.mat",
        {
            "trnid": np.array([[1, 4]], float),
            "valid": np.array([[7]], float),
            "tstid": np.array([test_ids], float),
        },
    )
    scipy_io.savemat(src / "imagelabels.mat", {"labels": np.array([labels], float)})
    names = foci_source.FLOWERS102_CLASSES
    classes = [names[0], names[1], names[2], names[76]]
    labelled = [(f"jpg/image_{i:05d}.jpg", names[labels[i - 1] - 1]) for i in test_ids]
    expected = _images(src, labelled, classes)
    _write_options(src / "foci_options.json", expected, {})
    return expected


def make_fgvc_aircraft(src: pathlib.Path) -> Expected:
    rows = [
        ("0056978", "Boeing 717"),
        ("0062781", "Cessna 172"),
        ("1514522", "Falcon 2000"),
        ("0707832", "Gulfstream IV"),
        ("1200113", "Boeing 717"),
        ("2088743", "Cessna 172"),
    ]
    (src / "data").mkdir(parents=True)
    lines = "".join(f"{image_id} {variant}\n" for image_id, variant in rows)
    (src / "data" / "images_variant_test.txt").write_text(lines)
    classes = ["Boeing 717", "Cessna 172", "Falcon 2000", "Gulfstream IV"]
    expected = _images(src, [(f"data/images/{i}.jpg", v) for i, v in rows], classes)
    _write_options(src / "foci_options.json", expected, {})
    return expected


def make_stanford_cars(src: pathlib.Path) -> Expected:
    class_names = [
        "AM General Hummer SUV 2000",
        "Acura RL Sedan 2012",
        "Acura TL Sedan 2012",
        "Acura TL Type-S 2008",
        "Ram C/V Cargo Van Minivan 2012",
    ]
    classes_used = [1, 2, 3, 5, 5, 1, 3]
    fields = ["bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "fname"]
    annotations = np.zeros((1, len(classes_used)), dtype=[(f, object) for f in fields])
    for k, class_id in enumerate(classes_used):
        annotations[0, k] = (
            np.uint8(1),
            np.uint8(2),
            np.uint8(10),
            np.uint8(9),
            np.uint8(class_id),
            f"{k + 1:05d}.jpg",
        )
    (src / "devkit").mkdir(parents=True)
    scipy_io.savemat(src / "cars_test_annos_withlabels.mat", {"annotations": annotations})
    scipy_io.savemat(
        src / "devkit" / "cars_meta.mat",
        {"class_names": np.array(class_names, dtype=object).reshape(1, -1)},
    )
    labelled = [
        (f"cars_test/{k + 1:05d}.jpg", class_names[c - 1]) for k, c in enumerate(classes_used)
    ]
    expected = _images(src, labelled, [class_names[c - 1] for c in (1, 2, 3, 5)])
    _write_options(src / "foci_options.json", expected, {})
    return expected


def make_oxford_pet(src: pathlib.Path) -> Expected:
    rows = [
        ("Abyssinian_201", 1, 1, 1),
        ("Abyssinian_9", 1, 1, 1),
        ("american_bulldog_203", 2, 2, 1),
        ("Bengal_12", 6, 1, 6),
        ("staffordshire_bull_terrier_5", 35, 2, 23),
        ("staffordshire_bull_terrier_77", 35, 2, 23),
    ]
    (src / "annotations").mkdir(parents=True)
    text = "".join(" ".join(map(str, row)) + "\n" for row in rows)
    (src / "annotations" / "test.txt").write_text(text)
    classes = ["Abyssinian", "American Bulldog", "Bengal", "Staffordshire Bull Terrier"]
    labels = {1: classes[0], 2: classes[1], 6: classes[2], 35: classes[3]}
    labelled = [(f"images/{name}.jpg", labels[class_id]) for name, class_id, *_ in rows]
    expected = _images(src, labelled, classes)
    _write_options(src / "foci_options.json", expected, {})
    return expected


def make_imagenet21k(src: pathlib.Path, absolute_paths: bool) -> Expected:
    classes = {"n01322508": "wolf pup", "n01322898": "lion cub", "n01322983": "bear cub"}
    classes["n01323068"] = "tiger cub"
    labelled = [
        (f"images/{wnid}/{wnid}_{1000 + k}.JPEG", label)
        for wnid, label in classes.items()
        for k in range(2)
    ]
    expected = _images(src, labelled, list(classes.values()))
    # FOCI's released files hold the authors' absolute paths; our miner may write <wnid>/<file>.
    prefix = "/media/gregor/cache1/icbench/imagenet6k/" if absolute_paths else ""
    file_paths = {image: prefix + image.removeprefix("images/") for image in expected}
    _write_options(src / "options.json", expected, file_paths)
    return expected


def make_custom(src: pathlib.Path) -> Expected:
    classes = ["cat", "dog", "cow", "hen"]
    labelled = [(f"photos/{c}/{k}.jpg", c) for c in classes for k in range(2)]
    expected = _images(src, labelled, classes)
    # A PNG is re-encoded as JPEG and keeps its size.
    _write_image(src / "photos" / "extra.png", (21, 17), fmt="PNG")
    expected["photos/extra.png"] = ("hen", _options("hen", classes), (17, 21))
    _write_options(src / "options.json", expected, {})
    return expected


def imagenet_names() -> list[str]:
    """Stand-ins for the 1000 ImageNet class names (SRC/classnames.txt), in class-index order."""
    return [f"class {k}" for k in range(1000)]


def _write_imagenet_names(src: pathlib.Path) -> None:
    src.mkdir(parents=True, exist_ok=True)
    (src / foci_source.IMAGENET_CLASS_NAMES_FILE).write_text("\n".join(imagenet_names()) + "\n")


def make_imagenet(src: pathlib.Path, config: str, options_file: str, relative: bool) -> Expected:
    """SRC/<folder>/<wnid>/<file> for four classes (0, 1, 2 and 7), two images each; the options
    name images relative to the set's folder (as FOCI's files) or, `relative=False`, to SRC."""
    folder = foci_source.IMAGENET_FOLDERS[config]
    wnids, names = foci_source.imagenet_wnids(), imagenet_names()
    used = [0, 1, 2, 7]
    labelled = [
        (f"{folder}/{wnids[c]}/{wnids[c]}_{k}.JPEG", names[c]) for c in used for k in range(2)
    ]
    _write_imagenet_names(src)
    expected = _images(src, labelled, [names[c] for c in used])
    file_paths = {image: image.removeprefix(f"{folder}/") for image in expected} if relative else {}
    _write_options(src / options_file, expected, file_paths)
    return expected


def make_geode(src: pathlib.Path) -> Expected:
    rows = [
        ("Africa/bag/tx_0.jpg", "bag", "Africa"),
        ("Africa/dog/tx_1.jpg", "dog", "Africa"),
        ("WestAsia/bag/tx_2.jpg", "bag", "WestAsia"),
        ("WestAsia/cooking_pot/tx_3.jpg", "cooking_pot", "WestAsia"),
        ("Europe/dog/tx_4.jpg", "dog", "Europe"),
        ("Europe/stove/tx_5.jpg", "stove", "Europe"),
    ]
    src.mkdir(parents=True)
    lines = ["file_path,object,region,ip_country"]
    lines += [f"{path},{obj},{region},XX" for path, obj, region in rows]
    (src / "index.csv").write_text("\n".join(lines) + "\n")
    classes = ["bag", "cooking pot", "dog", "stove"]
    labelled = [(f"images/{path}", obj.replace("_", " ")) for path, obj, _ in rows]
    expected = _images(src, labelled, classes)
    _write_options(src / foci_source.released_options_file("geode"), expected, {})
    return expected


LAYOUTS = {
    "food101": make_food101,
    "flowers102": make_flowers102,
    "fgvc_aircraft": make_fgvc_aircraft,
    "stanford_cars": make_stanford_cars,
    "oxford_pet": make_oxford_pet,
    "custom": make_custom,
}
LAYOUTS.update(
    (f"imagenet21k_{domain}", functools.partial(make_imagenet21k, absolute_paths=k % 2 == 0))
    for k, domain in enumerate(IMAGENET_DOMAINS)
)
# Each ImageNet set reads its options under another of the names it accepts.
LAYOUTS.update(
    (config, functools.partial(make_imagenet, config=config, options_file=name, relative=rel))
    for config, name, rel in [
        ("imagenet_1k", foci_source.released_options_file("imagenet_1k"), True),
        ("imagenet_a", "foci_options.json", False),
        ("imagenet_r", foci_source.released_options_file("imagenet_r"), True),
        ("imagenet_sketch", "options.json", True),
    ]
)
LAYOUTS["geode"] = make_geode


def _build(tmp_path: pathlib.Path, config: str, src: pathlib.Path, name: str = "data", **kwargs):
    return datasets.build("foci", str(tmp_path / name), source=str(src), config=config, **kwargs)


def _read_back(builder) -> dict[str, dict]:
    reread = tfds.builder_from_directory(builder.data_dir)
    examples = tfds.as_numpy(reread.as_dataset(split="test"))
    return {ex["image/filename"].decode(): ex for ex in examples}


def test_configs_cover_every_subset():
    names = [config.name for config in foci.Builder.BUILDER_CONFIGS]
    assert sorted(names) == sorted(LAYOUTS)


@pytest.mark.parametrize("config", sorted(LAYOUTS))
def test_build_matches_source(tmp_path, config):
    src = tmp_path / "src"
    expected = LAYOUTS[config](src)
    builder = _build(tmp_path, config, src)
    records = _read_back(builder)
    assert sorted(records) == sorted(expected)
    for image, (label, options, size) in expected.items():
        record = records[image]
        written = [o.decode() for o in record["options"]]
        assert record["label"].decode() == label
        assert sorted(written) == sorted(options)
        assert written[record["answer"]] == label
        assert record["image"].shape == (*size, 3)
        assert record["dataset"].decode() == config
    assert builder.report.skipped_images == []


def test_pet_class_names_follow_torchvision():
    assert foci_source.pet_class_name("american_pit_bull_terrier_12") == "American Pit Bull Terrier"
    assert foci_source.pet_class_name("Egyptian_Mau_3") == "Egyptian Mau"


def test_two_builds_give_the_same_option_order(tmp_path):
    src = tmp_path / "src"
    make_food101(src)
    first = _read_back(_build(tmp_path, "food101", src, "first"))
    second = _read_back(_build(tmp_path, "food101", src, "second"))
    assert {k: list(v["options"]) for k, v in first.items()} == {
        k: list(v["options"]) for k, v in second.items()
    }


def test_answer_index_is_uniform_and_seeded():
    options = ("truth", "a", "b", "c")
    answers = [foci.shuffle_options(options, "truth", 0, f"images/{k}.jpg")[1] for k in range(4000)]
    counts = np.bincount(answers, minlength=4) / len(answers)
    assert np.all(np.abs(counts - 0.25) < 0.03), counts
    reseeded = [foci.shuffle_options(options, "truth", 1, f"images/{k}.jpg") for k in range(50)]
    assert reseeded != [
        foci.shuffle_options(options, "truth", 0, f"images/{k}.jpg") for k in range(50)
    ]


def test_test_images_without_options_are_counted_not_written(tmp_path, capsys):
    src = tmp_path / "src"
    expected = make_food101(src)
    dropped = "images/bibimbap/101.jpg"
    del expected[dropped]
    _write_options(src / "foci_options.json", expected, {})
    cli.main(
        ["build", "foci", "--source", str(src), "--data-dir", str(tmp_path / "d")]
        + ["--config", "food101"]
    )
    printed = capsys.readouterr().out
    assert f"{foci.NOTE_WITHOUT_OPTIONS}: 1" in printed
    builder = tfds.builder_from_directory(str(tmp_path / "d" / "foci" / "food101" / "1.0.0"))
    assert builder.info.splits["test"].num_examples == len(expected)


def test_malformed_options_json_names_the_file(tmp_path):
    src = tmp_path / "src"
    make_custom(src)
    (src / "options.json").write_text('{"cat": [{"image": ')
    with pytest.raises(building.BuildError, match=r"options\.json: malformed JSON"):
        _build(tmp_path, "custom", src)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["dog", "cow", "hen", "pig"],
            r"options \['dog', 'cow', 'hen', 'pig'\] lack the groundtruth 'cat'",
        ),
        (["cat", "cat", "dog", "cow"], r"groundtruth 'cat' appears 2 times"),
        (["cat", "dog", "dog", "cow"], r"option 'dog' appears more than once"),
        (["cat", "dog", "cow"], r"3 options, expected 4"),
    ],
)
def test_bad_options_name_the_entry(tmp_path, options, message):
    src = tmp_path / "src"
    make_custom(src)
    data = json.loads((src / "options.json").read_text())
    data["cat"][1]["options"] = options
    (src / "options.json").write_text(json.dumps(data))
    where = r"options\.json: entry 1 of 'cat' \(image photos/cat/1\.jpg\): "
    with pytest.raises(building.BuildError, match=where + message):
        _build(tmp_path, "custom", src)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"image": "images/apple_pie/999.jpg"}, r"image is not in the test split"),
        (
            {
                "groundtruth": "bibimbap",
                "options": ["bibimbap", "apple pie", "beef carpaccio", "baby back ribs"],
            },
            r"groundtruth 'bibimbap', but .*test\.json labels it 'apple pie'",
        ),
        (
            {"options": ["apple pie", "pizza", "bibimbap", "beef carpaccio"]},
            r"option 'pizza' is not a class of the release",
        ),
    ],
)
def test_options_must_agree_with_the_release(tmp_path, change, message):
    src = tmp_path / "src"
    make_food101(src)
    data = json.loads((src / "foci_options.json").read_text())
    entry = data.pop("apple pie")[0]
    entry.update(change)
    data.setdefault(entry["groundtruth"], []).append(entry)
    (src / "foci_options.json").write_text(json.dumps(data))
    with pytest.raises(building.BuildError, match=r"foci_options\.json: entry \d+ of .*" + message):
        _build(tmp_path, "food101", src)


def test_missing_mat_variable_names_the_file(tmp_path):
    src = tmp_path / "src"
    make_flowers102(src)
    scipy_io.savemat(src / "setid.mat", {"trnid": np.array([[1.0]])})
    with pytest.raises(building.BuildError, match=r"setid\.mat: missing variable 'tstid'"):
        _build(tmp_path, "flowers102", src)


def test_corrupt_image_fails_or_is_skipped(tmp_path):
    src = tmp_path / "src"
    expected = make_custom(src)
    (src / "photos" / "dog" / "0.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(building.BuildError, match=r"photos/dog/0\.jpg: corrupt"):
        _build(tmp_path, "custom", src, "failed")
    builder = _build(tmp_path, "custom", src, "skipped", on_error="skip")
    assert [path for path, _ in builder.report.skipped_images] == [str(src / "photos/dog/0.jpg")]
    assert builder.info.splits["test"].num_examples == len(expected) - 1
    assert "photos/dog/0.jpg" not in _read_back(builder)
