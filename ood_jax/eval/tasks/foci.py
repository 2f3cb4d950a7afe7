"""FOCI (TFDS `foci/<config>`, split `test`): four-way multiple choice, accuracy per dataset and
their mean as FOCI's Table 2, the Table 3 and 7 splits' accuracies from the same run
("per_split"), and with `circular=N` MMBench's CircularEval (tasks/circular.py). What the
results hold: docs/guide/mllm.md."""

from __future__ import annotations

import collections
import pathlib
import string
from collections.abc import Iterator, Sequence

import numpy as np

from ood_jax import prompts
from ood_jax.eval.tasks import circular as circular_eval
from ood_jax.eval.tasks import corrupted
from ood_jax.eval.tasks.base import (
    CI_LABEL,
    INTERVALS_NOTE,
    PARSE_MODES,
    Benchmark,
    Item,
    answer_summary,
    built_configs,
    dataset_dir,
    group_by,
    image_request,
    pct_ci,
    split_sizes,
    table,
    text,
    tfds_records,
)


class FociScoring(corrupted.ByCorruption):
    """FOCI's reading of replies and its Table 2, from prediction records alone (and per
    corruption for a corrupted run: tasks/corrupted.py)."""

    name = "foci"
    # Under corruption: the accuracy over every item, the split asked being test.
    corruption_metric = "accuracy"
    corruption_headline = "test"
    parse_modes = PARSE_MODES
    parse_mode = "foci"
    # The rotations each item is asked under (tasks/circular.py); None: a plain run.
    circular: int | None = None

    def __init__(self, circular: int | None = None):
        circular_eval.check_rotations(circular, prompts.FOCI_NUM_OPTIONS, self.name)
        self.circular = circular

    def identity(self) -> dict:
        # Absent for a plain run, so that directories written before --circular still match.
        return {"benchmark": self.name, **({"circular": self.circular} if self.circular else {})}

    def choice_options(self, meta: dict) -> list[str]:
        return meta["options"]

    def score(self, meta: dict, reply: str) -> tuple[int | None, bool]:
        parsed = self.read_choice(meta, reply)
        return parsed, parsed == meta["answer"]

    def headline(self, records: Sequence[dict]) -> tuple[str, int, int]:
        return "accuracy", sum(bool(r["correct"]) for r in records), len(records)

    def corruption_scores(self, results: dict) -> dict[str, tuple[float, list | None]]:
        return {"test": (results["accuracy"], results["accuracy_ci"])}

    def plain_results(self, records: Sequence[dict]) -> dict:
        out = answer_summary(records)
        per_dataset = {
            k: answer_summary(v) for k, v in sorted(group_by(records, "dataset").items())
        }
        out["datasets"] = list(per_dataset)
        if len(per_dataset) > 1:
            out["per_dataset"] = per_dataset
            # Table 2's average column: the mean of the per-dataset accuracies. It has no
            # binomial interval: it is no proportion of items.
            out["average_accuracy"] = float(np.mean([v["accuracy"] for v in per_dataset.values()]))
        out.update(split_results(records))
        if self.circular:
            out["circular_eval"] = self.circular_results(records)
        return out

    def circular_results(self, records: Sequence[dict]) -> dict:
        """Per dataset and over all items: all_right (tasks/circular.py) over the items and the
        share of read replies picking each letter."""

        def summary(group: Sequence[dict]) -> dict:
            return {
                **circular_eval.all_right(group, self.circular, circular_eval.question_of),
                "positions": circular_eval.pick_rates(group, LETTERS, _listed_at),
            }

        return {
            "rotations": self.circular,
            "per_dataset": {k: summary(v) for k, v in sorted(group_by(records, "dataset").items())},
            "all_items": summary(records),
        }

    def plain_markdown(self, results: dict) -> str:
        per_dataset = results.get("per_dataset", {})
        rows = [
            [
                name,
                pct_ci(r["accuracy"], r["accuracy_ci"]),
                str(r["num_items"]),
                str(r["generation_failures"]),
            ]
            for name, r in per_dataset.items()
        ]
        if per_dataset:
            rows.append(
                ["average (per-dataset mean)", pct_ci(results["average_accuracy"], None), "", ""]
            )
        rows.append(
            [
                "all items" if per_dataset else ", ".join(results["datasets"]),
                pct_ci(results["accuracy"], results["accuracy_ci"]),
                str(results["num_items"]),
                str(results["generation_failures"]),
            ]
        )
        header = ["dataset", f"accuracy (%) [{CI_LABEL}]", "items", "generation failures"]
        mode = (
            f"Replies read under parse mode {results['parse_mode']}. "
            if "parse_mode" in results
            else ""
        )
        out = f"## FOCI\n\n{mode}{INTERVALS_NOTE}\n\n" + table(header, rows) + "\n"
        if "per_split" in results:
            out += "\n" + split_markdown(results)
        if "circular_eval" in results:
            out += "\n" + circular_markdown(results["circular_eval"])
        return out


