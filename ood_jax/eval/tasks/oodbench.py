"""OODBench (TFDS `oodbench/default` and `oodbench/bap`): yes/no questions scored by accuracy,
precision, recall, F1 and MCC on ID, OOD-S and OOD-H, plain or chain-of-thought; BAP's E-Acc,
C-Acc, L-Acc and overall score; and circular evaluation of the yes/no questions (N = 2: each
asked with its answers the other way round, paired with its negation; docs/guide/mllm.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ood_jax import prompts
from ood_jax.eval import parsing
from ood_jax.eval.tasks import circular as circular_eval
from ood_jax.eval.tasks import corrupted
from ood_jax.eval.tasks.base import (
    CI_LABEL,
    INTERVALS_NOTE,
    Benchmark,
    Item,
    ItemsError,
    Scoring,
    answer_summary,
    dataset_dir,
    group_by,
    image_request,
    interval,
    pct,
    pct_ci,
    split_sizes,
    table,
    text,
    tfds_records,
)
from ood_jax.metrics import classification


OODBENCH_SPLITS = {"id": "ID", "ood_s": "OOD-S", "ood_h": "OOD-H"}
OODBENCH_SETTINGS = ("plain", "cot")
# A yes/no question's options in the order the paper's prompts list them.
YES_NO = ("yes", "no")


def _category_text(name: str) -> str:
    # As the OODBench builder words its questions: LVIS joins words with underscores.
    return name.replace("_", " ")


def yes_no_results(records: Sequence[dict]) -> dict:
    """Per split: binary_report of the yes/no answers (a missing or unread answer counts as
    the wrong one) with the accuracy's interval, plus how many were unanswered and how many
    requests failed."""
    splits = {}
    for split, group in group_by(records, "split").items():
        truth = np.array([r["meta"]["answer"] for r in group], bool)
        # A missing or unread answer counts as the wrong one.
        predicted = np.array(
            [r["parsed"] if r["parsed"] is not None else not r["meta"]["answer"] for r in group],
            bool,
        )
        report = classification.binary_report(truth, predicted)
        report["accuracy_ci"] = interval(int(np.sum(truth == predicted)), len(group))
        summary = answer_summary(group)
        report["unanswered"] = summary["generation_failures"]
        report["request_failures"] = summary["request_failures"]
        splits[split] = report
    return {"splits": {s: splits[s] for s in OODBENCH_SPLITS if s in splits}}


def bap_results(records: Sequence[dict]) -> dict:
    """Per split: E-Acc over existential questions, C-Acc over counting questions, L-Acc over
    test samples with a logical question, and the overall C / N, each with its interval."""
    splits = {}
    for split, group in group_by(records, "split").items():
        by_level = group_by(group, "level")
        # L-Acc scores a test sample (an image and its two categories): a point when its
        # logical question and both of its counting questions are answered correctly.
        samples = group_by(group, "sample")
        logical_samples = [
            s for s in samples.values() if any(r["meta"]["level"] == "logical" for r in s)
        ]
        logical_points = [
            all(r["correct"] for r in s if r["meta"]["level"] != "existential")
            for s in logical_samples
        ]

        def rate(name: str, points: Sequence[bool]) -> dict:
            k, n = sum(points), len(points)
            return {name: k / n if n else float("nan"), f"{name}_ci": interval(k, n)}

        splits[split] = {
            **rate("e_acc", [bool(r["correct"]) for r in by_level.get("existential", [])]),
            **rate("c_acc", [bool(r["correct"]) for r in by_level.get("counting", [])]),
            **rate("l_acc", logical_points),
            # The paper's overall BAP metric: C / N over every question.
            **rate("bap", [bool(r["correct"]) for r in group]),
            "existential_questions": len(by_level.get("existential", [])),
            "counting_questions": len(by_level.get("counting", [])),
            "logical_samples": len(logical_samples),
            "questions": len(group),
            "unanswered": answer_summary(group)["generation_failures"],
        }
    return {"splits": {s: splits[s] for s in OODBENCH_SPLITS if s in splits}}


def _instance_of(record: dict) -> tuple:
    # A question and its negation ask about the same category in the same image (and, in a
    # corrupted run, under the same corruption: tasks/corrupted.py).
    meta = record["meta"]
    variant = meta.get(corrupted.CORRUPTION), meta.get(corrupted.SEVERITY)
    return meta["split"], meta["image_id"], meta["category"], *variant


def _listed_at(record: dict, verdict: bool) -> int:
    order = circular_eval.rotate(YES_NO, record["meta"]["rotation"])
    return order.index("yes" if verdict else "no")


def _yes_rates(records: Sequence[dict]) -> dict:
    """Over the replies read: the share saying yes, the share whose answer is yes, and the
    difference (the yes-bias; positive: "yes" said more often than it is right)."""
    read = [r for r in records if r["parsed"] is not None]

    def share(values: Sequence[bool]) -> float:
        return sum(values) / len(values) if values else float("nan")

    said = share([bool(r["parsed"]) for r in read])
    truth = share([bool(r["meta"]["answer"]) for r in read])
    return {"yes_rate": said, "answer_yes_rate": truth, "yes_bias": said - truth}


def circular_yes_no_results(records: Sequence[dict], rotations: int) -> dict:
    """Per split: `questions` (right in both answer orders), `instances` (the question and its
    negation right in every order; tasks/circular.py all_right each), the yes-rates and the
    share picking the first- and second-listed answer."""
    splits = {}
    for split, group in group_by(records, "split").items():
        splits[split] = {
            "questions": circular_eval.all_right(group, rotations, circular_eval.question_of),
            "instances": circular_eval.all_right(group, 2 * rotations, _instance_of),
            **_yes_rates(group),
            "positions": circular_eval.pick_rates(group, ("first", "second"), _listed_at),
        }
    return {
        "rotations": rotations,
        "splits": {s: splits[s] for s in OODBENCH_SPLITS if s in splits},
    }


def circular_yes_no_markdown(summary: dict) -> str:
    """The circular section of results.md: the consistency table, then the biases."""
    splits = summary["splits"].items()
    rows = [
        [
            OODBENCH_SPLITS[s],
            *circular_eval.rate_cells(r["questions"]),
            *circular_eval.rate_cells(r["instances"]),
            str(r["questions"]["groups"]),
            str(r["instances"]["groups"]),
        ]
        for s, r in splits
    ]
    header = [
        "split",
        "question, original order",
        "question, both orders",
        "with its negation, original order",
        "with its negation, both orders",
        "questions",
        "instances",
    ]
    biases = [
        [
            OODBENCH_SPLITS[s],
            pct(r["yes_rate"]),
            pct(r["answer_yes_rate"]),
            _points(r["yes_bias"]),
            *circular_eval.shares_cells(r["positions"]["picked"]),
            str(r["positions"]["read"]),
        ]
        for s, r in splits
    ]
    bias_header = ["split", "said yes", "answer is yes", "yes-bias (points)"]
    bias_header += ["picked the first-listed", "picked the second-listed", "replies read"]
    incomplete = sum(r["instances"]["incomplete"] for _, r in summary["splits"].items())
    left_out = (
        "instances without their four items (cut by --limit, or the data lacks a question's "
        "negation)"
    )
    return (
        "### Circular evaluation (both answer orders, and the negated question)\n\n"
        'Every question was asked with its answers listed "yes" first (the original order) and '
        '"no" first (the table above counts each as an item), and is paired with its negation, '
        "the swapped question whose right answer is the other one. In % of the questions or "
        f"instances (an image and a category) right throughout; brackets: exact {CI_LABEL}s."
        + circular_eval.incomplete_note(incomplete, left_out)
        + "\n\n"
        + table(header, rows)
        + "\n\nBiases, in % of the replies read (both orders):\n\n"
        + table(bias_header, biases)
        + "\n"
    )


def _points(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}"


class OodBenchScoring(corrupted.ByCorruption):
    """OODBench's reading of yes/no replies (the leading word, or with `setting="cot"` the
    verdict at the end) and its main table, from prediction records alone (and per corruption
    for a corrupted run: tasks/corrupted.py)."""

    name = "oodbench"
    # Under corruption: F1 per split, the paper's headline metric; corruptions.json holds ID's,
    # where the corruption is the only shift (as a detector's holds its in-domain split's),
    # corruptions/{ood_s,ood_h}.json the shifted splits'.
    corruption_metric = "F1"
    corruption_headline = "id"
    # The answer orders each question is asked in (tasks/circular.py); None: a plain run.
    circular: int | None = None

    def __init__(self, setting: str = "plain", circular: int | None = None):
        if setting not in OODBENCH_SETTINGS:
            raise ValueError(
                f"OODBench setting must be one of {OODBENCH_SETTINGS}, got {setting!r}"
            )
        circular_eval.check_rotations(circular, len(YES_NO), self.name)
        self.setting, self.circular = setting, circular

    def identity(self) -> dict:
        # "circular" is absent for a plain run, so directories written before it still match.
        circular = {"circular": self.circular} if self.circular else {}
        return {"benchmark": self.name, "setting": self.setting, **circular}

    def score(self, meta: dict, reply: str) -> tuple[bool | None, bool]:
        read = parsing.parse_final_yes_no if self.setting == "cot" else parsing.parse_yes_no
        parsed = read(reply)
        return parsed, parsed is not None and parsed == meta["answer"]

    def corruption_scores(self, results: dict) -> dict[str, tuple[float, list | None]]:
        # F1 is no proportion of items: it has no binomial interval.
        return {split: (r["f1"], None) for split, r in results["splits"].items()}

    def plain_results(self, records: Sequence[dict]) -> dict:
        out = {"setting": self.setting, **yes_no_results(records)}
        if self.circular:
            out["circular_eval"] = circular_yes_no_results(records, self.circular)
        return out

    def plain_markdown(self, results: dict) -> str:
        rows = [
            [
                OODBENCH_SPLITS[s],
                pct_ci(r["accuracy"], r["accuracy_ci"]),
                *(pct(r[k]) for k in ("precision", "recall", "f1")),
                f"{100 * r['mcc']:.2f}",
                str(r["support"]),
                str(r["unanswered"]),
            ]
            for s, r in results["splits"].items()
        ]
        header = ["split", f"Acc [{CI_LABEL}]", "Precision", "Recall", "F1", "MCC", "questions"]
        header.append("unanswered")
        title = "## OODBench" + (" (CoT)" if results["setting"] == "cot" else "")
        out = f"{title}\n\nAll numbers in %. {INTERVALS_NOTE}\n\n" + table(header, rows) + "\n"
        if "circular_eval" in results:
            out += "\n" + circular_yes_no_markdown(results["circular_eval"])
        return out


class OodBench(OodBenchScoring, Benchmark):
    """OODBench's yes/no questions; `setting="cot"` asks them with the paper's CoT wording."""

    def __init__(
        self,
        data_dir: str,
        config: str = "default",
        setting: str = "plain",
        circular: int | None = None,
    ):
        super().__init__(setting, circular)
        self.directory = dataset_dir(data_dir, "oodbench", config)

    @property
    def default_max_tokens(self) -> int:
        # Step-by-step answers need room before the verdict.
        return 512 if self.setting == "cot" else 16

    def count(self) -> int:
        questions = split_sizes(self.directory, list(OODBENCH_SPLITS))
        return questions * circular_eval.asked_per_question(self.circular)

    def items(self) -> Iterator[Item]:
        for split, record in tfds_records(self.directory, list(OODBENCH_SPLITS)):
            yield from self.record_items(split, record)

    def record_items(
        self, split: str, record: dict, id_prefix: str = "", tags: dict | None = None
    ) -> Iterator[Item]:
        """The items a record of `split` is asked as; `id_prefix` and `tags` mark a corrupted
        copy's items (tasks/corrupted.py)."""
        category, kind = text(record["category"]), text(record["kind"])
        image_id = int(record["image/id"])
        if self.setting == "cot":
            question = prompts.oodbench_question(
                _category_text(category),
                negated=kind.startswith("negated"),
                chain_of_thought=True,
            )
        else:
            question = text(record["question"])
        item_id = f"{id_prefix}{split}/{image_id}/{category}/{kind}"
        meta = {
            "split": split,
            "answer": bool(record["answer"]),
            "category": category,
            "kind": kind,
            "image_id": image_id,
            **(tags or {}),
        }
        yield from self.asked(item_id, question, meta, record["image"])

    def asked(self, item_id: str, question: str, meta: dict, image: bytes) -> Iterator[Item]:
        """The items question `item_id` is asked as: itself, or in each order of its answers."""
        for rotation in circular_eval.rotations(item_id, self.circular, len(YES_NO)):
            prompt = question
            if rotation.shift:
                try:
                    prompt = prompts.oodbench_answers_swapped(question)
                except ValueError as e:
                    raise ItemsError(f"{self.directory}: item {item_id!r}: {e}") from None
            tagged = {**meta, **rotation.tags}
            yield Item(rotation.id, image_request(prompt, image, rotation.id), tagged)


