"""FOCI's hard choices: per image, the truth and the three wrong classes a CLIP model ranks
highest (`mine_options`), over the images and classes of a source directory (`read_source`), as
the options file the foci builder reads (`mine_source`, `options_file_contents`). Sources and the
rule: docs/guide/scorers-and-mining.md and docs/protocols.md.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax import mining
from ood_jax.data import foci as foci_source

NUM_OPTIONS = foci_source.NUM_OPTIONS
DEFAULT_TEMPLATES = ("an image of a {}",)
CLASS_NAMES_FILE = "class_names.json"
IMAGES_DIR = "images"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The release configs and FOCI's appendix D sets: mined from the split the builder itself reads,
# so image paths and class names are the ones it checks the options against.
RELEASE_CONFIGS = tuple(foci_source.RELEASE_TEST_SPLITS)
# The builder reads only an options file for these, so mining reads SRC/images/<folder>/<image>
# (the imagenet21k configs' image layout) with SRC/class_names.json naming each folder's class.
FOLDER_CONFIGS = (
    "imagenet21k_animal",
    "imagenet21k_plant",
    "imagenet21k_food",
    "imagenet21k_artifact",
    "custom",
)


# ---------------------------------------------------------------------------------------------
# Mining on features
# ---------------------------------------------------------------------------------------------


def _normalize(x: jax.Array) -> jax.Array:
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnames="num_negatives")
def _hard_negatives(images, labels, texts, *, num_negatives: int):
    """[B, k] wrong classes by decreasing cosine similarity (ties: lower class index first)."""
    similarity = _normalize(images) @ _normalize(texts).T
    is_truth = jnp.arange(texts.shape[0])[None, :] == labels[:, None]
    # lax.top_k puts the lower index first among equal values, which is the tie rule.
    _, negatives = jax.lax.top_k(jnp.where(is_truth, -jnp.inf, similarity), num_negatives)
    return negatives


def mine_options(
    image_features: np.ndarray,
    text_features: np.ndarray,
    labels: np.ndarray,
    num_options: int = NUM_OPTIONS,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    mesh: jax.sharding.Mesh | None = None,
) -> np.ndarray:
    """int [N, num_options]: the true class, then the most similar wrong classes, ascending.

    image_features [N, D] and text_features [C, D] are compared by cosine similarity (both are
    normalized here); labels [N] are class indices. Of the wrong classes, the num_options - 1 most
    similar are kept (equal similarity: the lower class index ranks higher) and listed from the
    least to the most similar, after the truth: the order of FOCI's files.
    """
    text_features = mining.check_features("text_features", text_features)
    num_classes, dim = text_features.shape
    image_features = mining.check_features("image_features", image_features, dim)
    labels = mining.check_indices("labels", labels, num_classes, len(image_features))
    if not 2 <= num_options <= num_classes:
        raise ValueError(
            f"num_options must be in [2, {num_classes}] (the classes), got {num_options}"
        )
    _check_nonzero("image_features", image_features)
    _check_nonzero("text_features", text_features)
    fn = functools.partial(_hard_negatives, num_negatives=num_options - 1)
    (negatives,) = mining.map_rows_in_chunks(
        fn, [image_features, labels], [text_features], chunk_size, mesh
    )
    # FOCI's options_generation.py takes np.argsort(cos)[-4:], ascending, and moves the truth to
    # the front: its released files list the negatives from the least to the most similar.
    return np.concatenate([labels[:, None], negatives[:, ::-1]], axis=1).astype(np.int64)


def _check_nonzero(name: str, features: np.ndarray) -> None:
    # A zero vector has no direction, so its cosine similarity is undefined.
    zero = ~np.any(features, axis=1)
    if zero.any():
        raise ValueError(f"{name} row {int(np.argmax(zero))} is all zeros")


@jax.jit
def _predictions(images, labels, options, texts):
    """Argmax over all classes and over each row's options (ties: lower class index)."""
    similarity = _normalize(images) @ _normalize(texts).T
    over_all = jnp.argmax(similarity, axis=1)
    option_similarity = jnp.take_along_axis(similarity, options, axis=1)
    best = jnp.max(option_similarity, axis=1, keepdims=True)
    # Among options tied at the best similarity, the lowest class index wins, as over all classes.
    big = jnp.iinfo(options.dtype).max
    over_options = jnp.min(jnp.where(option_similarity == best, options, big), axis=1)
    return over_all == labels, over_options == labels


