"""`ood_jax.data.convert_nuscenes` on a small nuScenes release in the real table layout.

The fixture is what the official devkit loads: the 13 v1.0 tables, the map mask file, and real
1600x900 JPEG files, with the real CAM_FRONT calibration and a CAM_BACK beside it. Each object is
placed in the ego vehicle's frame and labelled by hand with what the camera sees of it: "all" (the
whole 3D box projects inside the image), "any" (part of it does) or None (behind the camera, out
of view, or partly behind the camera, which the devkit's rule excludes). The truth is those
labels; the bbox is checked against a pinhole projection written here with numpy alone.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from ood_jax import cli
from ood_jax.data import building, conversion, convert_nuscenes
from ood_jax.data import oodbench as oodbench_source

pytest.importorskip("nuscenes")  # the converter's devkit, an optional dependency

VERSION = "v1.0-mini"
WIDTH, HEIGHT = 1600, 900
# The real nuScenes CAM_FRONT calibration (intrinsic; camera pose in the ego frame).
FRONT = {
    "translation": [1.70079118954, 0.0159456324149, 1.51095763913],
    "rotation": [0.4998015430569128, -0.5030316162024876, 0.4997798114386805, -0.49737083824542755],
    "camera_intrinsic": [
        [1266.417203046554, 0.0, 816.2670197447984],
        [0.0, 1266.417203046554, 491.50706579294757],
        [0.0, 0.0, 1.0],
    ],
}
# CAM_BACK looks where CAM_FRONT does not: what it sees must not reach the output.
BACK = {
    "translation": [0.0283260309358, 0.00345136761476, 1.57910346144],
    "rotation": [0.5037872666382278, -0.49740249788611096, -0.4941850223835201, 0.5045496097725578],
    "camera_intrinsic": [
        [809.2209905677063, 0.0, 829.2196003259838],
        [0.0, 809.2209905677063, 481.77842384512485],
        [0.0, 0.0, 1.0],
    ],
}

# scene -> samples (keyframes, in time order) -> objects:
# (nuScenes category, centre in the ego frame [m], size w, l, h [m], yaw in the ego frame [deg],
#  what CAM_FRONT sees of it).
SCENES = {
    "scene-0103": {  # mini_val
        "val-1": [
            ("vehicle.car", (15, 0.5, 0.8), (1.9, 4.6, 1.6), 0, "all"),
            ("human.pedestrian.adult", (10, 2.5, 0.9), (0.7, 0.7, 1.8), 0, "all"),
            ("human.pedestrian.child", (8, -1.5, 0.6), (0.5, 0.5, 1.2), 0, "all"),
            ("vehicle.truck", (-12, 0, 1.5), (2.5, 8, 3), 0, None),  # behind: CAM_BACK's
            # Across the right edge: the end at y = -1 m is in view, the one at -11 m is not.
            ("vehicle.bus.rigid", (12, -6, 1.5), (2.5, 10, 3), 90, "any"),
        ],
        "val-2": [
            ("vehicle.car", (20, -3, 0.8), (1.9, 4.5, 1.6), 10, "all"),
            ("movable_object.trafficcone", (10, 20, 0.3), (0.4, 0.4, 0.7), 0, None),
            ("movable_object.barrier", (8, 4.5, 0.5), (0.5, 2.5, 1.0), 90, "any"),  # left edge
            # Alongside: its front is in the image, its back behind the camera.
            ("vehicle.truck", (1, -4, 1.5), (2.5, 10, 3), 0, None),
        ],
        "val-3": [("vehicle.truck", (-15, 1, 1.5), (2.5, 8, 3), 0, None)],
    },
    "scene-0061": {  # mini_train
        "train-1": [("vehicle.motorcycle", (9, 1, 0.6), (0.8, 2.1, 1.3), 0, "all")],
        "train-2": [
            ("human.pedestrian.police_officer", (12, -2, 0.9), (0.7, 0.7, 1.8), 0, "all"),
            ("human.pedestrian.adult", (11, 1, 0.9), (0.7, 0.7, 1.8), 0, "all"),
        ],
    },
}
SPLIT_SCENES = {"mini_val": "scene-0103", "mini_train": "scene-0061"}
# The ego pose of sample k of a scene: driving along a 30 degree heading.
EGO_START, EGO_YAW, EGO_STEP = np.array([411.3, 1180.9, 0.0]), 30.0, 5.0


def _token(*parts: object) -> str:
    return hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()


def _yaw_quaternion(degrees: float) -> list[float]:
    half = np.radians(degrees) / 2
    return [float(np.cos(half)), 0.0, 0.0, float(np.sin(half))]


def _rotation(q) -> np.ndarray:
    """The rotation matrix of a unit quaternion [w, x, y, z]."""
    w, x, y, z = q
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def _ego_pose(k: int) -> tuple[np.ndarray, list[float]]:
    heading = np.radians(EGO_YAW)
    step = EGO_STEP * k * np.array([np.cos(heading), np.sin(heading), 0.0])
    return EGO_START + step, _yaw_quaternion(EGO_YAW)


def _world_box(k: int, centre, yaw: float) -> tuple[list[float], list[float]]:
    """(centre, rotation) in the world of an object placed in sample k's ego frame."""
    translation, rotation = _ego_pose(k)
    world = _rotation(rotation) @ np.asarray(centre, float) + translation
    return world.tolist(), _yaw_quaternion(EGO_YAW + yaw)