# Meta key of the split besides test an item's record is also in.
SPLIT = "split"


def split_results(records: Sequence[dict]) -> dict:
    """The results by split: "per_split", config -> split -> answer_summary of the items tagged
    with that split, and "without_split", config -> how many of its items carry no tag although
    others do (recorded before items were tagged); both absent when no item is tagged."""
    tagged, untagged = [], collections.Counter()
    for record in records:
        if SPLIT in record["meta"]:
            tagged.append(record)
        else:
            untagged[record["meta"]["dataset"]] += 1
    per_split = {
        config: {split: answer_summary(v) for split, v in sorted(group_by(group, SPLIT).items())}
        for config, group in sorted(group_by(tagged, "dataset").items())
    }
    without = {config: untagged[config] for config in per_split if untagged[config]}
    return {
        **({"per_split": per_split} if per_split else {}),
        **({"without_split": without} if without else {}),
    }


def split_markdown(results: dict) -> str:
    """Tables 3 and 7: per config with splits, each split's accuracy, then all of its items."""
    rows = []
    for config, splits in results["per_split"].items():
        overall = results.get("per_dataset", {}).get(config, results)
        for name, r in [*splits.items(), ("all items", overall)]:
            cells = [pct_ci(r["accuracy"], r["accuracy_ci"]), str(r["num_items"])]
            rows.append([config, name, *cells, str(r["generation_failures"])])
    header = ["dataset", "split", f"accuracy (%) [{CI_LABEL}]", "items", "generation failures"]
    missing = "".join(
        f" {n} items of {config} were recorded without their split and are in none of them."
        for config, n in results.get("without_split", {}).items()
    )
    return (
        "### Per split (FOCI Tables 3 and 7)\n\nThe items of split test again, by the other "
        "split their record is in: ImageNet-1k's class halves (train_half: the even class "
        "indexes, which FOCI trained on; test_half: the others) and GeoDE's regions."
        f"{missing}\n\n" + table(header, rows) + "\n"
    )


LETTERS = tuple(string.ascii_uppercase[: prompts.FOCI_NUM_OPTIONS])


def _listed_at(record: dict, choice: int) -> int:
    # A FOCI choice is the index of the option in the prompt's listing: its position.
    return choice


def _picks_row(name: str, positions: dict, which: str = "picked") -> list[str]:
    return [name, *circular_eval.shares_cells(positions[which]), str(positions["read"])]


def circular_markdown(summary: dict) -> str:
    """The circular section of results.md: accuracies, then the letters picked."""
    n, overall = summary["rotations"], summary["all_items"]
    groups = {**summary["per_dataset"]}
    if len(groups) > 1:
        groups["all items"] = overall
    rows = [[name, *circular_eval.rate_cells(s), str(s["groups"])] for name, s in groups.items()]
    header = [
        "dataset",
        f"original order (%) [{CI_LABEL}]",
        f"all {n} rotations right (%) [{CI_LABEL}]",
        "items",
    ]
    picks = [_picks_row(f"picked, {name}", s["positions"]) for name, s in groups.items()]
    picks.append(_picks_row("the answer, all items", overall["positions"], "answer"))
    return (
        f"### Circular evaluation ({n} rotations)\n\n"
        f"Every item was asked under {n} cyclic shifts of its options (the table above counts "
        "each as an item); here it counts as right only when every rotation is (MMBench's "
        f"CircularEval). Brackets: exact {CI_LABEL}s over the items."
        + circular_eval.incomplete_note(
            overall["incomplete"], "items not asked under every rotation (cut by --limit)"
        )
        + "\n\n"
        + table(header, rows)
        + "\n\nLetters picked, in % of the replies read (every rotation), and where the "
        "answer was listed:\n\n" + table(["", *LETTERS, "replies read"], picks) + "\n"
    )


