"""FOCI (TFDS `foci/<config>`, split `test`): four-way multiple choice, accuracy per dataset and
their mean as FOCI's Table 2. Replies are read under a parse mode (tasks/base.py PARSE_MODES):
FOCI's rule (the reply begins with the letter, Appendix A; the default, to reproduce its
numbers), strict, last, or judge.

A task of ood_jax.eval.tasks (interface in tasks/base.py); prompts from ood_jax.prompts, replies
read by ood_jax.eval.parsing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ood_jax import prompts
from ood_jax.eval.tasks.base import (
    CI_LABEL,
    INTERVALS_NOTE,
    PARSE_MODES,
    Benchmark,
    Item,
    Scoring,
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


class FociScoring(Scoring):
    """FOCI's reading of replies and its Table 2, from prediction records alone."""

    name = "foci"
    parse_modes = PARSE_MODES
    parse_mode = "foci"

    def choice_options(self, meta: dict) -> list[str]:
        return meta["options"]

    def score(self, meta: dict, reply: str) -> tuple[int | None, bool]:
        parsed = self.read_choice(meta, reply)
        return parsed, parsed == meta["answer"]

    def headline(self, records: Sequence[dict]) -> tuple[str, int, int]:
        return "accuracy", sum(bool(r["correct"]) for r in records), len(records)

    def results(self, records: Sequence[dict]) -> dict:
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
        return out

    def markdown(self, results: dict) -> str:
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
        return f"## FOCI\n\n{mode}{INTERVALS_NOTE}\n\n" + table(header, rows) + "\n"


class Foci(FociScoring, Benchmark):
    """FOCI multiple choice over the built `foci` configs (all of them, or `configs`)."""

    # FOCI generates at most 10 new tokens (its greedy decoding setup for letters).
    default_max_tokens = 10

    def __init__(self, data_dir: str, configs: Sequence[str] | None = None):
        self.configs = list(configs) if configs else built_configs(data_dir, "foci")
        self.directories = {c: dataset_dir(data_dir, "foci", c) for c in self.configs}

    def count(self) -> int:
        return sum(split_sizes(d, ["test"]) for d in self.directories.values())

    def items(self) -> Iterator[Item]:
        for config, directory in self.directories.items():
            for _, record in tfds_records(directory, ["test"]):
                filename = text(record["image/filename"])
                item_id = f"{config}/{filename}"
                options = [text(o) for o in record["options"]]
                question = prompts.foci_multiple_choice(text(record["dataset"]), options)
                meta = {
                    "dataset": config,
                    "options": options,
                    "answer": int(record["answer"]),
                    "label": text(record["label"]),
                }
                yield Item(item_id, image_request(question, record["image"], item_id), meta)
