"""COUNTS OODG items: grounding, localization and mapping questions about a built COUNTS (or
synthetic_shifts) split, with in-context examples drawn per distribution-shift setting
(`build_items`), written as DIR/images/*.png and the DIR/items.jsonl the evaluation harness reads
(`write`). Tasks, settings and where they differ from the paper: docs/protocols.md.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import pathlib
import string
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ood_jax import boxes as box_lib
from ood_jax import files, prompts
from ood_jax.data import counts, iteration
from ood_jax.metrics import coco

TASKS = ("grounding", "localization", "mapping")
SETTINGS = ("zero_shot", "iid", "covariate_shift", "label_shift", "spurious_correlation")
NUM_OPTIONS = 4
LOCALIZATION_SIZE = prompts.LOCALIZATION_IMAGE_SIZE
COLORS = {"blue": (0, 0, 255), "red": (255, 0, 0), "yellow": (255, 255, 0), "green": (0, 255, 0)}
MAPPING_COLORS = prompts.MAPPING_COLORS
GROUNDING_COLOR = "red"
# COCO's area bounds (the paper's "< 32 x 32" and "> 96 x 96").
SMALL_AREA = coco.AREA_RANGES["small"][1]
MEDIUM_AREA = coco.AREA_RANGES["medium"][1]
# Table 9's frame around in-context examples, the lines `prompts.counts_grounding` prints.
ICE_HEADER = ("Answer the final question according to the following examples.", "Examples:")
FINAL_PREFIX = "Final "
ITEMS_FILE = "items.jsonl"
IMAGES_DIR = "images"


# ---------------------------------------------------------------------------------------------
# Records and units
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Record:
    """One image's annotations as read from TFDS (pixels are decoded only when drawn)."""

    split: str  # TFDS split, "{source split}_{its domains}" (counts.split_name)
    image_id: int
    domain: str
    width: int
    height: int
    boxes: np.ndarray  # [n, 4] normalized [xmin, ymin, xmax, ymax]
    labels: tuple[str, ...]
    areas: np.ndarray  # [n] annotation areas in pixels
    crowd: np.ndarray  # [n] bool

    @property
    def key(self) -> tuple[str, int]:
        return self.split, self.image_id


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """What one question asks about: some objects of one image and their categories, in order."""

    task: str
    record: Record
    objects: tuple[int, ...]  # grounding: 1; mapping: 4 in colour order; localization: all
    labels: tuple[str, ...]  # per object (localization: the one category)

    @property
    def domain(self) -> str:
        return self.record.domain

    @property
    def name(self) -> str:
        """File stem, unique per drawn image."""
        if self.task == "grounding":
            return f"{self.record.image_id}_g{self.objects[0]}"
        if self.task == "mapping":
            return f"{self.record.image_id}_m{'-'.join(map(str, self.objects))}"
        return f"{self.record.image_id}_s{LOCALIZATION_SIZE}"

    @property
    def image_path(self) -> str:
        return f"{IMAGES_DIR}/{self.record.split}/{self.name}.png"


def size_bucket(area: float) -> str:
    """S (< 32^2), M (32^2 to 96^2) or L (> 96^2), the paper's object sizes."""
    if area < SMALL_AREA:
        return "S"
    return "M" if area <= MEDIUM_AREA else "L"


