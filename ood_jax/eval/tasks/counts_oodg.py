"""COUNTS OODG (`eval-mllm counts-oodg`, the items.jsonl of `ood-jax mine oodg`, whose format
docs/guide/mllm.md gives): Visual Grounding accuracy per domain and object size (Table 4),
Recognition and Localization mAP (Table 5) and Visual and Semantic Mapping accuracy (Table 14),
one row per (setting, number of in-context examples)."""

from __future__ import annotations

import collections
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ood_jax import prompts
from ood_jax.eval import parsing
from ood_jax.eval.tasks.base import (
    INTERVALS_NOTE,
    JUDGE_MODE,
    Benchmark,
    Item,
    ItemsError,
    Scoring,
    answer_summary,
    frac,
    frac_ci,
    group_by,
    interval,
    table,
)
from ood_jax.eval.clients import ImageInput, Request
from ood_jax.metrics import coco


OODG_TASKS = ("grounding", "localization", "mapping")
OODG_SETTINGS = ("zero_shot", "iid", "covariate_shift", "label_shift", "spurious_correlation")
OODG_SIZES = ("S", "M", "L")
_OODG_FIELDS = (
    "id",
    "task",
    "setting",
    "domain",
    "size",
    "prompt",
    "images",
    "options",
    "answer",
    "category",
    "image_size",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_oodg_record(record: Any, where: str) -> None:
    """Fails naming the first field of an items.jsonl line that breaks the schema."""
    if not isinstance(record, dict):
        raise ItemsError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in _OODG_FIELDS:
        if field not in record:
            raise ItemsError(f"{where}: missing field '{field}'")

    def bad(field: str, expected: str):
        return ItemsError(f"{where}: field '{field}' must be {expected}, got {record[field]!r}")

    if not isinstance(record["id"], str) or not record["id"]:
        raise bad("id", "a non-empty string")
    where = f"{where} (id {record['id']})"
    if record["task"] not in OODG_TASKS:
        raise bad("task", f"one of {OODG_TASKS}")
    if record["setting"] not in OODG_SETTINGS:
        raise bad("setting", f"one of {OODG_SETTINGS}")
    if not isinstance(record["domain"], str):
        raise bad("domain", "a string")
    if record["size"] is not None and record["size"] not in OODG_SIZES:
        raise bad("size", "S, M, L or null")
    if not isinstance(record["prompt"], str):
        raise bad("prompt", "a string")
    images = record["images"]
    if not isinstance(images, list) or not images or not all(isinstance(p, str) for p in images):
        raise bad("images", "a non-empty list of paths")
    placeholders = record["prompt"].count(prompts.IMAGE_PLACEHOLDER)
    if placeholders != len(images):
        raise ItemsError(
            f"{where}: the prompt has {placeholders} {prompts.IMAGE_PLACEHOLDER} placeholders "
            f"but 'images' lists {len(images)}"
        )
    size = record["image_size"]
    if not (isinstance(size, list) and len(size) == 2 and all(_is_int(v) and v > 0 for v in size)):
        raise bad("image_size", "[width, height] in pixels")
    task, options, answer = record["task"], record["options"], record["answer"]
    if task in ("grounding", "mapping"):
        if not (
            isinstance(options, list)
            and len(options) >= 2
            and all(isinstance(o, str) for o in options)
        ):
            raise bad("options", f"a list of at least two strings for {task}")
    if task == "grounding" and not (_is_int(answer) and 0 <= answer < len(options)):
        raise bad("answer", f"an option index in [0, {len(options)})")
    if task == "mapping" and not (
        isinstance(answer, list)
        and len(answer) == len(prompts.MAPPING_COLORS)
        and all(_is_int(a) and 0 <= a < len(options) for a in answer)
    ):
        raise bad(
            "answer", f"{len(prompts.MAPPING_COLORS)} option indices (blue, red, yellow, green)"
        )
    if task == "localization":
        if not isinstance(record["category"], str) or not record["category"]:
            raise bad("category", "the category named in the prompt")
        if not (
            isinstance(answer, list)
            and all(
                isinstance(b, list)
                and len(b) == 4
                and all(_is_number(v) for v in b)
                and b[2] > 0
                and b[3] > 0
                for b in answer
            )
        ):
            raise bad("answer", "a list of [x, y, w, h] boxes with positive width and height")


def read_oodg_items(path: str | pathlib.Path) -> list[dict]:
    """The validated records of an items.jsonl (schema in the module docstring)."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ItemsError(f"{path}: items file not found") from None
    records, first_line = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ItemsError(f"{where}: malformed JSON: {e.msg}") from None
        _check_oodg_record(record, where)
        if record["id"] in first_line:
            raise ItemsError(
                f"{where}: id {record['id']!r} is already used on line {first_line[record['id']]}"
            )
        first_line[record["id"]] = number
        records.append(record)
    if not records:
        raise ItemsError(f"{path}: no items")
    return records


class CountsOodgScoring(Scoring):
    """The reading of COUNTS OODG replies and its tables, from prediction records alone."""

    name = "counts-oodg"
    parse_modes = ("strict", "last", JUDGE_MODE)
    parse_mode = "strict"

    def choice_options(self, meta: dict) -> list[str] | None:
        return meta["options"] if meta["task"] == "grounding" else None

    def headline(self, records: Sequence[dict]) -> tuple[str, int, int] | None:
        grounding = [r for r in records if r["meta"]["task"] == "grounding"]
        if not grounding:
            return None
        return "grounding accuracy", sum(bool(r["correct"]) for r in grounding), len(grounding)

    def score(self, meta: dict, reply: str) -> tuple[Any, bool | None]:
        if meta["task"] == "grounding":
            parsed = self.read_choice(meta, reply)
            return parsed, parsed == meta["answer"]
        if meta["task"] == "mapping":
            parsed = parsing.parse_mapping(reply, meta["options"])
            return parsed, parsed == meta["answer"]
        # Localization has no per-item verdict: its boxes are scored together by COCO mAP.
        return parsing.parse_boxes(reply), None

    def unanswered(self, meta: dict) -> tuple[Any, bool | None]:
        return None, (None if meta["task"] == "localization" else False)

    def results(self, records: Sequence[dict]) -> dict:
        out: dict[str, list] = {}
        for task in OODG_TASKS:
            group = [r for r in records if r["meta"]["task"] == task]
            rows = collections.defaultdict(list)
            for r in group:
                rows[(r["meta"]["setting"], r["meta"]["ice"])].append(r)
            score_rows = {
                "grounding": _grounding_row,
                "localization": _localization_row,
                "mapping": _mapping_row,
            }[task]
            if rows:
                out[task] = [
                    {"setting": setting, "ice": ice, **score_rows(rows[(setting, ice)])}
                    for setting, ice in sorted(
                        rows, key=lambda k: (OODG_SETTINGS.index(k[0]), k[1])
                    )
                ]
        return out

    def markdown(self, results: dict) -> str:
        sections = []
        titles = {
            "grounding": ("Visual Grounding", "selection accuracy"),
            "localization": ("Recognition and Localization", "mAP (COCO AP@[.5:.95])"),
            "mapping": (
                "Visual and Semantic Mapping",
                "mapping accuracy (per box; no interval: a reply's four boxes are not "
                "independent), and exact match (all four boxes right)",
            ),
        }
        for task in (t for t in OODG_TASKS if t in results):
            rows = results[task]
            domains = sorted({d for row in rows for d in row["per_domain"]})
            header = ["setting", "ICE"] + [f"{d} {s}" for d in domains for s in OODG_SIZES]
            header.append("overall")
            if task == "mapping":
                header.append("exact match")
            metric = "mAP" if task == "localization" else "accuracy"
            lines = []
            for row in rows:
                cells = [
                    str(OODG_SETTINGS.index(row["setting"]) + 1) + f" ({row['setting']})",
                    str(row["ice"]),
                ]
                for d in domains:
                    for s in OODG_SIZES:
                        cell = row["per_domain"].get(d, {}).get(s)
                        if cell is None:
                            cells.append(frac(None))
                        else:
                            cells.append(frac_ci(cell[metric], cell.get(f"{metric}_ci")))
                cells.append(frac_ci(row[metric], row.get(f"{metric}_ci")))
                if task == "mapping":
                    cells.append(frac_ci(row["exact_match"], row["exact_match_ci"]))
                lines.append(cells)
            title, what = titles[task]
            sections.append(
                f"## {title}\n\n{what}; S, M, L: object size.\n\n" + table(header, lines)
            )
        mode = (
            f" Grounding replies read under parse mode {results['parse_mode']}."
            if "parse_mode" in results
            else ""
        )
        return "\n\n".join(sections) + f"\n\n{INTERVALS_NOTE}{mode}\n"


class CountsOodg(CountsOodgScoring, Benchmark):
    """COUNTS OODG items, optionally only one task, setting and number of in-context examples."""

    # Localization replies list one "Box item:" line per object.
    default_max_tokens = 512

    def __init__(
        self,
        items_path: str,
        setting: str | None = None,
        ice: int | None = None,
        task: str | None = None,
    ):
        if setting is not None and setting not in OODG_SETTINGS:
            raise ValueError(f"COUNTS OODG setting must be one of {OODG_SETTINGS}, got {setting!r}")
        if task is not None and task not in OODG_TASKS:
            raise ValueError(f"COUNTS OODG task must be one of {OODG_TASKS}, got {task!r}")
        self.path = pathlib.Path(items_path)
        self.setting, self.ice, self.task = setting, ice, task
        self.records = [
            r
            for r in read_oodg_items(self.path)
            if (setting is None or r["setting"] == setting)
            and (ice is None or len(r["images"]) - 1 == ice)
            and (task is None or r["task"] == task)
        ]
        if not self.records:
            raise ItemsError(
                f"{self.path}: no items with setting={setting}, ice={ice}, task={task}"
            )

    def count(self) -> int:
        return len(self.records)

    def max_images_per_item(self) -> int:
        return max(len(record["images"]) for record in self.records)

    def items(self) -> Iterator[Item]:
        root = self.path.parent
        for record in self.records:
            where = f"{self.path}: item {record['id']}"
            images = []
            for k, relative in enumerate(record["images"]):
                image_path = root / relative
                try:
                    data = image_path.read_bytes()
                except FileNotFoundError:
                    raise ItemsError(f"{where}: image {k} ({image_path}) not found") from None
                images.append(ImageInput.from_bytes(data, f"{where}: image {k} ({image_path})"))
            meta = {
                "task": record["task"],
                "setting": record["setting"],
                "ice": len(record["images"]) - 1,
                "domain": record["domain"],
                "size": record["size"],
                "options": record["options"],
                "answer": record["answer"],
                "category": record["category"],
                "image_size": record["image_size"],
            }
            yield Item(record["id"], Request(record["prompt"], tuple(images)), meta)


def _cell(values: Sequence, binomial: bool) -> dict:
    cell = {"accuracy": float(np.mean(values)), "count": len(values)}
    if binomial:
        cell["accuracy_ci"] = interval(int(sum(values)), len(values))
    return cell


def _per_domain_size(records: Sequence[dict], value, binomial: bool) -> dict:
    """domain -> size -> {"accuracy", "count"} (and "all" per domain) of per-record `value`;
    `binomial`: each value is one item right or wrong, so the cell has an interval too."""
    out = {}
    for domain, group in sorted(group_by(records, "domain").items()):
        cells = {}
        for size, sized in sorted(group_by(group, "size").items(), key=lambda kv: str(kv[0])):
            if size is not None:
                cells[size] = _cell([value(r) for r in sized], binomial)
        cells["all"] = _cell([value(r) for r in group], binomial)
        out[domain] = cells
    return out


def _per_size(records: Sequence[dict], value, binomial: bool) -> dict:
    return {
        size: _cell([value(r) for r in g], binomial)
        for size, g in sorted(group_by(records, "size").items(), key=lambda kv: str(kv[0]))
        if size is not None
    }


def _grounding_row(records: Sequence[dict]) -> dict:
    def correct(r):
        return bool(r["correct"])

    return {
        **answer_summary(records),
        "per_domain": _per_domain_size(records, correct, binomial=True),
        "per_size": _per_size(records, correct, binomial=True),
    }


def _mapping_row(records: Sequence[dict]) -> dict:
    def box_accuracy(r):
        parsed = r["parsed"] or [None] * len(r["meta"]["answer"])
        return float(np.mean([p == a for p, a in zip(parsed, r["meta"]["answer"])]))

    summary = answer_summary(records)
    return {
        # Per box: the share of coloured boxes mapped to their own option. No binomial
        # interval: the four boxes of one reply are not independent trials.
        "accuracy": float(np.mean([box_accuracy(r) for r in records])),
        # Per item: all four boxes right.
        "exact_match": summary["accuracy"],
        "exact_match_ci": summary["accuracy_ci"],
        "num_items": summary["num_items"],
        "generation_failures": sum(
            r["error"] is not None or any(p is None for p in r["parsed"] or [None]) for r in records
        ),
        "request_failures": summary["request_failures"],
        "per_domain": _per_domain_size(records, box_accuracy, binomial=False),
        "per_size": _per_size(records, box_accuracy, binomial=False),
    }


def localization_coco(records: Sequence[dict]) -> tuple[dict, list[dict], int]:
    """COCO ground truth and detections for localization records; also the invalid box count.

    One COCO image per item and one category per distinct category name. A predicted box has no
    confidence, so every one scores 1.0 (ties keep the reply's order, as in pycocotools). Boxes
    with a non-positive width or height cannot be evaluated; they are dropped and counted.
    """
    names = sorted({r["meta"]["category"] for r in records})
    category_id = {name: k + 1 for k, name in enumerate(names)}
    images, annotations, detections, invalid = [], [], [], 0
    for image_id, r in enumerate(records, start=1):
        width, height = r["meta"]["image_size"]
        images.append({"id": image_id, "width": width, "height": height})
        cid = category_id[r["meta"]["category"]]
        for box in r["meta"]["answer"]:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": cid,
                    "bbox": list(map(float, box)),
                    "area": float(box[2] * box[3]),
                    "iscrowd": 0,
                }
            )
        for box in r["parsed"] or []:
            if box[2] > 0 and box[3] > 0 and all(math.isfinite(v) for v in box):
                detections.append(
                    {"image_id": image_id, "category_id": cid, "bbox": list(box), "score": 1.0}
                )
            else:
                invalid += 1
    gt = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": category_id[n], "name": n} for n in names],
    }
    return gt, detections, invalid


def _localization_row(records: Sequence[dict]) -> dict:
    gt, detections, invalid = localization_coco(records)
    stats = coco.evaluate(gt, detections)
    per_domain = {}
    for domain, group in sorted(group_by(records, "domain").items()):
        domain_stats = coco.evaluate(*localization_coco(group)[:2])
        # COCO's small / medium / large areas (32^2 and 96^2 pixels) are the paper's S / M / L.
        per_domain[domain] = {
            "mAP": domain_stats["AP"],
            "S": {"mAP": domain_stats["APs"]},
            "M": {"mAP": domain_stats["APm"]},
            "L": {"mAP": domain_stats["APl"]},
            "count": len(group),
        }
    summary = answer_summary(records)
    return {
        "mAP": stats["AP"],
        "coco": stats,
        "num_items": len(records),
        "num_boxes_predicted": len(detections),
        "invalid_boxes": invalid,
        "generation_failures": sum(r["error"] is not None or not r["parsed"] for r in records),
        "request_failures": summary["request_failures"],
        "per_domain": per_domain,
    }
