"""FOCI's source files: the releases' own test lists, read strictly.

The five FOCI datasets and the sets of its appendix D (ImageNet-1k val, ImageNet-A, -R and
-Sketch, GeoDE). Shared by the `foci` TFDS builder (which joins them with an options file) and
by `ood_jax.mining.foci` (which mines the options from the same images and labels). Image paths
are relative to SRC; where FOCI's loaders and released option files name an image relative to
the set's own root (`n01443537/sketch_16.jpg` under SRC/imagenet-r/), `TestSplit.aliases` maps
that name to the path. Errors name the file, line or field (`building.BuildError`).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import pathlib
import re
from collections.abc import Callable, Mapping

import numpy as np

from ood_jax.data import building

NUM_OPTIONS = 4
RELEASE_OPTIONS_FILE = "foci_options.json"
OPTIONS_FILE = "options.json"
# FOCI's released options files are data/<its name>-ViT-L-14-laion2b_s32b_b82k-4.json; a
# config also reads its file under that name in SRC. Our config name -> FOCI's dataset name.
FOCI_NAMES = {
    "food101": "food101",
    "flowers102": "flowers102",
    "fgvc_aircraft": "fgvc_aircraft",
    "stanford_cars": "stanford_cars",
    "oxford_pet": "oxford_pet",
    "imagenet21k_animal": "imagenet-6k-animal",
    "imagenet21k_plant": "imagenet-6k-plant",
    "imagenet21k_food": "imagenet-6k-food",
    "imagenet21k_artifact": "imagenet-6k-artifact",
    "imagenet_1k": "imagenet",
    "imagenet_a": "imagenet-adversarial",
    "imagenet_r": "imagenet-rendition",
    "imagenet_sketch": "imagenet-sketch",
    "geode": "geode",
}


def released_options_file(config: str) -> str | None:
    """The name of FOCI's released options file for `config` (None for a set of one's own)."""
    name = FOCI_NAMES.get(config)
    return f"{name}-ViT-L-14-laion2b_s32b_b82k-4.json" if name else None


# The release files each test-split reader below opens, relative to SRC (a build's record keeps
# their digests).
RELEASE_TEST_FILES: dict[str, tuple[str, ...]] = {
    "food101": ("meta/test.json",),
    "flowers102": ("setid.mat", "imagelabels.mat"),
    "fgvc_aircraft": ("data/images_variant_test.txt",),
    "stanford_cars": ("cars_test_annos_withlabels.mat", "devkit/cars_meta.mat"),
    "oxford_pet": ("annotations/test.txt",),
    "geode": ("index.csv",),
}
# ImageNet and its variants: one folder of images per WordNet id under SRC/<folder>, named as
# FOCI names them (`imagenet_class_names`); ImageNet's val may instead be flat with
# SRC/LOC_val_solution.csv (Kaggle's layout).
IMAGENET_FOLDERS = {
    "imagenet_1k": "val",
    "imagenet_a": "imagenet-a",
    "imagenet_r": "imagenet-r",
    "imagenet_sketch": "sketch",
}
IMAGENET_CLASS_NAMES_FILE = "classnames.txt"  # the user's names, over the shipped ones
# OpenAI CLIP's wording of the 1000 classes, in class-index order: the list FOCI's loaders use
# (open_clip's IMAGENET_CLASSNAMES). It names two pairs of classes alike (missile: 657 and 744;
# sunglasses: 836 and 837), so each pair is one class unless FOCI's options or the user's
# classnames.txt name them apart.
SHIPPED_IMAGENET_CLASS_NAMES = pathlib.Path(__file__).with_name("imagenet_class_names.txt")
IMAGENET_VAL_SOLUTION = "LOC_val_solution.csv"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# FOCI's Table 3 halves of ImageNet-1k: its training used every other class; its evaluation
# notebook counts class index % 2 == 0 as the first half, printed as Train Half.
IMAGENET_HALVES = ("train_half", "test_half")


def release_files(config: str, src: pathlib.Path) -> list[pathlib.Path]:
    """The files of the release that `config`'s test-split reader opens (for the build record)."""
    if config in IMAGENET_FOLDERS:
        flat = config == "imagenet_1k" and (src / IMAGENET_VAL_SOLUTION).exists()
        names = (IMAGENET_CLASS_NAMES_FILE,) if (src / IMAGENET_CLASS_NAMES_FILE).exists() else ()
        return [src / name for name in (*names, *((IMAGENET_VAL_SOLUTION,) if flat else ()))]
    if config == "stanford_cars":
        _check_not_kaggle_cars(src)
    return [src / name for name in RELEASE_TEST_FILES.get(config, ())]