def _jpeg(path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (WIDTH, HEIGHT), (90, 110, 130)).save(path, quality=50)


class _Tables:
    """The nuScenes tables being written, as lists of records."""

    def __init__(self):
        self.tables = collections.defaultdict(list)

    def add(self, table: str, **record) -> str:
        self.tables[table].append(record)
        return record["token"]

    def write(self, table_root: pathlib.Path) -> None:
        table_root.mkdir(parents=True)
        for name in convert_nuscenes.TABLES:
            (table_root / f"{name}.json").write_text(json.dumps(self.tables[name]))


def _write_channel(tables, root, scene, samples, channel, calibrated, stamps) -> None:
    """A camera's sample_data of a scene: a keyframe per sample and, for CAM_FRONT, a sweep
    (not a keyframe) after each, linked prev -> next as nuScenes links them."""
    frames = [(sample, stamp, True) for sample, stamp in zip(samples, stamps)]
    if channel == "CAM_FRONT":
        frames = [f for s in frames for f in (s, (s[0], s[1] + 50_000, False))]
    tokens = [_token(scene, channel, stamp) for _, stamp, _ in frames]
    for i, (sample, stamp, key) in enumerate(frames):
        folder = "samples" if key else "sweeps"
        filename = f"{folder}/{channel}/n015-2018-07-24-11-22-45+0800__{channel}__{stamp}.jpg"
        _jpeg(root / filename)
        translation, rotation = _ego_pose(samples.index(sample))
        tables.add(
            "ego_pose",
            token=_token("ego", tokens[i]),
            timestamp=stamp,
            translation=translation.tolist(),
            rotation=rotation,
        )
        tables.add(
            "sample_data",
            token=tokens[i],
            sample_token=_token(sample),
            ego_pose_token=_token("ego", tokens[i]),
            calibrated_sensor_token=calibrated,
            timestamp=stamp,
            fileformat="jpg",
            is_key_frame=key,
            height=HEIGHT,
            width=WIDTH,
            filename=filename,
            prev=tokens[i - 1] if i else "",
            next=tokens[i + 1] if i + 1 < len(tokens) else "",
        )