def zero_shot_accuracy(
    image_features: np.ndarray,
    text_features: np.ndarray,
    labels: np.ndarray,
    options: np.ndarray,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, float]:
    """CLIP zero-shot accuracy over all classes and over each image's options (FOCI Fig. 3).

    FOCI compares each LVLM with its CLIP encoder restricted "to the same 4 labels"; the
    all-class accuracy is the usual zero-shot number. Prediction: the class of highest cosine
    similarity, ties to the lower class index. options: int [N, K] class indices per image.
    """
    text_features = mining.check_features("text_features", text_features)
    num_classes, dim = text_features.shape
    image_features = mining.check_features("image_features", image_features, dim)
    labels = mining.check_indices("labels", labels, num_classes, len(image_features))
    options = np.asarray(options)
    if options.ndim != 2 or len(options) != len(labels):
        raise ValueError(f"options must be [{len(labels)}, K], got shape {options.shape}")
    mining.check_indices("options", options.ravel(), num_classes, options.size)
    if not (options == labels[:, None]).any(axis=1).all():
        row = int(np.argmin((options == labels[:, None]).any(axis=1)))
        raise ValueError(f"options row {row} lacks its label {labels[row]}")
    if len(labels) == 0:
        raise ValueError("no images to score")
    correct_all, correct_options = mining.map_rows_in_chunks(
        _predictions, [image_features, labels, options.astype(np.int32)], [text_features],
        chunk_size, mesh,
    )  # fmt: skip
    return {
        "all_classes": float(correct_all.mean()),
        "options": float(correct_options.mean()),
        "num_images": len(labels),
        "num_classes": num_classes,
    }


# ---------------------------------------------------------------------------------------------
# Sources: the images and class names of a dataset before it has options
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """What mining reads: images (paths relative to root) with labels, and every class name."""

    root: pathlib.Path
    images: tuple[str, ...]
    labels: tuple[str, ...]
    class_names: tuple[str, ...]
    options_file: str  # where in root the foci builder looks for the options

    def label_indices(self) -> np.ndarray:
        index = {name: i for i, name in enumerate(self.class_names)}
        return np.array([index[label] for label in self.labels], np.int64)


def config_name(dataset: str) -> str:
    """ "foci/food101" or "food101" -> "food101"; ValueError for an unknown config."""
    name = dataset.removeprefix("foci/")
    if name not in RELEASE_CONFIGS + FOLDER_CONFIGS:
        raise ValueError(
            f"unknown FOCI config {dataset!r}; expected one of "
            f"{', '.join(RELEASE_CONFIGS + FOLDER_CONFIGS)} (optionally as foci/NAME)"
        )
    return name


def read_source(dataset: str, root: str | pathlib.Path) -> Source:
    """The images, labels and classes of FOCI config `dataset` under `root`; image paths are
    relative to root, as the builder stores them."""
    name, root = config_name(dataset), pathlib.Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: source directory does not exist")
    if name in RELEASE_CONFIGS:
        split = foci_source.RELEASE_TEST_SPLITS[name](root)
        images = tuple(sorted(split.labels))
        return Source(
            root=root,
            images=images,
            labels=tuple(split.labels[i] for i in images),
            class_names=_ranked_classes(name, root, split),
            options_file=foci_source.RELEASE_OPTIONS_FILE,
        )
    # Folders are WordNet ids for imagenet21k_*, so they need names; custom's are the names.
    return folder_source(root, foci_source.OPTIONS_FILE, names_required=name != "custom")


def _ranked_classes(name: str, root: pathlib.Path, split: foci_source.TestSplit) -> tuple[str, ...]:
    """The split's classes in the order ties are broken by: ImageNet's class index (FOCI's own
    order), else sorted. They are the set's own classes, as FOCI's options_generation.py ranks
    over its loader's: ImageNet-1k's 1000, the classes present for ImageNet-A, -R, -Sketch."""
    if name in foci_source.IMAGENET_FOLDERS:
        ordered = dict.fromkeys(foci_source.imagenet_class_names(root).values())  # names may repeat
        return tuple(c for c in ordered if c in split.class_names)
    return tuple(sorted(split.class_names))


