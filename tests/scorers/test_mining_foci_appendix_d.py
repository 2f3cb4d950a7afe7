"""The `mine foci` job on FOCI's appendix D sets with a tiny random CLIP, against transformers'
features ranked by the numpy rule, and the mined file built into every split of the set."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
import torch
import transformers
from PIL import Image
from test_mining_foci import reference_options
from test_scorers import IMAGE_SIZE, TEXT_LEN, clip_config, normalized, save_clip, torch_features

from ood_jax import datasets, scorers
from ood_jax.data import foci as foci_source
from ood_jax.mining import foci, jobs

# Names of letters the tiny tokenizer knows, so every class has text features of its own; their
# sorted order is the reverse of the class-index order, which FOCI's ImageNet files follow.
CLASS_NAMES = ["class " + "".join("jihgfedcba"[int(d)] for d in f"{k:03d}") for k in range(1000)]
# Class indexes with images: ImageNet-1k's two halves (even indexes train), a subset for the rest.
IMAGENET_CLASSES = {
    "imagenet_1k": [0, 2, 5, 8],
    "imagenet_a": [1, 6, 107, 300, 999],
    "imagenet_r": [1, 6, 107, 300, 999],
    "imagenet_sketch": [3, 4, 9, 10, 500],
}
GEODE = [
    ("Africa/bag/0.jpg", "bag", "Africa"),
    ("Africa/dog/1.jpg", "dog", "Africa"),
    ("Africa/stove/2.jpg", "stove", "Africa"),
    ("WestAsia/bag/3.jpg", "bag", "WestAsia"),
    ("WestAsia/cooking_pot/4.jpg", "cooking_pot", "WestAsia"),
    ("Europe/dog/5.jpg", "dog", "Europe"),
    ("Europe/cooking_pot/6.jpg", "cooking_pot", "Europe"),
]


def _write_image(path: pathlib.Path, seed: int) -> None:
    # The model's own size: no resampling, so transformers' processor gives the same pixels.
    # PNG bytes under any suffix (.JPEG too): lossless, and PIL reads them by their content.
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3))
    Image.fromarray(pixels.astype(np.uint8)).save(path, format="PNG")


def _imagenet(src: pathlib.Path, config: str, flat: bool = False) -> dict[str, str]:
    """Two images per class of IMAGENET_CLASSES[config], in <wnid>/ folders or (`flat`) Kaggle's
    flat val/ with LOC_val_solution.csv; image path -> label."""
    src.mkdir(parents=True)
    (src / foci_source.IMAGENET_CLASS_NAMES_FILE).write_text("\n".join(CLASS_NAMES) + "\n")
    wnids, folder = foci_source.imagenet_wnids(), foci_source.IMAGENET_FOLDERS[config]
    labels, rows = {}, ["ImageId,PredictionString"]
    for c in IMAGENET_CLASSES[config]:
        for k in range(2):
            name = f"ILSVRC2012_val_{c:04d}{k}"
            image = f"{folder}/{name}.JPEG" if flat else f"{folder}/{wnids[c]}/{name}.JPEG"
            _write_image(src / image, 10 * c + k)
            labels[image] = CLASS_NAMES[c]
            rows.append(f"{name},{wnids[c]} 1 2 3 4")
    if flat:
        (src / foci_source.IMAGENET_VAL_SOLUTION).write_text("\n".join(rows) + "\n")
    return labels


def _geode(src: pathlib.Path) -> dict[str, str]:
    src.mkdir(parents=True)
    lines = ["file_path,object,region"] + [",".join(row) for row in GEODE]
    (src / "index.csv").write_text("\n".join(lines) + "\n")
    for k, (path, _, _) in enumerate(GEODE):
        _write_image(src / "images" / path, 1000 + k)
    return {f"images/{path}": obj.replace("_", " ") for path, obj, _ in GEODE}


SETS = {
    "imagenet_1k": lambda src: _imagenet(src, "imagenet_1k"),
    "imagenet_1k flat": lambda src: _imagenet(src, "imagenet_1k", flat=True),
    "imagenet_a": lambda src: _imagenet(src, "imagenet_a"),
    "imagenet_r": lambda src: _imagenet(src, "imagenet_r"),
    "imagenet_sketch": lambda src: _imagenet(src, "imagenet_sketch"),
    "geode": _geode,
}


def ranked_classes(config: str) -> list[str]:
    """What FOCI ranks over: ImageNet-1k's 1000 classes, the classes present in the others;
    ImageNet's in class-index order, GeoDE's sorted."""
    if config == "imagenet_1k":
        return CLASS_NAMES
    if config == "geode":
        return sorted({obj.replace("_", " ") for _, obj, _ in GEODE})
    return [CLASS_NAMES[c] for c in IMAGENET_CLASSES[config]]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """(checkpoint dir, transformers model, our scorer loaded once for every run)."""
    path = tmp_path_factory.mktemp("clip") / "tiny"
    # CLIPModel draws its initial weights from torch's global generator: seeded, the model does
    # not depend on which tests ran before.
    torch.manual_seed(0)
    model = save_clip(path, clip_config())
    return path, model, scorers.from_hf(path)


def torch_options(path, model, src, labels: dict[str, str], classes: list[str]) -> dict:
    """image -> mined options by the numpy rule on transformers' features."""
    processor = transformers.CLIPProcessor.from_pretrained(path, local_files_only=True)
    images = sorted(labels)
    pixels = processor.image_processor(
        images=[Image.open(src / i).convert("RGB") for i in images], return_tensors="np"
    )["pixel_values"].transpose(0, 2, 3, 1)
    tokens = processor.tokenizer(
        [foci.DEFAULT_TEMPLATES[0].format(c) for c in classes],
        padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="np",
    )  # fmt: skip
    image_features = normalized(torch_features(model, pixels))
    text_features = normalized(
        torch_features(model, ids=tokens["input_ids"], mask=tokens["attention_mask"])
    )
    truth = np.array([classes.index(labels[i]) for i in images])
    rows, similarity = reference_options(image_features, text_features, truth)
    # The four most similar wrong classes are apart by far more than our similarities differ
    # from these (< 1e-6 with this model), so the rule, not rounding, decides what is kept.
    wrong = np.where(np.eye(len(classes), dtype=bool)[truth], -np.inf, similarity)
    top = np.sort(wrong, axis=1)[:, -min(4, len(classes) - 1) :]
    assert np.diff(top, axis=1).min() > 1e-5
    return {i: [classes[c] for c in row] for i, row in zip(images, rows.tolist())}


