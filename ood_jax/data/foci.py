"""FOCI's source files: the five releases' own test lists, read strictly.

Shared by the `foci` TFDS builder (which joins them with an options file) and by
`ood_jax.mining.foci` (which mines the options from the same images and labels). Image paths are
relative to the release's root, as in FOCI's loaders and its released option files; errors name
the file, line or field (`building.BuildError`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np

from ood_jax.data import building

NUM_OPTIONS = 4
RELEASE_OPTIONS_FILE = "foci_options.json"
OPTIONS_FILE = "options.json"
# The release files each test-split reader below opens, relative to SRC (a build's record keeps
# their digests).
RELEASE_TEST_FILES: dict[str, tuple[str, ...]] = {
    "food101": ("meta/test.json",),
    "flowers102": ("setid.mat", "imagelabels.mat"),
    "fgvc_aircraft": ("data/images_variant_test.txt",),
    "stanford_cars": ("cars_test_annos_withlabels.mat", "devkit/cars_meta.mat"),
    "oxford_pet": ("annotations/test.txt",),
}

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


def stanford_cars_test_split(src: pathlib.Path) -> TestSplit:
    annotations_path, meta_path = _release_files(src, "stanford_cars")
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


RELEASE_TEST_SPLITS: dict[str, Callable[[pathlib.Path], TestSplit]] = {
    "food101": food101_test_split,
    "flowers102": flowers102_test_split,
    "fgvc_aircraft": fgvc_aircraft_test_split,
    "stanford_cars": stanford_cars_test_split,
    "oxford_pet": oxford_pet_test_split,
}