class CorruptedOodBench(corrupted.CorruptedItems, OodBench):
    """OODBench's yes/no questions over a corrupted copy of its ID, OOD-S and OOD-H splits
    (`--corrupted corrupted/NAME`; tasks/corrupted.py)."""

    def __init__(
        self, data_dir: str, dataset: str, setting: str = "plain", circular: int | None = None
    ):
        OodBenchScoring.__init__(self, setting, circular)
        self.build = corrupted.read_build(data_dir, dataset, self.name, list(OODBENCH_SPLITS))
        if self.build.source == "oodbench/bap":
            raise ItemsError(
                f"--corrupted {dataset}: built from oodbench/bap, not yes/no questions"
            )
        self.directory = self.build.directory

    def variant_items(
        self, source: str, record: dict, id_prefix: str, tags: dict
    ) -> Iterator[Item]:
        return self.record_items(source, record, id_prefix, tags)


class OodBenchBapScoring(Scoring):
    """The reading of BAP replies (counts, yes/no) and its table, from prediction records."""

    name = "oodbench-bap"

    def score(self, meta: dict, reply: str) -> tuple[Any, bool]:
        if meta["level"] == "counting":
            parsed = parsing.parse_count(reply)
            return parsed, parsed is not None and parsed == int(meta["answer"])
        parsed = parsing.parse_yes_no(reply)
        return parsed, parsed is not None and parsed == (meta["answer"] == "yes")

    def results(self, records: Sequence[dict]) -> dict:
        return bap_results(records)

    def markdown(self, results: dict) -> str:
        rows = [
            [
                OODBENCH_SPLITS[s],
                *(pct_ci(r[k], r[f"{k}_ci"]) for k in ("e_acc", "c_acc", "l_acc", "bap")),
                str(r["questions"]),
                str(r["unanswered"]),
            ]
            for s, r in results["splits"].items()
        ]
        header = ["split", "E-Acc", "C-Acc", "L-Acc", "BAP (C/N)", "questions", "unanswered"]
        return (
            f"## OODBench BAP\n\nAll numbers in %. {INTERVALS_NOTE}\n\n"
            + table(header, rows)
            + "\n"
        )


class OodBenchBap(OodBenchBapScoring, Benchmark):
    """OODBench's Basic-to-Advanced Progression questions (TFDS config `bap`)."""

    default_max_tokens = 32

    def __init__(self, data_dir: str, config: str = "bap"):
        self.directory = dataset_dir(data_dir, "oodbench", config)

    def count(self) -> int:
        return split_sizes(self.directory, list(OODBENCH_SPLITS))

    def items(self) -> Iterator[Item]:
        for split, record in tfds_records(self.directory, list(OODBENCH_SPLITS)):
            level = prompts.BAP_LEVELS[int(record["level"])]
            categories = [text(c) for c in record["categories"]]
            image_id = int(record["image/id"])
            item_id = f"{split}/{image_id}/{level}/{'/'.join(categories)}"
            meta = {
                "split": split,
                "level": level,
                "answer": text(record["answer"]),
                "categories": categories,
                "sample": f"{split}/{image_id}",
            }
            question = text(record["question"])
            yield Item(item_id, image_request(question, record["image"], item_id), meta)