# The Oxford 102 flower names in label order: the CLIP-style list FOCI's loader uses.
FLOWERS102_CLASSES = (
    "pink primrose", "hard-leaved pocket orchid", "canterbury bells", "sweet pea",
    "english marigold", "tiger lily", "moon orchid", "bird of paradise", "monkshood",
    "globe thistle", "snapdragon", "colt's foot", "king protea", "spear thistle", "yellow iris",
    "globe flower", "purple coneflower", "peruvian lily", "balloon flower",
    "giant white arum lily", "fire lily", "pincushion flower", "fritillary", "red ginger",
    "grape hyacinth", "corn poppy", "prince of wales feathers", "stemless gentian", "artichoke",
    "sweet william", "carnation", "garden phlox", "love in the mist", "mexican aster",
    "alpine sea holly", "ruby-lipped cattleya", "cape flower", "great masterwort", "siam tulip",
    "lenten rose", "barbeton daisy", "daffodil", "sword lily", "poinsettia", "bolero deep blue",
    "wallflower", "marigold", "buttercup", "oxeye daisy", "common dandelion", "petunia",
    "wild pansy", "primula", "sunflower", "pelargonium", "bishop of llandaff", "gaura",
    "geranium", "orange dahlia", "pink and yellow dahlia", "cautleya spicata",
    "japanese anemone", "black-eyed susan", "silverbush", "californian poppy", "osteospermum",
    "spring crocus", "bearded iris", "windflower", "tree poppy", "gazania", "azalea",
    "water lily", "rose", "thorn apple", "morning glory", "passion flower", "lotus", "toad lily",
    "anthurium", "frangipani", "clematis", "hibiscus", "columbine", "desert-rose", "tree mallow",
    "magnolia", "cyclamen", "watercress", "canna lily", "hippeastrum", "bee balm", "air plant",
    "foxglove", "bougainvillea", "camellia", "mallow", "mexican petunia", "bromelia",
    "blanket flower", "trumpet creeper", "blackberry lily",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TestSplit:
    """A release's test split: image path (relative to SRC) -> label, and its class names."""

    labels: dict[str, str]
    class_names: frozenset[str]
    source: str
    # FOCI's name of an image (relative to the set's root) -> its path relative to SRC.
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    # image path -> the split it is also written to (GeoDE's regions, ImageNet's halves).
    groups: dict[str, str] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Release test splits (paths relative to SRC, as in FOCI's loaders and released option files)
# ---------------------------------------------------------------------------------------------


def _release_files(src: pathlib.Path, config: str) -> list[pathlib.Path]:
    return [src / name for name in RELEASE_TEST_FILES[config]]


def _add(labels: dict[str, str], image: str, label: str, where: str) -> None:
    if labels.get(image, label) != label:
        raise building.BuildError(
            f"{where}: image {image} is labelled both {labels[image]!r} and {label!r}"
        )
    labels[image] = label


def _read_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    text = building.read_text(path)
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.startswith("#")
    ]


def _loadmat(path: pathlib.Path, key: str) -> np.ndarray:
    try:
        from scipy import io as scipy_io
    except ImportError:
        raise building.BuildError(
            f"{path}: reading .mat files needs scipy (pip install scipy)"
        ) from None
    try:
        contents = scipy_io.loadmat(path, squeeze_me=True)
    except FileNotFoundError:
        raise building.BuildError(f"{path}: file not found") from None
    except (ValueError, TypeError, OSError) as e:
        raise building.BuildError(f"{path}: not a readable .mat file ({e})") from None
    if key not in contents:
        raise building.BuildError(f"{path}: missing variable '{key}'")
    # squeeze_me turns a one-element array into a scalar; keep it an array.
    return np.atleast_1d(contents[key])


def _integers(values: np.ndarray, path: pathlib.Path, key: str) -> list[int]:
    values = np.asarray(values).ravel()
    if not np.issubdtype(values.dtype, np.number) or not np.all(values == np.round(values)):
        raise building.BuildError(f"{path}: '{key}' must hold integers")
    return [int(v) for v in values]


def food101_test_split(src: pathlib.Path) -> TestSplit:
    (path,) = _release_files(src, "food101")
    metadata = building.load_json(path)
    if not isinstance(metadata, dict):
        raise building.BuildError(f"{path}: expected an object {{class: [image, ...]}}")
    labels: dict[str, str] = {}
    for class_name, entries in metadata.items():
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise building.BuildError(f"{path}: class {class_name!r}: expected a list of names")
        for entry in entries:
            _add(labels, f"images/{entry}.jpg", class_name.replace("_", " "), str(path))
    names = frozenset(c.replace("_", " ") for c in metadata)
    return TestSplit(labels, names, str(path))


def flowers102_test_split(src: pathlib.Path) -> TestSplit:
    setid_path, labels_path = _release_files(src, "flowers102")
    image_ids = _integers(_loadmat(setid_path, "tstid"), setid_path, "tstid")
    class_ids = _integers(_loadmat(labels_path, "labels"), labels_path, "labels")
    labels: dict[str, str] = {}
    for image_id in image_ids:
        if not 1 <= image_id <= len(class_ids):
            raise building.BuildError(
                f"{setid_path}: test image id {image_id} has no label in {labels_path} "
                f"({len(class_ids)} labels)"
            )
        class_id = class_ids[image_id - 1]
        if not 1 <= class_id <= len(FLOWERS102_CLASSES):
            raise building.BuildError(
                f"{labels_path}: image {image_id} has label {class_id}, outside 1..102"
            )
        labels[f"jpg/image_{image_id:05d}.jpg"] = FLOWERS102_CLASSES[class_id - 1]
    return TestSplit(labels, frozenset(FLOWERS102_CLASSES), f"{setid_path} (tstid)")


def fgvc_aircraft_test_split(src: pathlib.Path) -> TestSplit:
    (path,) = _release_files(src, "fgvc_aircraft")
    labels: dict[str, str] = {}
    for number, line in _read_lines(path):
        parts = line.split(" ", 1)
        if len(parts) != 2 or not parts[1].strip():
            raise building.BuildError(f"{path}: line {number}: expected '<image id> <variant>'")
        _add(labels, f"data/images/{parts[0]}.jpg", parts[1].strip(), f"{path}: line {number}")
    return TestSplit(labels, frozenset(labels.values()), str(path))


def _check_not_kaggle_cars(src: pathlib.Path) -> None:
    """The Kaggle mirror of Stanford Cars has no test labels: say so, not just "not found"."""
    annotations_path = src / RELEASE_TEST_FILES["stanford_cars"][0]
    kaggle = src / "devkit" / "cars_test_annos.mat"
    if not annotations_path.exists() and kaggle.exists():
        raise building.BuildError(
            f"{annotations_path}: file not found; {kaggle} (as in the Kaggle mirror) has no "
            "test labels, which come in cars_test_annos_withlabels.mat (see pytorch/vision "
            "issue 7545)"
        )


def stanford_cars_test_split(src: pathlib.Path) -> TestSplit:
    annotations_path, meta_path = _release_files(src, "stanford_cars")
    _check_not_kaggle_cars(src)
    class_names = [str(name) for name in _loadmat(meta_path, "class_names").ravel()]
    annotations = _loadmat(annotations_path, "annotations").ravel()
    for field in ("class", "fname"):
        if annotations.dtype.names is None or field not in annotations.dtype.names:
            raise building.BuildError(f"{annotations_path}: annotations lack the field '{field}'")
    labels: dict[str, str] = {}
    for index, annotation in enumerate(annotations):
        class_id = int(annotation["class"])
        if not 1 <= class_id <= len(class_names):
            raise building.BuildError(
                f"{annotations_path}: annotation {index} ({annotation['fname']}) has class "
                f"{class_id}, outside 1..{len(class_names)} of {meta_path}"
            )
        image = f"cars_test/{annotation['fname']}"
        _add(labels, image, class_names[class_id - 1], f"{annotations_path}: annotation {index}")
    return TestSplit(labels, frozenset(class_names), str(annotations_path))


def pet_class_name(image_name: str) -> str:
    """'american_pit_bull_terrier_12' -> 'American Pit Bull Terrier' (torchvision's naming)."""
    return " ".join(part.title() for part in image_name.rsplit("_", 1)[0].split("_"))


def oxford_pet_test_split(src: pathlib.Path) -> TestSplit:
    (path,) = _release_files(src, "oxford_pet")
    labels: dict[str, str] = {}
    names_by_class_id: dict[str, str] = {}
    for number, line in _read_lines(path):
        parts = line.split()
        if len(parts) < 2:
            raise building.BuildError(f"{path}: line {number}: expected '<image> <class id> ...'")
        image_name, class_id = parts[:2]
        name = pet_class_name(image_name)
        # The name comes from the file name; a class id naming two breeds means a broken list.
        if names_by_class_id.setdefault(class_id, name) != name:
            raise building.BuildError(
                f"{path}: line {number}: class id {class_id} is "
                f"{names_by_class_id[class_id]!r} elsewhere but {name!r} here"
            )
        _add(labels, f"images/{image_name}.jpg", name, f"{path}: line {number}")
    return TestSplit(labels, frozenset(labels.values()), str(path))


# ---------------------------------------------------------------------------------------------
# FOCI's appendix D: ImageNet-1k val, ImageNet-A, -R, -Sketch (folders of WordNet ids), GeoDE
# ---------------------------------------------------------------------------------------------


def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1k WordNet ids in class-index order, from TFDS's imagenet2012 builder."""
    import tensorflow_datasets as tfds

    path = tfds.core.tfds_path() / "datasets" / "imagenet2012" / "labels.txt"
    return tuple(path.read_text().split())


def imagenet_class_names(
    src: pathlib.Path,
    named_images: Mapping[str, str] | None = None,
    options_path: pathlib.Path | None = None,
) -> dict[str, str]:
    """WordNet id -> class name, in class-index order.

    SRC/classnames.txt when the user has one (1000 distinct names, one per line); otherwise the
    shipped OpenAI CLIP list, where FOCI's options (`named_images`: an image's name in the
    options, ending in <wnid>/<file>, -> its groundtruth; read from `options_path`) rename the
    classes they ask about.
    """
    wnids = imagenet_wnids()
    path = src / IMAGENET_CLASS_NAMES_FILE
    if path.exists():
        return dict(zip(wnids, _user_class_names(path, len(wnids))))
    names = dict(zip(wnids, SHIPPED_IMAGENET_CLASS_NAMES.read_text().splitlines()))
    return {**names, **_names_in_options(named_images or {}, set(wnids), options_path)}


def _user_class_names(path: pathlib.Path, expected: int) -> list[str]:
    names = [line.strip() for line in building.read_text(path).splitlines()]
    if len(names) != expected:
        raise building.BuildError(
            f"{path}: {len(names)} lines, expected {expected}: one ImageNet class name per "
            "line in class-index order (tench first), as OpenAI CLIP's list that FOCI uses"
        )
    first_line: dict[str, int] = {}
    for number, name in enumerate(names, start=1):
        if not name:
            raise building.BuildError(f"{path}: line {number} is empty")
        if first_line.setdefault(name, number) != number:
            raise building.BuildError(
                f"{path}: line {number}: {name!r} is also line {first_line[name]}; each class "
                "needs its own name"
            )
    return names


def _names_in_options(
    named_images: Mapping[str, str], wnids: set[str], options_path: pathlib.Path | None
) -> dict[str, str]:
    """WordNet id -> the groundtruth FOCI's options give its images; one name per id."""
    names: dict[str, str] = {}
    first_image: dict[str, str] = {}
    for image, name in named_images.items():
        parts = image.replace("\\", "/").split("/")
        wnid = parts[-2] if len(parts) >= 2 else None
        if wnid not in wnids:
            continue  # not in a <wnid>/ folder: the test split reports the image
        if names.setdefault(wnid, name) != name:
            raise building.BuildError(
                f"{options_path or 'options'}: image {image} is labelled {name!r}, but "
                f"{first_image[wnid]} of the same WordNet id {wnid} is labelled {names[wnid]!r}"
            )
        first_image.setdefault(wnid, image)
    return names


def _folder_images(folder: pathlib.Path) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )


def _wnid_folders(src: pathlib.Path, root: str, names: dict[str, str]) -> TestSplit:
    """Images SRC/<root>/<wnid>/<file>, FOCI's names <wnid>/<file>; every folder a known class."""
    base = src / root
    if not base.is_dir():
        raise building.BuildError(f"{base}: not found; expected one folder per WordNet id")
    labels: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        if folder.name not in names:
            raise building.BuildError(
                f"{folder}: {folder.name!r} is not one of the 1000 ImageNet WordNet ids"
            )
        for image in _folder_images(folder):
            path = f"{root}/{folder.name}/{image}"
            labels[path] = names[folder.name]
            aliases[f"{folder.name}/{image}"] = path
    if not labels:
        raise building.BuildError(f"{base}: no images in <wnid>/ folders")
    # The classes are the ones present, as FOCI's loader (ImageNet-A and -R hold 200).
    return TestSplit(labels, frozenset(labels.values()), str(base), aliases)


def _flat_val(src: pathlib.Path, names: dict[str, str]) -> TestSplit:
    """Kaggle's flat SRC/val/<ImageId>.JPEG, labelled by LOC_val_solution.csv's first WordNet id."""
    path = src / IMAGENET_VAL_SOLUTION
    rows = _csv_rows(path, ("ImageId", "PredictionString"))
    labels: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for number, row in rows:
        image_id, boxes = row["ImageId"].strip(), row["PredictionString"].split()
        if not image_id or not boxes or boxes[0] not in names:
            raise building.BuildError(
                f"{path}: line {number}: expected '<ImageId>,<wnid> <box> ...' with one of the "
                "1000 ImageNet WordNet ids"
            )
        image = f"val/{image_id}.JPEG"
        _add(labels, image, names[boxes[0]], f"{path}: line {number}")
        aliases[f"{boxes[0]}/{image_id}.JPEG"] = image
    return TestSplit(labels, frozenset(names.values()), str(path), aliases)


