"""Mirrors of FOCI's releases: ImageNet-21k's own train/val folders, Stanford Cars from Kaggle."""

from __future__ import annotations

import pytest
from test_foci_builder import _build, _read_back, make_imagenet21k, make_stanford_cars

from ood_jax.data import building


def test_imagenet21k_images_are_read_from_its_train_and_val_folders(tmp_path):
    src = tmp_path / "src"
    expected = make_imagenet21k(src, absolute_paths=True)
    # The processed release keeps its images in imagenet21k_train/ and imagenet21k_val/.
    moved = {}
    for k, image in enumerate(sorted(expected)):
        folder = ("imagenet21k_train", "imagenet21k_val")[k % 2]
        target = src / image.replace("images/", f"{folder}/", 1)
        target.parent.mkdir(parents=True, exist_ok=True)
        (src / image).rename(target)
        moved[target.relative_to(src).as_posix()] = expected[image][0]
    records = _read_back(_build(tmp_path, "imagenet21k_animal", src))
    assert {path: r["label"].decode() for path, r in records.items()} == moved


def test_stanford_cars_from_the_kaggle_mirror_says_the_test_labels_are_missing(tmp_path):
    src = tmp_path / "src"
    make_stanford_cars(src)
    # Kaggle's devkit has the test annotations without their classes.
    (src / "cars_test_annos_withlabels.mat").rename(src / "devkit" / "cars_test_annos.mat")
    with pytest.raises(building.BuildError, match=r"Kaggle mirror\) has no test labels"):
        _build(tmp_path, "stanford_cars", src)
