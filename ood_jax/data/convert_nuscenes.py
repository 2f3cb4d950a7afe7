"""nuScenes -> the oodbench source format: front-camera keyframes and the objects they show.

OODBench "selected 6,019 keyframes from the front camera in the validation set" of nuScenes:
`ood-jax convert nuscenes --version v1.0-trainval --split val` writes those images, with the
nuScenes objects each one shows, as the COCO source that `ood_jax.data.oodbench` reads (the
`oodbench` builder and `ood-jax mine oodbench`). The release is read with the official devkit
(nuscenes-devkit): the split's scenes are `nuscenes.utils.splits.create_splits_scenes()`'s, and a
scene the split names but the tables lack is passed over (v1.0-mini holds 10 of them).

What an image shows is the devkit's visibility rule (`NuScenes.get_sample_data` with a
`BoxVisibility`, i.e. `box_in_image`), which ignores occlusion: a 3D box counts when all 8 of its
corners are more than 0.1 m in front of the camera and

- `any` (default, `BoxVisibility.ANY`): at least one corner projects strictly inside the image
  from more than 1 m ahead;
- `all` (`BoxVisibility.ALL`): every corner does.

A box partly behind the camera counts under neither. Its COCO bbox is the extent of the 8
projected corners (all in front of the camera, so each projection is defined) clipped to the
image; as the devkit's export_2d_annotations_as_json notes, a projected 3D box is not a tight one.

Category names are nuScenes' `vehicle.car`-style paths, which a question cannot say; `CATEGORIES`
maps each of the 23 v1.0 categories to the plain words OODBench asks about, several to the same
words where nuScenes splits what a question would not (adult and child are both a "person"). None
is dropped: all 23 are object classes with 3D boxes. The lidarseg/panoptic category table's extra
classes (`flat.*`, `static.*`, `noise`, `vehicle.ego`) have no boxes and are never asked about.

Written into OUT as every converter writes (`ood_jax.data.conversion`):
`ood_jax_convert.json` (converter, dataroot, version, split, visibility rule, devkit version,
counts), `images` (a link to the dataroot: each `file_name` is "samples/CAM_FRONT/....jpg") and
`annotations.json`: images with ids 1..N in scene then time order, each with its
`nuscenes_sample_token`; categories in `CATEGORIES` order, all of them, so an image without a
car answers "no car" and ids do not depend on the split.
"""

from __future__ import annotations

import collections
import datetime
import importlib.metadata
import json
import pathlib
from typing import Any, Iterator

import numpy as np

from ood_jax import __version__
from ood_jax.data import building, conversion

CONVERTER = "ood_jax.data.convert_nuscenes"
CAMERA = "CAM_FRONT"

# nuScenes v1.0 category -> the plain words a question names it by.
CATEGORIES = {
    "vehicle.car": "car",
    "human.pedestrian.adult": "person",
    "human.pedestrian.child": "person",
    "human.pedestrian.construction_worker": "person",
    "human.pedestrian.police_officer": "person",
    "vehicle.bus.bendy": "bus",
    "vehicle.bus.rigid": "bus",
    "vehicle.truck": "truck",
    "vehicle.trailer": "trailer",
    "vehicle.construction": "construction vehicle",
    "vehicle.bicycle": "bicycle",
    "vehicle.motorcycle": "motorcycle",
    "movable_object.trafficcone": "traffic cone",
    "movable_object.barrier": "barrier",
    "animal": "animal",
    "human.pedestrian.stroller": "stroller",
    "human.pedestrian.wheelchair": "wheelchair",
    "human.pedestrian.personal_mobility": "scooter",
    "vehicle.emergency.ambulance": "ambulance",
    "vehicle.emergency.police": "police car",
    "static_object.bicycle_rack": "bicycle rack",
    "movable_object.pushable_pullable": "cart",
    "movable_object.debris": "debris",
}

# The splits each release annotates, paired as the devkit's create_splits_logs pairs them.
SPLITS = {
    "v1.0-trainval": ("train", "val", "train_detect", "train_track"),
    "v1.0-mini": ("mini_train", "mini_val"),
}
UNANNOTATED = {"v1.0-test": "test"}

VISIBILITY_RULES = {
    "any": "all 8 corners of the 3D box > 0.1 m in front of the camera and at least one "
    "projecting inside the image from > 1 m ahead (nuscenes BoxVisibility.ANY)",
    "all": "all 8 corners of the 3D box projecting inside the image from > 1 m ahead "
    "(nuscenes BoxVisibility.ALL)",
}

# The tables NuScenes() loads; checked first, so a missing one is named rather than a traceback.
TABLES = (
    "attribute",
    "calibrated_sensor",
    "category",
    "ego_pose",
    "instance",
    "log",
    "map",
    "sample",
    "sample_annotation",
    "sample_data",
    "scene",
    "sensor",
    "visibility",
)


