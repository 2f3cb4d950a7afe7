"""A task over a corrupted dataset (`eval-mllm foci|oodbench --corrupted corrupted/NAME`): the
benchmark's items clean and under each corruption and severity, asked and scored as the task
asks and scores them, with its numbers per corruption and mPC/rPC (`write_robustness`). The
items' ids and the results' "corruptions": docs/guide/mllm.md, "Corrupted datasets"."""

from __future__ import annotations

import abc
import collections
import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence

from ood_jax.data import building
from ood_jax.data import corrupted as naming
from ood_jax.data import corruptions
from ood_jax.eval.tasks import circular as circular_eval
from ood_jax.eval.tasks.base import (
    Benchmark,
    Item,
    ItemsError,
    Scoring,
    dataset_dir,
    frac,
    pct_ci,
    split_sizes,
    table,
    tfds_records,
)
from ood_jax.metrics import robustness

# The TFDS name `ood-jax build corrupted` writes under.
DATASET = "corrupted"
# The meta keys of an item of a corrupted run.
CORRUPTION, SEVERITY = "corruption", "severity"
CLEAN = naming.CLEAN


@dataclasses.dataclass(frozen=True)
class Build:
    """A built corrupted dataset: its name ("corrupted/CONFIG"), directory, source dataset
    ("foci/food101") and the (TFDS split, what it holds) the task asks, in item order."""

    name: str
    directory: pathlib.Path
    source: str
    splits: tuple[tuple[str, naming.Split], ...]


def _order(split: naming.Split) -> tuple:
    # Clean first, then ImageNet-C's order of corruptions, severities ascending.
    if split.corruption is None:
        return (-1, 0)
    return corruptions.NAMES.index(split.corruption), split.severity


def read_build(data_dir: str, name: str, task: str, asked: Sequence[str]) -> Build:
    """The corrupted dataset `name` built from a `task` dataset, with the splits of `asked`;
    ItemsError naming what is wrong and the fix otherwise."""
    prefix, _, config = name.partition("/")
    if prefix != DATASET or not config:
        raise ItemsError(
            f"--corrupted {name!r}: expected corrupted/NAME (`ood-jax build corrupted`)"
        )
    directory = dataset_dir(data_dir, DATASET, config)
    record = building.BuildRecord.read(directory)
    source = (record.settings or {}).get("dataset") if record else None
    if source is None or source.partition("/")[0] != task:
        raise ItemsError(
            f"--corrupted {name}: built from {source or 'an unrecorded dataset'}, not from a "
            f"{task} dataset; build one with `ood-jax build corrupted --dataset {task}/CONFIG ...`"
        )
    info = json.loads((directory / "dataset_info.json").read_text())
    held = {s["name"]: naming.parse_split_name(s["name"]) for s in info.get("splits", ())}
    splits = {n: s for n, s in held.items() if s is not None and s.source in asked}
    missing = sorted(set(asked) - {s.source for s in splits.values()})
    if missing:
        raise ItemsError(
            f"--corrupted {name}: holds no copy of {source}'s split {', '.join(missing)}; build "
            f"it without --splits, or with --splits {','.join(asked)}"
        )
    ordered = sorted(splits.items(), key=lambda kv: (_order(kv[1]), asked.index(kv[1].source)))
    return Build(name, directory, source, tuple(ordered))


def variant(split: naming.Split) -> str:
    """What an item id is prefixed with: "clean", or e.g. "fog_3"."""
    return CLEAN if split.corruption is None else f"{split.corruption}_{split.severity}"


class CorruptedItems(Benchmark):
    """Mixin before a task's Benchmark: its items over a corrupted `build` (module docstring).
    The task's `variant_items(source split, record, id prefix, tags)` asks one record."""

    build: Build
    circular: int | None = None

    def identity(self) -> dict:
        return {**super().identity(), "corrupted": self.build.name}

    def count(self) -> int:
        questions = split_sizes(self.build.directory, [name for name, _ in self.build.splits])
        return questions * circular_eval.asked_per_question(self.circular)

    def items(self) -> Iterator[Item]:
        for name, split in self.build.splits:
            tags = {CORRUPTION: split.corruption or CLEAN, SEVERITY: split.severity}
            for _, record in tfds_records(self.build.directory, [name]):
                yield from self.variant_items(split.source, record, f"{variant(split)}/", tags)

    @abc.abstractmethod
    def variant_items(
        self, source: str, record: dict, id_prefix: str, tags: dict
    ) -> Iterator[Item]: ...