def write_nuscenes(root: pathlib.Path) -> pathlib.Path:
    """A v1.0-mini release in `root` holding `SCENES`; returns root."""
    tables = _Tables()
    for name in convert_nuscenes.CATEGORIES:
        tables.add("category", token=_token("category", name), name=name, description=name)
    tables.add("attribute", token=_token("attribute"), name="vehicle.moving", description="")
    for level, band in enumerate(("v0-40", "v40-60", "v60-80", "v80-100"), start=1):
        tables.add("visibility", token=str(level), level=band, description=band)
    calibrated = {}
    for channel, calibration in (("CAM_FRONT", FRONT), ("CAM_BACK", BACK)):
        tables.add("sensor", token=_token("sensor", channel), channel=channel, modality="camera")
        calibrated[channel] = tables.add(
            "calibrated_sensor",
            token=_token("calibrated", channel),
            sensor_token=_token("sensor", channel),
            **calibration,
        )
    log = tables.add(
        "log",
        token=_token("log"),
        logfile="n015-2018-07-24-11-22-45+0800",
        vehicle="n015",
        date_captured="2018-07-24",
        location="singapore-onenorth",
    )
    mask = "maps/53992ee3023e5494b90c316c183be829.png"
    (root / "maps").mkdir(parents=True)
    Image.new("L", (8, 8)).save(root / mask)
    tables.add(
        "map", token=_token("map"), log_tokens=[log], category="semantic_prior", filename=mask
    )
    start = 1532402927_000_000
    for s, (scene, samples) in enumerate(SCENES.items()):
        names = list(samples)
        stamps = [start + (s * 100 + k) * 500_000 for k in range(len(names))]
        tables.add(
            "scene",
            token=_token(scene),
            log_token=log,
            nbr_samples=len(names),
            first_sample_token=_token(names[0]),
            last_sample_token=_token(names[-1]),
            name=scene,
            description="",
        )
        for k, sample in enumerate(names):
            tables.add(
                "sample",
                token=_token(sample),
                timestamp=stamps[k],
                scene_token=_token(scene),
                prev=_token(names[k - 1]) if k else "",
                next=_token(names[k + 1]) if k + 1 < len(names) else "",
            )
            for i, (category, centre, size, yaw, _) in enumerate(samples[sample]):
                translation, rotation = _world_box(k, centre, yaw)
                annotation = _token(sample, i)
                tables.add(
                    "instance",
                    token=_token("instance", annotation),
                    category_token=_token("category", category),
                    nbr_annotations=1,
                    first_annotation_token=annotation,
                    last_annotation_token=annotation,
                )
                tables.add(
                    "sample_annotation",
                    token=annotation,
                    sample_token=_token(sample),
                    instance_token=_token("instance", annotation),
                    visibility_token="4",
                    attribute_tokens=[],
                    translation=translation,
                    size=list(size),
                    rotation=rotation,
                    prev="",
                    next="",
                    num_lidar_pts=10,
                    num_radar_pts=0,
                )
        for channel in calibrated:
            _write_channel(tables, root, scene, names, channel, calibrated[channel], stamps)
    tables.write(root / VERSION)
    return root


def truth(split: str, visibility: str) -> dict[str, collections.Counter]:
    """Sample token -> plain category name -> objects, from the hand labels."""
    seen = ("all", "any") if visibility == "any" else ("all",)
    return {
        _token(sample): collections.Counter(
            convert_nuscenes.CATEGORIES[o[0]] for o in objects if o[4] in seen
        )
        for sample, objects in SCENES[SPLIT_SCENES[split]].items()
    }


@pytest.fixture(scope="module")
def dataroot(tmp_path_factory) -> pathlib.Path:
    """One release for the tests that only read it."""
    return write_nuscenes(tmp_path_factory.mktemp("nuscenes"))


def _table(root: pathlib.Path, name: str) -> list[dict]:
    return json.loads((root / VERSION / f"{name}.json").read_text())


def _set_table(root: pathlib.Path, name: str, records: list[dict]) -> None:
    (root / VERSION / f"{name}.json").write_text(json.dumps(records))


def _per_image(coco: dict) -> dict[str, collections.Counter]:
    names = {c["id"]: c["name"] for c in coco["categories"]}
    tokens = {image["id"]: image["nuscenes_sample_token"] for image in coco["images"]}
    counts = {token: collections.Counter() for token in tokens.values()}
    for annotation in coco["annotations"]:
        counts[tokens[annotation["image_id"]]][names[annotation["category_id"]]] += 1
    return counts


def test_table_covers_the_devkits_categories():
    from nuscenes.panoptic.panoptic_utils import STUFF_START_CLASS_ID
    from nuscenes.utils.color_map import get_colormap

    # The devkit's class list in lidarseg index order: 0 is noise, 1..23 the v1.0 categories
    # (the ones with boxes), then the surfaces and the ego vehicle.
    categories = list(get_colormap())[1:STUFF_START_CLASS_ID]
    assert len(categories) == 23
    assert set(convert_nuscenes.CATEGORIES) == set(categories)
    assert convert_nuscenes.category_names()[:3] == ["car", "person", "bus"]
    assert len(convert_nuscenes.category_names()) == 19


@pytest.mark.parametrize("visibility", ["any", "all"])
@pytest.mark.parametrize("split", ["mini_val", "mini_train"])
def test_converts_the_splits_front_keyframes(dataroot, tmp_path, split, visibility):
    counts = convert_nuscenes.convert(dataroot, VERSION, split, tmp_path, visibility=visibility)
    coco = json.loads((tmp_path / "annotations.json").read_text())
    expected = truth(split, visibility)
    # Only this split's keyframes, in time order; the sweeps and CAM_BACK are not images.
    assert [image["nuscenes_sample_token"] for image in coco["images"]] == list(expected)
    assert [image["id"] for image in coco["images"]] == list(range(1, len(expected) + 1))
    for image in coco["images"]:
        assert image["file_name"].startswith("samples/CAM_FRONT/")
        assert (image["width"], image["height"]) == (WIDTH, HEIGHT)
    assert _per_image(coco) == expected
    names = convert_nuscenes.category_names()
    assert [(c["id"], c["name"]) for c in coco["categories"]] == list(enumerate(names, start=1))
    total = sum(expected.values(), collections.Counter())
    assert counts["images"] == len(expected)
    assert counts["annotations"] == {name: total[name] for name in names}
    objects = sum(len(o) for o in SCENES[SPLIT_SCENES[split]].values())
    assert sum(counts["dropped"].values()) == objects - total.total()
    assert (counts["scenes"], counts["scenes_not_in_tables"]) == (
        1,
        {"mini_val": 1, "mini_train": 7}[split],
    )