def category_names() -> list[str]:
    """The plain names, in `CATEGORIES` order; category i + 1 of the output is the i-th."""
    return list(dict.fromkeys(CATEGORIES.values()))


def _check_request(version: str, split: str, visibility: str) -> None:
    if version in UNANNOTATED or split in UNANNOTATED.values():
        raise building.BuildError(
            f"nuScenes {version} split {split}: the test split has no annotations to convert; "
            "OODBench converts v1.0-trainval val"
        )
    if version not in SPLITS:
        raise building.BuildError(
            f"unknown nuScenes version {version!r}; expected one of {', '.join(SPLITS)}"
        )
    if split not in SPLITS[version]:
        raise building.BuildError(
            f"nuScenes {version} has no split {split!r}; its splits are "
            f"{', '.join(SPLITS[version])}"
        )
    if visibility not in VISIBILITY_RULES:
        raise building.BuildError(
            f"unknown visibility {visibility!r}; expected one of {', '.join(VISIBILITY_RULES)}"
        )


def _check_tables(dataroot: pathlib.Path, version: str) -> pathlib.Path:
    if not dataroot.is_dir():
        raise building.BuildError(f"{dataroot}: nuScenes dataroot not found")
    table_root = dataroot / version
    if not table_root.is_dir():
        raise building.BuildError(
            f"{table_root}: no {version} tables in the dataroot (its folders: "
            f"{', '.join(sorted(p.name for p in dataroot.iterdir() if p.is_dir())) or 'none'})"
        )
    for table in TABLES:
        if not (table_root / f"{table}.json").is_file():
            raise building.BuildError(f"{table_root / table}.json: nuScenes table not found")
    return table_root


def _devkit():
    """The devkit's NuScenes class, imported only when a conversion runs (it is optional and slow
    to import, and `ood-jax --help` builds this module's parser)."""
    try:
        from nuscenes.nuscenes import NuScenes
    except ImportError as e:
        raise building.BuildError(
            f"the nuScenes converter needs nuscenes-devkit ({e}): pip install 'ood-jax[sources]' "
            "and then pip install --no-deps nuscenes-devkit==1.2.0"
        ) from None
    return NuScenes


def _load(dataroot: pathlib.Path, version: str, table_root: pathlib.Path):
    NuScenes = _devkit()
    try:
        return NuScenes(version=version, dataroot=str(dataroot), verbose=False)
    # The devkit reports bad tables with asserts (a missing map mask) and lookups that fail.
    except (AssertionError, KeyError, json.JSONDecodeError) as e:
        raise building.BuildError(
            f"{table_root}: the nuScenes devkit cannot load the tables ({type(e).__name__}: {e})"
        ) from None


def _check_categories(nusc, table_root: pathlib.Path) -> None:
    """Every object's category must be in `CATEGORIES`; checked before the long walk."""
    for annotation in nusc.sample_annotation:
        # The devkit adds each annotation's category name (from instance.json and category.json).
        name = annotation["category_name"]
        if name not in CATEGORIES:
            raise building.BuildError(
                f"{table_root / 'category.json'}: category {name!r} (of sample_annotation "
                f"{annotation['token']}) is not in {CONVERTER}.CATEGORIES; add it there with the "
                "plain words a question should use"
            )


def _split_scenes(nusc, split: str, table_root: pathlib.Path) -> tuple[list[dict], int]:
    """(the split's scenes present in the tables, in the devkit's order; how many are absent)."""
    from nuscenes.utils.splits import create_splits_scenes

    names = create_splits_scenes()[split]
    by_name = {scene["name"]: scene for scene in nusc.scene}
    scenes = [by_name[name] for name in names if name in by_name]
    if not scenes:
        raise building.BuildError(
            f"{table_root / 'scene.json'}: none of split {split}'s {len(names)} scenes "
            f"({names[0]}, ...) is in the table"
        )
    return scenes, len(names) - len(scenes)


def _keyframes(nusc, scene: dict, table_root: pathlib.Path) -> Iterator[dict]:
    """A scene's samples (its keyframes), first to last along their `next` links."""
    token = scene["first_sample_token"]
    while token:
        try:
            sample = nusc.get("sample", token)
        except KeyError:
            raise building.BuildError(
                f"{table_root / 'sample.json'}: scene {scene['name']} links to sample {token}, "
                "which is not in the table"
            ) from None
        yield sample
        token = sample["next"]


def _camera_keyframe(nusc, sample: dict, scene: dict, table_root: pathlib.Path) -> dict:
    """The sample's CAM_FRONT sample_data record, whose image file must exist."""
    # The devkit indexes only keyframe sample_data under sample["data"].
    token = sample["data"].get(CAMERA)
    if token is None:
        raise building.BuildError(
            f"{table_root / 'sample_data.json'}: sample {sample['token']} of scene "
            f"{scene['name']} has no {CAMERA} keyframe"
        )
    record = nusc.get("sample_data", token)
    path = pathlib.Path(nusc.dataroot) / record["filename"]
    if not path.is_file():
        raise building.BuildError(
            f"{path}: image file of {CAMERA} keyframe {token} (sample {sample['token']}, scene "
            f"{scene['name']}) not found"
        )
    return record