def other_splits(directory: pathlib.Path) -> dict[str, str]:
    """image/filename -> the split besides test whose records repeat it (ImageNet-1k's halves,
    GeoDE's regions); empty for a build with test alone."""
    import tensorflow_datasets as tfds

    names = [s for s in tfds.builder_from_directory(str(directory)).info.splits if s != "test"]
    return {text(r["image/filename"]): split for split, r in tfds_records(directory, names)}


class Foci(FociScoring, Benchmark):
    """FOCI multiple choice over the built `foci` configs (all of them, or `configs`)."""

    # FOCI generates at most 10 new tokens (its greedy decoding setup for letters).
    default_max_tokens = 10

    def __init__(
        self, data_dir: str, configs: Sequence[str] | None = None, circular: int | None = None
    ):
        super().__init__(circular)
        self.configs = list(configs) if configs else built_configs(data_dir, "foci")
        self.directories = {c: dataset_dir(data_dir, "foci", c) for c in self.configs}

    def count(self) -> int:
        questions = sum(split_sizes(d, ["test"]) for d in self.directories.values())
        return questions * circular_eval.asked_per_question(self.circular)

    def items(self) -> Iterator[Item]:
        for config, directory in self.directories.items():
            splits = other_splits(directory)
            for _, record in tfds_records(directory, ["test"]):
                yield from self.record_items(config, record, splits)

    def record_items(
        self,
        config: str,
        record: dict,
        splits: dict[str, str],
        id_prefix: str = "",
        tags: dict | None = None,
    ) -> Iterator[Item]:
        """The items a test record of `config` is asked as; `splits`: other_splits' tags;
        `id_prefix` and `tags` mark a corrupted copy's items (tasks/corrupted.py)."""
        filename = text(record["image/filename"])
        meta = {
            "dataset": config,
            "options": [text(o) for o in record["options"]],
            "answer": int(record["answer"]),
            "label": text(record["label"]),
            **({SPLIT: splits[filename]} if filename in splits else {}),
            **(tags or {}),
        }
        yield from self.asked(
            f"{id_prefix}{config}/{filename}", text(record["dataset"]), meta, record["image"]
        )

    def asked(self, item_id: str, dataset: str, meta: dict, image: bytes) -> Iterator[Item]:
        """The items question `item_id` is asked as: itself, or each rotation of its options.
        `dataset` picks the prompt's question line; `image` is the encoded image."""
        for rotation in circular_eval.rotations(item_id, self.circular, len(meta["options"])):
            options = rotation.apply(meta["options"])
            rotated = {
                **meta,
                "options": options,
                "answer": rotation.position(meta["answer"]),
                **rotation.tags,
            }
            question = prompts.foci_multiple_choice(dataset, options)
            yield Item(rotation.id, image_request(question, image, rotation.id), rotated)


class CorruptedFoci(corrupted.CorruptedItems, Foci):
    """FOCI over a corrupted copy of one foci config (`--corrupted corrupted/NAME`): its test
    records clean and under each corruption and severity (tasks/corrupted.py). Items are not
    tagged with the source's other splits (ImageNet-1k's halves, GeoDE's regions)."""

    def __init__(self, data_dir: str, dataset: str, circular: int | None = None):
        FociScoring.__init__(self, circular)
        self.build = corrupted.read_build(data_dir, dataset, self.name, ["test"])
        self.directory = self.build.directory
        self.config = self.build.source.partition("/")[2]

    def variant_items(
        self, source: str, record: dict, id_prefix: str, tags: dict
    ) -> Iterator[Item]:
        return self.record_items(self.config, record, {}, id_prefix, tags)