def _pinhole_bbox(k: int, centre, size, yaw: float) -> list[float]:
    """The clipped extent of a box's projected corners, computed without the devkit."""
    width, length, height = size
    signs = np.array(np.meshgrid([1, -1], [1, -1], [1, -1], indexing="ij")).reshape(3, -1)
    local = signs * np.array([[length / 2], [width / 2], [height / 2]])
    translation, rotation = _world_box(k, centre, yaw)
    world = _rotation(rotation) @ local + np.array(translation)[:, None]
    ego_translation, ego_rotation = _ego_pose(k)
    ego = _rotation(ego_rotation).T @ (world - ego_translation[:, None])
    camera = _rotation(FRONT["rotation"]).T @ (ego - np.array(FRONT["translation"])[:, None])
    assert (camera[2] > 0).all()
    pixels = np.array(FRONT["camera_intrinsic"]) @ camera
    u, v = pixels[0] / pixels[2], pixels[1] / pixels[2]
    x0, x1 = np.clip([u.min(), u.max()], 0, WIDTH)
    y0, y1 = np.clip([v.min(), v.max()], 0, HEIGHT)
    return [x0, y0, x1 - x0, y1 - y0]


def test_bbox_is_the_clipped_pinhole_projection(dataroot, tmp_path):
    convert_nuscenes.convert(dataroot, VERSION, "mini_val", tmp_path)
    coco = json.loads((tmp_path / "annotations.json").read_text())
    by_token = {a["nuscenes_annotation_token"]: a for a in coco["annotations"]}
    for k, sample in enumerate(SCENES["scene-0103"]):
        for i, (category, centre, size, yaw, seen) in enumerate(SCENES["scene-0103"][sample]):
            if seen is None:
                assert _token(sample, i) not in by_token
                continue
            annotation = by_token[_token(sample, i)]
            assert annotation["nuscenes_category"] == category
            expected = _pinhole_bbox(k, centre, size, yaw)
            np.testing.assert_allclose(annotation["bbox"], expected, atol=1e-6)
            assert annotation["area"] == pytest.approx(expected[2] * expected[3])
    bus = by_token[_token("val-1", 4)]["bbox"]
    assert bus[0] + bus[2] == WIDTH  # clipped at the right edge
    barrier = by_token[_token("val-2", 2)]["bbox"]
    assert barrier[0] == 0  # clipped at the left edge


def test_output_is_an_oodbench_source(dataroot, tmp_path):
    out = tmp_path / "nuscenes_val"
    convert_nuscenes.convert(dataroot, VERSION, "mini_val", out)
    categories, names, images = oodbench_source.read_annotations(out / "annotations.json")
    assert list(categories.values()) == convert_nuscenes.category_names()
    assert (out / "images").is_symlink() and (out / "images").resolve() == dataroot.resolve()
    for image in images.values():
        path = oodbench_source.image_path(out / "images", image)
        assert path.is_file() and Image.open(path).size == (WIDTH, HEIGHT)
    first = images[1]
    assert first.presence(names["person"]) and first.count(names["person"]) == 2
    assert first.presence(names["ambulance"]) is False
    record = json.loads((out / conversion.RECORD_FILE).read_text())
    assert record["converter"] == convert_nuscenes.CONVERTER
    assert (record["version"], record["split"], record["visibility"]) == (
        VERSION,
        "mini_val",
        "any",
    )
    assert record["dataroot"] == str(dataroot.resolve())
    assert record["nuscenes_devkit_version"] == "1.2.0"
    assert record["counts"]["images"] == 3