def imagenet_test_split(config: str) -> Callable[..., TestSplit]:
    """The reader of an ImageNet set; `named_images` are FOCI's options' names (see
    `imagenet_class_names`)."""

    def read(
        src: pathlib.Path,
        named_images: Mapping[str, str] | None = None,
        options_path: pathlib.Path | None = None,
    ) -> TestSplit:
        names = imagenet_class_names(src, named_images, options_path)
        if config != "imagenet_1k":
            return _wnid_folders(src, IMAGENET_FOLDERS[config], names)
        flat = (src / IMAGENET_VAL_SOLUTION).exists()
        split = _flat_val(src, names) if flat else _wnid_folders(src, "val", names)
        # By the image's WordNet id (its alias is <wnid>/<file>), not its name: two classes
        # may share a name.
        index = {wnid: k for k, wnid in enumerate(names)}
        halves = {
            image: IMAGENET_HALVES[index[alias.split("/")[0]] % 2]
            for alias, image in split.aliases.items()
        }
        # Every class is asked about in ImageNet-1k, present in its folders or not.
        return dataclasses.replace(split, class_names=frozenset(names.values()), groups=halves)

    return read


def _csv_rows(path: pathlib.Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(building.read_text(path)))
    missing = [c for c in columns if c not in (reader.fieldnames or ())]
    if missing:
        raise building.BuildError(f"{path}: no column {missing[0]!r} (columns {reader.fieldnames})")
    rows = []
    for number, row in enumerate(reader, start=2):
        if any(row.get(c) is None for c in columns):
            raise building.BuildError(f"{path}: line {number}: fewer fields than the header")
        rows.append((number, row))
    return rows