def _mine(config: str, src: pathlib.Path, checkpoint: pathlib.Path, scorer) -> None:
    job = jobs.FociMining(
        dataset=config, source=str(src), scorer=str(checkpoint), encoding=jobs.Encoding(quiet=True)
    )
    # The job asks for its scorer's path; the scorer loaded from it once serves every run.
    jobs.run_foci(job, scorer_factory={str(checkpoint): scorer}.__getitem__)


def _splits(data_dir: pathlib.Path, config: str) -> dict[str, dict[str, dict]]:
    builder = tfds.builder_from_directory(str(data_dir / "foci" / config / "1.0.0"))
    return {
        split: {
            ex["image/filename"].decode(): ex
            for ex in tfds.as_numpy(builder.as_dataset(split=split))
        }
        for split in builder.info.splits
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SETS))
def test_mined_appendix_d_set_matches_transformers_and_builds(case, clip, tmp_path):
    config = case.split()[0]
    src = tmp_path / "src"
    labels = SETS[case](src)
    path, model, scorer = clip
    _mine(config, src, path, scorer)
    written = json.loads((src / foci_source.RELEASE_OPTIONS_FILE).read_text())
    mined = {e["image"]: e["options"] for group in written.values() for e in group}
    assert mined == torch_options(path, model, src, labels, ranked_classes(config))
    assert all(e["groundtruth"] == e["options"][0] for g in written.values() for e in g)
    assert list(written) == [c for c in ranked_classes(config) if c in labels.values()]

    datasets.build("foci", str(tmp_path / "data"), source=str(src), config=config)
    splits = _splits(tmp_path / "data", config)
    assert set(splits["test"]) == set(labels)
    for records in splits.values():
        for image, record in records.items():
            options = [o.decode() for o in record["options"]]
            assert sorted(options) == sorted(mined[image])
            assert options[record["answer"]] == record["label"].decode() == labels[image]
    # The halves and regions the builder writes from the one mined file.
    if config == "imagenet_1k":
        train = {i for i, label in labels.items() if CLASS_NAMES.index(label) % 2 == 0}
        assert set(splits["train_half"]) == train
        assert set(splits["test_half"]) == set(labels) - train
    if config == "geode":
        regions = {foci_source.region_split(r) for _, _, r in GEODE}
        assert set(splits) == {"test", *regions}
        for region in regions:
            members = {f"images/{p}" for p, _, r in GEODE if foci_source.region_split(r) == region}
            assert set(splits[region]) == members