def test_same_conversion_reruns_another_is_refused(dataroot, tmp_path):
    convert_nuscenes.convert(dataroot, VERSION, "mini_val", tmp_path)
    before = (tmp_path / "annotations.json").read_text()
    convert_nuscenes.convert(dataroot, VERSION, "mini_val", tmp_path)
    assert (tmp_path / "annotations.json").read_text() == before
    with pytest.raises(building.BuildError, match="holds a conversion with split"):
        convert_nuscenes.convert(dataroot, VERSION, "mini_train", tmp_path)
    with pytest.raises(building.BuildError, match="holds a conversion with visibility"):
        convert_nuscenes.convert(dataroot, VERSION, "mini_val", tmp_path, visibility="all")
    assert (tmp_path / "annotations.json").read_text() == before


def test_annotations_of_unknown_origin_are_refused(dataroot, tmp_path):
    (tmp_path / "annotations.json").write_text("{}")
    with pytest.raises(building.BuildError, match="holds annotations.json or images without"):
        convert_nuscenes.convert(dataroot, VERSION, "mini_val", tmp_path)


def test_unknown_category_is_named(tmp_path):
    root = write_nuscenes(tmp_path / "nuscenes")
    categories = _table(root, "category")
    categories[0]["name"] = "vehicle.hovercraft"
    _set_table(root, "category", categories)
    with pytest.raises(building.BuildError) as error:
        convert_nuscenes.convert(root, VERSION, "mini_val", tmp_path / "out")
    message = str(error.value)
    assert "category.json: category 'vehicle.hovercraft'" in message
    assert "convert_nuscenes.CATEGORIES" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", ["v1.0-test", "v1.0-trainval"])
def test_test_split_has_no_annotations(tmp_path, version):
    with pytest.raises(building.BuildError, match="test split has no annotations"):
        convert_nuscenes.convert(tmp_path, version, "test", tmp_path / "out")


def test_split_of_another_version_is_refused(dataroot, tmp_path):
    with pytest.raises(building.BuildError, match="v1.0-mini has no split 'val'; its splits"):
        convert_nuscenes.convert(dataroot, VERSION, "val", tmp_path)


def test_missing_keyframe_image_is_named(tmp_path):
    root = write_nuscenes(tmp_path / "nuscenes")
    record = next(
        r
        for r in _table(root, "sample_data")
        if r["is_key_frame"]
        and r["sample_token"] == _token("val-2")
        and "CAM_FRONT" in r["filename"]
    )
    (root / record["filename"]).unlink()
    with pytest.raises(building.BuildError, match=r"image file of CAM_FRONT keyframe .* not found"):
        convert_nuscenes.convert(root, VERSION, "mini_val", tmp_path / "out")
    assert not (tmp_path / "out" / "annotations.json").exists()
    # Another split does not need that image.
    convert_nuscenes.convert(root, VERSION, "mini_train", tmp_path / "out")


def test_missing_dataroot_version_or_table_is_named(tmp_path):
    with pytest.raises(building.BuildError, match="nuScenes dataroot not found"):
        convert_nuscenes.convert(tmp_path / "absent", VERSION, "mini_val", tmp_path / "out")
    root = write_nuscenes(tmp_path / "nuscenes")
    with pytest.raises(building.BuildError, match=r"v1.0-trainval: no v1.0-trainval tables"):
        convert_nuscenes.convert(root, "v1.0-trainval", "val", tmp_path / "out")
    (root / VERSION / "sample_annotation.json").unlink()
    with pytest.raises(building.BuildError, match="sample_annotation.json: nuScenes table"):
        convert_nuscenes.convert(root, VERSION, "mini_val", tmp_path / "out")


def test_split_without_a_scene_in_the_tables_is_named(tmp_path):
    root = write_nuscenes(tmp_path / "nuscenes")
    scenes = _table(root, "scene")
    for scene in scenes:
        scene["name"] = scene["name"].replace("scene-0103", "scene-0999")
    _set_table(root, "scene", scenes)
    with pytest.raises(building.BuildError, match="none of split mini_val's 2 scenes"):
        convert_nuscenes.convert(root, VERSION, "mini_val", tmp_path / "out")


def test_cli_subcommand(dataroot, tmp_path, capsys):
    parser = cli.build_parser()
    out = tmp_path / "out"
    argv = [
        "convert",
        "nuscenes",
        "--dataroot",
        str(dataroot),
        "--version",
        VERSION,
        "--split",
        "mini_val",
    ]
    args = parser.parse_args([*argv, "--out", str(out), "--visibility", "all"])
    args.run(args)
    printed = capsys.readouterr().out
    assert f"{out}: 3 CAM_FRONT keyframes of 1 scene(s), 4 boxes" in printed
    assert "  person: 2" in printed
    coco = json.loads((out / "annotations.json").read_text())
    assert _per_image(coco) == truth("mini_val", "all")
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--out", str(out), "--visibility", "some"])