def _permutation(key: str, n: int) -> np.ndarray:
    # Seeded by a string, so a unit's colour order is the same in every run and on every machine.
    digest = hashlib.sha256(key.encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big")).permutation(n)


def grounding_units(records: Iterable[Record]) -> list[Unit]:
    """One unit per non-crowd object (Tables 8/9), boxed in red on the image at its own size."""
    return [
        Unit("grounding", r, (k,), (r.labels[k],))
        for r in records
        for k in range(len(r.labels))
        if not r.crowd[k]
    ]


def localization_units(records: Iterable[Record]) -> list[Unit]:
    """One unit per category of an image (Table 10), all its boxes; a category with a crowd box
    there is left out, as a crowd box has no instance count to answer with."""
    units = []
    for r in records:
        crowded = {r.labels[k] for k in range(len(r.labels)) if r.crowd[k]}
        by_category = collections.defaultdict(list)
        for k, label in enumerate(r.labels):
            if not r.crowd[k]:
                by_category[label].append(k)
        units += [
            Unit("localization", r, tuple(objects), (label,))
            for label, objects in sorted(by_category.items())
            if label not in crowded
        ]
    return units


def mapping_units(records: Iterable[Record]) -> list[Unit]:
    """One unit per image of at least four non-crowd objects (Table 11): four of them, boxed in
    MAPPING_COLORS in a fixed pseudo-random order per image, so colour says nothing of size."""
    units = []
    n = len(MAPPING_COLORS)
    for r in records:
        candidates = [k for k in range(len(r.labels)) if not r.crowd[k]]
        if len(candidates) < n:
            continue
        # Distinct categories first (each by its largest object), then the largest of the rest.
        by_area = sorted(candidates, key=lambda k: (-float(r.areas[k]), k))
        chosen, seen = [], set()
        for k in by_area:
            if r.labels[k] not in seen and len(chosen) < n:
                chosen.append(k)
                seen.add(r.labels[k])
        chosen += [k for k in by_area if k not in chosen][: n - len(chosen)]
        order = _permutation(f"{r.split}/{r.image_id}", n)
        objects = tuple(chosen[i] for i in order)
        units.append(Unit("mapping", r, objects, tuple(r.labels[k] for k in objects)))
    return units


UNIT_BUILDERS = {
    "grounding": grounding_units,
    "localization": localization_units,
    "mapping": mapping_units,
}


# ---------------------------------------------------------------------------------------------
# In-context example selection
# ---------------------------------------------------------------------------------------------


class ExamplePool:
    """Units that may serve as in-context examples, indexed for fast filtering by rule."""

    def __init__(self, units: Sequence[Unit], label_names: Sequence[str]):
        if len(label_names) > 63:
            raise ValueError(f"at most 63 categories are supported, got {len(label_names)}")
        self.units = list(units)
        self.bits = {name: 1 << i for i, name in enumerate(label_names)}
        self.domain = np.array([u.domain for u in self.units], dtype=object)
        self.mask = np.array([self.label_mask(u.labels) for u in self.units], np.int64)
        self.image = [u.record.key for u in self.units]

    def label_mask(self, labels: Iterable[str]) -> int:
        mask = 0
        for label in labels:
            mask |= self.bits[label]
        return mask

    def has(self, label: str) -> np.ndarray:
        return (self.mask & self.bits[label]) != 0

    def draw(
        self, candidates: np.ndarray, k: int, exclude: tuple[str, int], rng: np.random.Generator
    ) -> list[int] | None:
        """k candidates from k different images, none from `exclude`; None if there are not k."""
        chosen, images = [], {exclude}
        for i in rng.permutation(np.flatnonzero(candidates)).tolist():
            if self.image[i] not in images:
                chosen.append(i)
                images.add(self.image[i])
                if len(chosen) == k:
                    return chosen
        return None


def select_examples(
    test: Unit, pool: ExamplePool, setting: str, k: int, rng: np.random.Generator
) -> list[Unit] | None:
    """The in-context examples of `test` under `setting`, or None if too few exist: never from
    the test's image, never two from one image.

    zero_shot: none; iid: from the test's domain; covariate_shift: from the other domains;
    label_shift: from the test's domain, with none of the test's categories;
    spurious_correlation: `_spurious_examples`.
    """
    if setting == "zero_shot":
        if k:
            raise ValueError(f"zero_shot takes no in-context examples, got {k}")
        return []
    if k < 1:
        raise ValueError(f"setting {setting} needs at least one in-context example, got {k}")
    same_domain = pool.domain == test.domain
    exclude = test.record.key
    if setting == "iid":
        picked = pool.draw(same_domain, k, exclude, rng)
    elif setting == "covariate_shift":
        picked = pool.draw(~same_domain, k, exclude, rng)
    elif setting == "label_shift":
        disjoint = (pool.mask & pool.label_mask(test.labels)) == 0
        picked = pool.draw(same_domain & disjoint, k, exclude, rng)
    elif setting == "spurious_correlation":
        picked = _spurious_examples(test, pool, k, rng)
    else:
        raise ValueError(f"unknown setting {setting!r}; expected one of {', '.join(SETTINGS)}")
    return None if picked is None else [pool.units[i] for i in picked]


def _spurious_examples(
    test: Unit, pool: ExamplePool, k: int, rng: np.random.Generator
) -> list[int] | None:
    """The paper's cat-indoors / dog-outdoors example as a rule: with the test's label y (for
    mapping, the blue box's) and domain d, a wrong label y' and another domain d' are drawn; the
    examples alternate y' shown in d (without any test label) and y shown in d' (without y'), so
    a model that learns the co-occurrence answers y' for the test, which shows y in d."""
    label = test.labels[0]
    disjoint = (pool.mask & pool.label_mask(test.labels)) == 0
    same_domain = pool.domain == test.domain
    others = sorted(set(pool.domain.tolist()) - {test.domain})
    num_a, num_b = (k + 1) // 2, k // 2
    # The first wrong label, then other domain, in seeded order, with enough examples of each kind.
    for wrong in rng.permutation(sorted(set(pool.bits) - set(test.labels))).tolist():
        picked_a = pool.draw(same_domain & disjoint & pool.has(wrong), num_a, test.record.key, rng)
        if picked_a is None:
            continue
        if not num_b:
            return picked_a
        for domain in rng.permutation(others).tolist():
            # Another domain than the first kind's, so no image is shared with it.
            kind_b = (pool.domain == domain) & pool.has(label) & ~pool.has(wrong)
            picked_b = pool.draw(kind_b, num_b, test.record.key, rng)
            if picked_b is not None:
                # Alternate: wrong label in the test's domain, test's label in the other domain.
                order = [0] * k
                order[0::2], order[1::2] = picked_a, picked_b
                return order
    return None


# ---------------------------------------------------------------------------------------------
# Options and prompts
# ---------------------------------------------------------------------------------------------


def _choice_text(options: Sequence[str], index: int) -> str:
    return f"({string.ascii_uppercase[index]}) {options[index]}"


def draw_options(
    labels: Sequence[str], concepts: Sequence[str], rng: np.random.Generator
) -> tuple[list[str], list[int]]:
    """NUM_OPTIONS options: the distinct `labels` plus random other concepts, shuffled.

    Returns (options, index of each label in options).
    """
    truths = list(dict.fromkeys(labels))
    others = [c for c in concepts if c not in truths]
    if len(truths) > NUM_OPTIONS or len(truths) + len(others) < NUM_OPTIONS:
        raise ValueError(f"cannot make {NUM_OPTIONS} options from {truths} and {len(others)} more")
    fillers = rng.choice(len(others), NUM_OPTIONS - len(truths), replace=False)
    options = [truths[i] if i < len(truths) else None for i in range(NUM_OPTIONS)]
    options[len(truths) :] = [others[i] for i in sorted(fillers.tolist())]
    options = [options[i] for i in rng.permutation(NUM_OPTIONS).tolist()]
    return options, [options.index(label) for label in labels]


def localization_boxes(unit: Unit) -> list[list[float]]:
    """The unit's boxes as [x, y, w, h] pixels of the 448 x 448 image sent."""
    xyxy = unit.record.boxes[list(unit.objects)].astype(np.float64) * LOCALIZATION_SIZE
    return [[round(float(v), 3) for v in box] for box in box_lib.xyxy_to_xywh(xyxy)]


def _box_line(box: Sequence[float]) -> str:
    return "Box item: [" + ", ".join(str(int(round(v))) for v in box) + "]"


def _localization_block(unit: Unit, question: str) -> str:
    return f"{question}{prompts.IMAGE_PLACEHOLDER}\n{prompts.counts_localization(unit.labels[0])}"


@dataclasses.dataclass(frozen=True)
class Question:
    """A unit with its options drawn: everything a prompt or an item needs."""

    unit: Unit
    options: list[str] | None
    answer: int | list[int] | list[list[float]]


def make_question(unit: Unit, concepts: Sequence[str], rng: np.random.Generator) -> Question:
    if unit.task == "localization":
        return Question(unit, None, localization_boxes(unit))
    options, answer = draw_options(unit.labels, concepts, rng)
    return Question(unit, options, answer[0] if unit.task == "grounding" else answer)


def build_prompt(test: Question, examples: Sequence[Question]) -> str:
    """The prompt with one <image> per example, then one for the test, in that order.

    The paper prints in-context layouts for grounding only (Table 9); localization and mapping
    examples take Table 9's frame, each followed by its answer as its format template asks
    ("Box item: [x, y, w, h]" lines, "<colour> box:(<letter>) <option>" lines). Table 10 has no
    image placeholder: `<image>` goes before its text."""
    task = test.unit.task
    if task == "grounding":
        in_context = [
            prompts.InContextExample(e.options, _choice_text(e.options, e.answer)) for e in examples
        ]
        return prompts.counts_grounding(test.options, in_context)
    if task == "mapping":
        if not examples:
            return prompts.counts_mapping(test.options)
        lines = list(ICE_HEADER)
        for e in examples:
            lines.append(prompts.counts_mapping(e.options))
            lines.append("Answer choice:")
            lines += [
                f"{color} box:{_choice_text(e.options, i)}"
                for color, i in zip(MAPPING_COLORS, e.answer)
            ]
        lines.append(FINAL_PREFIX + prompts.counts_mapping(test.options))
        return "\n".join(lines)
    if not examples:
        return _localization_block(test.unit, "")
    lines = list(ICE_HEADER)
    for e in examples:
        lines.append(_localization_block(e.unit, "Question: "))
        lines += [_box_line(box) for box in e.answer]
    lines.append(_localization_block(test.unit, FINAL_PREFIX + "Question: "))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def line_width(width: int, height: int) -> int:
    """Outline thickness: 2 px, growing with the image so boxes stay visible on large ones."""
    return max(2, round(min(width, height) / 160))


def pixel_rectangle(box: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
    """Normalized [xmin, ymin, xmax, ymax] -> the first and last pixel columns and rows inside."""
    x0, y0, x1, y1 = box_lib.scale(np.asarray(box, np.float64), height, width).tolist()
    left, top = min(max(round(x0), 0), width - 1), min(max(round(y0), 0), height - 1)
    right, bottom = (
        min(max(round(x1) - 1, left), width - 1),
        min(max(round(y1) - 1, top), height - 1),
    )
    return left, top, right, bottom


def render(unit: Unit, pixels: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] image as sent: boxes drawn (grounding, mapping) or resized (localization)."""
    from PIL import Image, ImageDraw

    record = unit.record
    if pixels.shape != (record.height, record.width, 3):
        raise ValueError(
            f"{record.split} image {record.image_id}: decoded shape {pixels.shape} differs from "
            f"{record.height}x{record.width}x3"
        )
    image = Image.fromarray(pixels)
    if unit.task == "localization":
        size = (LOCALIZATION_SIZE, LOCALIZATION_SIZE)
        return np.asarray(image.resize(size, Image.Resampling.BICUBIC))
    colors = [GROUNDING_COLOR] if unit.task == "grounding" else list(MAPPING_COLORS)
    draw = ImageDraw.Draw(image)
    thickness = line_width(record.width, record.height)
    for k, color in zip(unit.objects, colors, strict=True):
        rectangle = pixel_rectangle(record.boxes[k], record.width, record.height)
        draw.rectangle(rectangle, outline=COLORS[color], width=thickness)
    return np.asarray(image)


def image_size(unit: Unit) -> list[int]:
    if unit.task == "localization":
        return [LOCALIZATION_SIZE, LOCALIZATION_SIZE]
    return [unit.record.width, unit.record.height]


# ---------------------------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """The items to write and the units whose images they show."""

    items: list[dict]
    units: dict[str, Unit]  # image path -> unit
    skipped: int  # test units without enough eligible examples
    considered: int


def build_items(
    test_units: Sequence[Unit],
    example_units: Sequence[Unit],
    label_names: Sequence[str],
    concepts: Sequence[str],
    setting: str,
    num_examples: int,
    num_items: int,
    seed: int,
) -> Plan:
    """Up to num_items items from test units in seeded random order; a unit whose setting has
    too few eligible examples (`select_examples`) is skipped and counted."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; expected one of {', '.join(SETTINGS)}")
    if num_items < 1:
        raise ValueError(f"num_items must be positive, got {num_items}")
    if (setting == "zero_shot") != (num_examples == 0) or num_examples < 0:
        raise ValueError(
            f"setting {setting} with {num_examples} in-context examples: zero_shot takes 0, "
            "the other settings at least 1"
        )
    rng = np.random.default_rng(seed)
    pool = ExamplePool(example_units, label_names)
    items, units, skipped, considered = [], {}, 0, 0
    for index in rng.permutation(len(test_units)).tolist():
        if len(items) == num_items:
            break
        considered += 1
        test = test_units[index]
        examples = select_examples(test, pool, setting, num_examples, rng)
        if examples is None:
            skipped += 1
            continue
        questions = [make_question(u, concepts, rng) for u in (*examples, test)]
        *shots, final = questions
        for u in (*examples, test):
            units[u.image_path] = u
        items.append(_item(final, shots, setting))
    return Plan(items, units, skipped, considered)


def _item(test: Question, examples: Sequence[Question], setting: str) -> dict:
    unit, record = test.unit, test.unit.record
    size = size_bucket(float(record.areas[unit.objects[0]])) if unit.task == "grounding" else None
    return {
        "id": f"{unit.task}-{setting}-ice{len(examples)}-{record.split}-{unit.name}",
        "task": unit.task,
        "setting": setting,
        "domain": unit.domain,
        "size": size,
        "prompt": build_prompt(test, examples),
        "images": [q.unit.image_path for q in (*examples, test)],
        "options": test.options,
        "answer": test.answer,
        "category": unit.labels[0] if unit.task == "localization" else None,
        "image_size": image_size(unit),
    }


# ---------------------------------------------------------------------------------------------
# Reading TFDS and writing the files
# ---------------------------------------------------------------------------------------------


def load_builder(dataset: str, data_dir: str):
    """The built TFDS dataset "counts" or "synthetic_shifts/CONFIG" in data_dir."""
    # TensorFlow loads only when a dataset is read, so `ood-jax --help` stays quick.
    from ood_jax import datasets

    name = dataset.split("/", 1)[0]
    if name not in ("counts", "synthetic_shifts"):
        raise ValueError(f"unknown dataset {dataset!r}; expected counts or synthetic_shifts/CONFIG")
    try:
        return datasets.load(dataset, data_dir)
    except FileNotFoundError:
        raise ValueError(
            f"{dataset} is not built in {data_dir} (ood-jax build {name} --data-dir {data_dir})"
        ) from None


def read_records(builder, split: str, domains: Sequence[str] | None = None) -> list[Record]:
    """Every image of `split` that carries one of `domains` (default: every domain the split
    has), by id. An image of several domains counts as the first of them (in domain order)
    asked for."""
    from PIL import Image

    if split not in counts.SOURCE_SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {counts.SOURCE_SPLITS}")
    carried_by_some = _split_domains(builder, split)
    if not carried_by_some:
        raise ValueError(f"{builder.name} has no split {split}_<domain>")
    available = counts.ordered_domains(carried_by_some)
    asked = counts.ordered_domains(domains) if domains is not None else tuple(available)
    missing = [d for d in asked if d not in available]
    if missing:
        raise ValueError(
            f"{builder.name} has no {split} image of domain {missing[0]} "
            f"(domains of {split}: {', '.join(available)})"
        )
    names = builder.info.features["objects"]["label"].names
    records = []
    for example in _examples(builder, counts.images_with(split, asked, builder.info.splits)):
        with Image.open(io.BytesIO(example["image"])) as image:
            width, height = image.size  # the header only; pixels are decoded when drawn
        objects = example["objects"]
        carried = _domains_of(example)
        records.append(
            Record(
                split=counts.split_name(split, carried),
                image_id=int(example["image/id"]),
                domain=next(d for d in asked if d in carried),
                width=width,
                height=height,
                boxes=box_lib.yxyx_to_xyxy(np.asarray(objects["bbox"], np.float64)),
                labels=tuple(names[int(i)] for i in objects["label"]),
                areas=np.asarray(objects["area"], np.float64),
                crowd=np.asarray(objects["is_crowd"], bool),
            )
        )
    return sorted(records, key=lambda r: (r.split, r.image_id))


def _split_domains(builder, split: str) -> set[str]:
    """The domains some image of source split `split` carries."""
    parsed = (counts.parse_split_name(name) for name in builder.info.splits)
    return {d for found in parsed if found and found[0] == split for d in found[1]}


def _domains_of(example: dict) -> tuple[str, ...]:
    """An example's domains: COUNTS records list them all, synthetic ones have one."""
    indexes = example["domains"] if "domains" in example else [example["domain"]]
    return counts.ordered_domains([counts.DOMAINS[int(i)] for i in indexes])


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _examples(builder, split: str) -> Iterator[dict]:
    """The examples of a split expression, images still encoded."""
    import tensorflow_datasets as tfds

    dataset = builder.as_dataset(
        split=split, decoders={"image": tfds.decode.SkipDecoding()}, shuffle_files=False
    )
    return iteration.numpy_iterator(dataset)


def write(builder, plan: Plan, out: str | pathlib.Path) -> pathlib.Path:
    """Draws the plan's images into out/images/ and writes out/items.jsonl; returns its path.
    Every file is written beside its target and renamed into place; the same plan gives
    byte-identical files."""
    out = pathlib.Path(out)
    by_image = collections.defaultdict(list)
    for unit in plan.units.values():
        by_image[unit.record.key].append(unit)
    by_source = collections.defaultdict(set)
    for split, _ in by_image:
        by_source[split.split("_", 1)[0]].add(split)
    decoder = builder.info.features["image"]
    for source, splits in sorted(by_source.items()):
        for example in _examples(builder, "+".join(sorted(splits))):
            key = (counts.split_name(source, _domains_of(example)), int(example["image/id"]))
            units = by_image.pop(key, [])
            if units:
                # TFDS's own decoder, so the pixels are the ones any reader of the split sees.
                pixels = np.asarray(decoder.decode_example(example["image"]))
                for unit in units:
                    files.write_atomic(out / unit.image_path, _png(render(unit, pixels)))
    if by_image:
        split, image_id = next(iter(by_image))
        raise ValueError(f"{split}: image {image_id} was not found when drawing")
    lines = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in plan.items)
    path = out / ITEMS_FILE
    files.write_atomic(path, lines)
    return path


def concepts_of(label_names: Sequence[str]) -> list[str]:
    """The grounding option pool: the dataset's categories, then the domain names not among them."""
    return list(label_names) + [d for d in counts.DOMAINS if d not in label_names]