class ByCorruption(Scoring):
    """Mixin of a task's Scoring: its tables, and per corruption for a corrupted run's records
    (module docstring). The task gives `plain_results` / `plain_markdown` (its tables) and
    `corruption_scores` (the score per evaluated split that mPC and rPC are made of, with its
    interval or None), named `corruption_metric`, the `corruption_headline` split's in
    corruptions.json."""

    corruption_metric: str
    corruption_headline: str

    @abc.abstractmethod
    def plain_results(self, records: Sequence[dict]) -> dict: ...

    @abc.abstractmethod
    def plain_markdown(self, results: dict) -> str: ...

    @abc.abstractmethod
    def corruption_scores(self, results: dict) -> dict[str, tuple[float, list | None]]: ...

    def results(self, records: Sequence[dict]) -> dict:
        if not any(CORRUPTION in r["meta"] for r in records):
            return self.plain_results(records)
        groups = collections.defaultdict(list)
        for record in records:
            groups[record["meta"][CORRUPTION], record["meta"][SEVERITY]].append(record)
        clean = groups.pop((CLEAN, None), [])
        per_corruption: dict[str, dict[str, dict]] = {}
        for name, severity in sorted(groups, key=lambda k: (corruptions.NAMES.index(k[0]), k[1])):
            per_corruption.setdefault(name, {})[str(severity)] = self.plain_results(
                groups[name, severity]
            )
        clean_results = self.plain_results(clean)
        return {
            **self.plain_results(records),
            "corruptions": {
                "metric": self.corruption_metric,
                "headline": self.corruption_headline,
                "clean": clean_results,
                "per_corruption": per_corruption,
                # Every copy holds the clean split's records: one of another size was cut short.
                "robustness": self._robustness(clean_results, per_corruption)
                if clean and all(len(group) == len(clean) for group in groups.values())
                else None,
            },
        }

    def _robustness(self, clean: dict, per_corruption: dict) -> dict | None:
        """robustness.summary per evaluated split; None where some corruption lacks a severity
        another has (a --limit run): mPC averages a full grid."""
        scores = {
            name: {int(s): self.corruption_scores(r) for s, r in by_severity.items()}
            for name, by_severity in per_corruption.items()
        }
        summaries = {}
        for split, (value, _) in self.corruption_scores(clean).items():
            grid = {
                name: {s: by_split[split][0] for s, by_split in levels.items()}
                for name, levels in scores.items()
            }
            try:
                summaries[split] = robustness.summary(value, grid, self.corruption_metric)
            except ValueError:
                return None
        return summaries

    def markdown(self, results: dict) -> str:
        out = self.plain_markdown(results)
        if "corruptions" not in results:
            return out
        return out.rstrip("\n") + "\n\n" + self._corruption_markdown(results) + "\n"

    def _corruption_markdown(self, results: dict) -> str:
        section = results["corruptions"]
        clean = self.corruption_scores(section["clean"])
        metric = section["metric"]
        header = ["corruption", "severity", *(f"{split} {metric} (%)" for split in clean)]
        rows = [[CLEAN, "-", *(pct_ci(*clean[split]) for split in clean)]]
        for name, by_severity in section["per_corruption"].items():
            for severity, r in by_severity.items():
                scores = self.corruption_scores(r)
                rows.append(
                    [name, severity, *(pct_ci(*scores[s]) if s in scores else "-" for s in clean)]
                )
        summaries = section["robustness"]
        if summaries is not None:
            rows.append(["mPC", "", *(pct_ci(summaries[s]["mPC"], None) for s in clean)])
            rows.append(["rPC", "", *(frac(summaries[s]["rPC"]) for s in clean)])
            note = (
                f"mPC: the mean {metric} over every corruption and severity; rPC: mPC / the "
                f"clean {metric}. RUN/{robustness.FILE} holds split {section['headline']}'s, "
                f"RUN/{robustness.PER_SPLIT_DIR}/ each split's."
            )
        else:
            note = "No mPC or rPC: the run holds part of the corrupted items only (--limit)."
        return (
            "### Corruptions\n\nThe tables above count every item asked, clean (the source's "
            f"own images) and corrupted; here the {metric} of the clean ones and under each "
            "corruption and severity."
            f" {note}\n\n" + table(header, rows)
        )


def write_robustness(directory: str | pathlib.Path, results: dict) -> bool:
    """RUN/corruptions.json and RUN/corruptions/{split}.json from a corrupted run's results;
    False (nothing written) for a plain run or one without mPC and rPC."""
    section = results.get("corruptions")
    if section is None or section["robustness"] is None:
        return False
    robustness.write(directory, section["robustness"], section["headline"])
    return True