def region_split(region: str) -> str:
    """GeoDE's region as a split name: 'SouthEastAsia' or 'Southeast Asia' -> south_east_asia /
    southeast_asia (lowercase, words joined by '_')."""
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", region.strip())
    return "_".join(re.findall(r"[a-z0-9]+", words.lower()))


def geode_test_split(src: pathlib.Path) -> TestSplit:
    """GeoDE's index.csv: images SRC/images/<file_path>, label `object` with '_' -> ' ' (FOCI's
    loader), and each image also in the split of its `region`."""
    (path,) = _release_files(src, "geode")
    labels: dict[str, str] = {}
    groups: dict[str, str] = {}
    for number, row in _csv_rows(path, ("file_path", "object", "region")):
        where = f"{path}: line {number}"
        file_path, label = row["file_path"].strip(), row["object"].strip().replace("_", " ")
        region = region_split(row["region"])
        if not file_path or not label or not region:
            raise building.BuildError(f"{where}: empty file_path, object or region")
        if region == "test":
            raise building.BuildError(f"{where}: region {row['region']!r} would be split test")
        image = f"images/{file_path}"
        _add(labels, image, label, where)
        groups[image] = region
    return TestSplit(labels, frozenset(labels.values()), str(path), groups=groups)


RELEASE_TEST_SPLITS: dict[str, Callable[..., TestSplit]] = {
    "food101": food101_test_split,
    "flowers102": flowers102_test_split,
    "fgvc_aircraft": fgvc_aircraft_test_split,
    "stanford_cars": stanford_cars_test_split,
    "oxford_pet": oxford_pet_test_split,
    **{config: imagenet_test_split(config) for config in IMAGENET_FOLDERS},
    "geode": geode_test_split,
}