def folder_source(root: pathlib.Path, options_file: str, names_required: bool) -> Source:
    """Images root/images/<folder>/<file>, the class of a folder named by class_names.json."""
    images_dir = root / IMAGES_DIR
    if not images_dir.is_dir():
        raise ValueError(f"{images_dir}: expected one folder of images per class")
    folders = sorted(p.name for p in images_dir.iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"{images_dir}: no class folders")
    names = _read_class_names(root / CLASS_NAMES_FILE, folders, names_required)
    if len(set(names.values())) != len(names):
        repeated = collections.Counter(names.values()).most_common(1)[0][0]
        raise ValueError(f"{root / CLASS_NAMES_FILE}: class name {repeated!r} names two folders")
    images, labels = [], []
    for folder in folders:
        files = sorted(
            p.name
            for p in (images_dir / folder).iterdir()
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        images += [f"{IMAGES_DIR}/{folder}/{f}" for f in files]
        labels += [names[folder]] * len(files)
    if not images:
        raise ValueError(f"{images_dir}: no images (suffixes {', '.join(IMAGE_SUFFIXES)})")
    return Source(
        root=root,
        images=tuple(images),
        labels=tuple(labels),
        class_names=tuple(names[f] for f in folders),
        options_file=options_file,
    )


def _read_class_names(path: pathlib.Path, folders: list[str], required: bool) -> dict[str, str]:
    if not path.is_file():
        if required:
            raise ValueError(
                f"{path}: file not found; it maps each folder of images/ to its class name, "
                '{"n01322508": "wolf pup", ...}'
            )
        return {folder: folder for folder in folders}
    try:
        names = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(names, dict) or not all(
        isinstance(v, str) and v.strip() for v in names.values()
    ):
        raise ValueError(f"{path}: expected an object {{folder: non-empty class name}}")
    missing = [f for f in folders if f not in names]
    if missing:
        raise ValueError(f"{path}: no class name for folder {missing[0]!r}")
    return {folder: names[folder] for folder in folders}


# ---------------------------------------------------------------------------------------------
# From a source to an options file
# ---------------------------------------------------------------------------------------------


def options_file_contents(source: Source, options: np.ndarray) -> dict[str, list[dict]]:
    """FOCI's format, {label: [{"image", "options", "groundtruth"}, ...]}, classes in order."""
    grouped: dict[str, list[dict]] = {name: [] for name in source.class_names}
    for image, label, row in zip(source.images, source.labels, options):
        names = [source.class_names[i] for i in row]
        grouped[label].append({"image": image, "options": names, "groundtruth": label})
    return {label: entries for label, entries in grouped.items() if entries}


def read_image(path: pathlib.Path) -> np.ndarray:
    """uint8 [H, W, 3] pixels; ValueError naming the file if it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except FileNotFoundError:
        raise ValueError(f"{path}: image file not found") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: corrupt or unreadable image ({e})") from None


class ImageFiles(Sequence):
    """Image files, each read (`read_image`) when indexed: a scorer reads only those it encodes
    (with several processes, each reads its own)."""

    def __init__(self, paths: Sequence[pathlib.Path]):
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ImageFiles(self.paths[index])
        return read_image(self.paths[index])


def encode_image_files(
    scorer,
    paths: Sequence[pathlib.Path],
    batch_size: int = 256,
    progress: bool = True,
    cache_dir: str | pathlib.Path | None = None,
) -> np.ndarray:
    """float32 [N, D] image features of the files, read and encoded `batch_size` at a time.

    With `cache_dir`, features are kept there by file path in shards of `batch_size`
    (`scorers.EmbeddingCache`, keyed to the scorer's identity): a killed run, rerun, encodes only
    the files it had not finished.
    """
    from tqdm import tqdm

    if not paths:
        raise ValueError("no images to encode")
    bar = tqdm(total=len(paths), desc="encoding images", unit="image", disable=not progress)

    def encode(batch: Sequence[pathlib.Path]) -> np.ndarray:
        features = np.asarray(scorer.encode_images(ImageFiles(batch), batch_size=batch_size))
        bar.update(len(batch))
        return features.astype(np.float32)

    with bar:
        if cache_dir is None:
            return np.concatenate(
                [encode(paths[i : i + batch_size]) for i in range(0, len(paths), batch_size)]
            )
        from ood_jax.scorers import EmbeddingCache

        identity = getattr(scorer, "identity", None)
        if identity is None:
            raise ValueError(f"cache {cache_dir}: the scorer has no identity to key it by")
        cache = EmbeddingCache(cache_dir, shard_size=batch_size, identity=identity)
        return cache.compute([str(path) for path in paths], lambda batch: batch, encode)


def mine_source(
    source: Source,
    scorer,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    batch_size: int = 256,
    chunk_size: int = mining.DEFAULT_CHUNK_SIZE,
    progress: bool = True,
    cache_dir: str | pathlib.Path | None = None,
) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """(options file contents, zero-shot accuracy) for a source, with a scorer's features
    (image features cached in `cache_dir` if given, see `encode_image_files`)."""
    text_features = np.asarray(
        scorer.encode_texts(list(source.class_names), templates=tuple(templates)), np.float32
    )
    image_features = encode_image_files(
        scorer, [source.root / image for image in source.images], batch_size, progress, cache_dir
    )
    labels = source.label_indices()
    options = mine_options(image_features, text_features, labels, chunk_size=chunk_size)
    accuracy = zero_shot_accuracy(image_features, text_features, labels, options, chunk_size)
    return options_file_contents(source, options), accuracy