def _bbox(corners: np.ndarray, intrinsic: np.ndarray, width: int, height: int) -> list[float]:
    """COCO [x, y, w, h] of a box's corners [3, 8] in the camera frame: their projections'
    extent, clipped to the image."""
    from nuscenes.utils.geometry_utils import view_points

    points = view_points(corners, intrinsic, normalize=True)[:2]
    x0, y0 = np.clip(points.min(1), 0, [width, height])
    x1, y1 = np.clip(points.max(1), 0, [width, height])
    return [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]


def _coco(nusc, split: str, visibility: str, table_root: pathlib.Path) -> tuple[dict, dict]:
    """(the COCO annotations of the split's CAM_FRONT keyframes, the conversion's counts)."""
    from nuscenes.utils.geometry_utils import BoxVisibility
    from tqdm import tqdm

    level = {"any": BoxVisibility.ANY, "all": BoxVisibility.ALL}[visibility]
    category_ids = {name: i for i, name in enumerate(category_names(), start=1)}
    scenes, absent = _split_scenes(nusc, split, table_root)
    images, annotations = [], []
    not_visible = 0
    for scene in tqdm(scenes, desc=f"nuScenes {split}", unit="scene", disable=None):
        for sample in _keyframes(nusc, scene, table_root):
            record = _camera_keyframe(nusc, sample, scene, table_root)
            image_id = len(images) + 1
            width, height = record["width"], record["height"]
            images.append(
                {
                    "id": image_id,
                    "file_name": record["filename"],
                    "width": width,
                    "height": height,
                    "nuscenes_sample_token": sample["token"],
                }
            )
            # Boxes come back in the camera's frame, only those the rule calls visible.
            _, boxes, intrinsic = nusc.get_sample_data(record["token"], box_vis_level=level)
            not_visible += len(sample["anns"]) - len(boxes)
            for box in boxes:
                bbox = _bbox(box.corners(), intrinsic, width, height)
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "category_id": category_ids[CATEGORIES[box.name]],
                        "bbox": bbox,
                        "area": bbox[2] * bbox[3],
                        "iscrowd": 0,
                        "nuscenes_category": box.name,
                        "nuscenes_annotation_token": box.token,
                    }
                )
    per_category = collections.Counter(a["category_id"] for a in annotations)
    counts = {
        "images": len(images),
        "annotations": {name: per_category[i] for name, i in category_ids.items()},
        "dropped": {f"objects not visible in {CAMERA} (rule {visibility})": not_visible},
        "scenes": len(scenes),
        "scenes_not_in_tables": absent,
    }
    categories = [{"id": i, "name": name} for name, i in category_ids.items()]
    return {"images": images, "annotations": annotations, "categories": categories}, counts


def convert(
    dataroot: str | pathlib.Path,
    version: str,
    split: str,
    out: str | pathlib.Path,
    *,
    visibility: str = "any",
) -> dict[str, Any]:
    """Converts a nuScenes split's CAM_FRONT keyframes into OUT (the module docstring says how).

    Returns the counts: images, annotations per plain category name, objects dropped as not
    visible, scenes converted and scenes of the split absent from the tables.
    """
    _check_request(version, split, visibility)
    dataroot, out = pathlib.Path(dataroot).resolve(), pathlib.Path(out)
    table_root = _check_tables(dataroot, version)
    request = {
        "converter": CONVERTER,
        "dataroot": str(dataroot),
        "version": version,
        "split": split,
        "camera": CAMERA,
        "visibility": visibility,
    }
    conversion.claim(out, request, dataroot)
    nusc = _load(dataroot, version, table_root)
    _check_categories(nusc, table_root)
    coco, counts = _coco(nusc, split, visibility, table_root)
    record = {
        **request,
        "visibility_rule": VISIBILITY_RULES[visibility],
        "nuscenes_devkit_version": importlib.metadata.version("nuscenes-devkit"),
        "ood_jax_version": __version__,
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "counts": counts,
    }
    conversion.write(out, dataroot, record, coco)
    return counts


def summary_lines(counts: dict[str, Any], out: str | pathlib.Path) -> str:
    boxes = sum(counts["annotations"].values())
    lines = [
        f"{out}: {counts['images']} {CAMERA} keyframes of {counts['scenes']} scene(s), {boxes} boxes"
    ]
    lines += [f"  {name}: {n}" for name, n in counts["annotations"].items() if n]
    lines += [f"{reason}: {n}" for reason, n in counts["dropped"].items()]
    if counts["scenes_not_in_tables"]:
        lines.append(f"scenes of the split not in the tables: {counts['scenes_not_in_tables']}")
    return "\n".join(lines)
