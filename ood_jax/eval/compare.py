"""Two eval-mllm run directories scored on the same items (`ood-jax compare`): per metric each
run's score with its interval, B - A with a paired bootstrap interval, and a paired test. What is
compared per benchmark, and which items are refused or left out: docs/guide/mllm.md."""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ood_jax import stats
from ood_jax.eval import store
from ood_jax.metrics import classification
from ood_jax.eval.tasks.counts_oodg import OODG_SETTINGS
from ood_jax.eval.tasks.oodbench import OODBENCH_SPLITS

INTERVALS = {"wilson": stats.wilson, "clopper-pearson": stats.clopper_pearson}
INTERVAL_NAMES = {"wilson": "Wilson", "clopper-pearson": "Clopper-Pearson"}
DEFAULT_BOOTSTRAP = 2000
# How many differing ids an error line names before it only counts the rest.
SHOWN_IDS = 3


# ---------------------------------------------------------------------------------------------
# Run directories
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """One eval-mllm run directory: its identity (run.json) and its latest record per item."""

    directory: pathlib.Path
    predictions: pathlib.Path
    identity: dict
    records: dict[str, dict]
    torn_line: bool

    @property
    def run_file(self) -> pathlib.Path:
        return self.directory / store.RUN_FILE

    @property
    def benchmark(self) -> str:
        return self.identity["benchmark"]


# What compare reads from every record; the runner writes more.
RECORD_FIELDS = ("parsed", "correct", "error", "meta")


def _read_identity(directory: pathlib.Path) -> dict:
    path = directory / store.RUN_FILE
    identity = store.read_run_file(directory)
    if identity is None:
        raise ValueError(f"{path}: not found (eval-mllm writes it when a run starts)")
    if not isinstance(identity.get("benchmark"), str):
        raise ValueError(f"{path}: expected a JSON object with a 'benchmark' name")
    return identity


def _check_record(path: pathlib.Path, record: dict) -> None:
    for field in RECORD_FIELDS:
        if field not in record:
            raise ValueError(f"{path}: record {record['id']!r}: missing field {field!r}")
    if not isinstance(record["meta"], dict):
        raise ValueError(f"{path}: record {record['id']!r}: field 'meta' is not an object")


def load_run(directory: str | pathlib.Path) -> Run:
    """The run in `directory`; fails naming the file, record and field that cannot be read."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such run directory")
    path = directory / store.PREDICTIONS_FILE
    if not path.is_file():
        raise ValueError(f"{directory}: no {store.PREDICTIONS_FILE} (not an eval-mllm run)")
    identity = _read_identity(directory)
    # Read as a resumed run reads it (latest record per id, a torn last line ignored), but
    # never repaired: comparing must not change a run directory.
    predictions = store.PredictionStore(path, repair=False)
    if not predictions.records:
        raise ValueError(f"{path}: no predictions")
    for record in predictions.records.values():
        _check_record(path, record)
    return Run(directory, path, identity, predictions.records, predictions.torn_line_dropped)


# ---------------------------------------------------------------------------------------------
# Pairing the items
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pairing:
    """The ids compared (in A's order) and the ids one run holds and the other does not."""

    ids: list[str]
    only_a: list[str]
    only_b: list[str]


def _first(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def _id_mismatch(a: Run, b: Run, only_a: list[str], only_b: list[str], shared: int) -> str:
    parts = [
        f"{len(ids)} only in {run.directory} ({_first(ids)})"
        for run, ids in ((a, only_a), (b, only_b))
        if ids
    ]
    return (
        f"{a.directory} and {b.directory} hold different items: {len(only_a) + len(only_b)} "
        f"ids differ: {'; '.join(parts)}. --on-common compares the {shared} ids both hold"
    )


def _check_meta(a: Run, b: Run, ids: Sequence[str]) -> None:
    for item in ids:
        meta_a, meta_b = a.records[item]["meta"], b.records[item]["meta"]
        for field in meta_a.keys() & meta_b.keys():
            if meta_a[field] != meta_b[field]:
                raise ValueError(
                    f"item {item!r} has meta field {field!r} {meta_a[field]!r} in {a.predictions}"
                    f" but {meta_b[field]!r} in {b.predictions}: the runs read different data"
                )


def pair_items(a: Run, b: Run, on_common: bool = False) -> Pairing:
    """The items both runs answered, the same question in each; refuses runs that differ.

    Different id sets fail unless `on_common`; an id with another digest or meta always fails.
    """
    if a.benchmark != b.benchmark:
        raise ValueError(
            f"{a.directory} is a run of {a.benchmark} and {b.directory} one of {b.benchmark}"
        )
    only_a = [i for i in a.records if i not in b.records]
    only_b = [i for i in b.records if i not in a.records]
    shared = [i for i in a.records if i in b.records]
    if (only_a or only_b) and not on_common:
        raise ValueError(_id_mismatch(a, b, only_a, only_b, len(shared)))
    if not shared:
        raise ValueError(f"{a.directory} and {b.directory} share no item ids")
    changed = [i for i in shared if a.records[i]["digest"] != b.records[i]["digest"]]
    if changed:
        raise ValueError(
            f"{a.directory} and {b.directory} ask different questions under {len(changed)} of "
            f"the same ids (the digest of prompt and images differs): {_first(changed)}"
        )
    _check_meta(a, b, shared)
    return Pairing(shared, only_a, only_b)


# ---------------------------------------------------------------------------------------------
# Metrics: per-unit statistics and the metric of their means
# ---------------------------------------------------------------------------------------------


def _where(path: pathlib.Path, record: dict) -> str:
    return f"{path}: record {record['id']!r}"


def _verdict(record: dict, path: pathlib.Path) -> bool:
    if not isinstance(record["correct"], bool):
        raise ValueError(
            f"{_where(path, record)}: field 'correct' is {record['correct']!r}, expected "
            "true or false"
        )
    return record["correct"]


def _meta(record: dict, field: str, path: pathlib.Path) -> Any:
    if field not in record["meta"]:
        raise ValueError(f"{_where(path, record)}: meta has no field {field!r}")
    return record["meta"][field]


def _all_right(records: Sequence[dict], path: pathlib.Path) -> list[float]:
    """[1.0] when every record of the unit is right (one item; an L-Acc sample), else [0.0]."""
    return [float(all(_verdict(r, path) for r in records))]


def _confusion(records: Sequence[dict], path: pathlib.Path) -> list[float]:
    """The [tp, fp, fn, tn] indicators of one yes/no item. As in results.json, an unread
    answer counts as the wrong one."""
    (record,) = records
    truth, parsed = _meta(record, "answer", path), record["parsed"]
    if not isinstance(truth, bool) or not (parsed is None or isinstance(parsed, bool)):
        raise ValueError(
            f"{_where(path, record)}: expected a yes/no item (meta 'answer' true or false, "
            f"'parsed' true, false or null), got {truth!r} and {parsed!r}"
        )
    said_yes = (not truth) if parsed is None else parsed
    tp, fp = truth and said_yes, not truth and said_yes
    fn, tn = truth and not said_yes, not truth and not said_yes
    return [float(tp), float(fp), float(fn), float(tn)]


def _box_accuracy(records: Sequence[dict], path: pathlib.Path) -> list[float]:
    """The share of a mapping item's coloured boxes mapped to their own option."""
    (record,) = records
    answer = _meta(record, "answer", path)
    parsed = record["parsed"] or [None] * len(answer)
    if not isinstance(parsed, list) or len(parsed) != len(answer):
        raise ValueError(
            f"{_where(path, record)}: field 'parsed' is {parsed!r}, expected "
            f"{len(answer)} option indices or null"
        )
    return [float(np.mean([p == t for p, t in zip(parsed, answer)]))]


def _f1(means: np.ndarray) -> np.ndarray:
    return classification.f1_from_counts(means[..., 0], means[..., 1], means[..., 2])


def _mcc(means: np.ndarray) -> np.ndarray:
    return classification.mcc_from_counts(*(means[..., k] for k in range(4)))


def _first_statistic(means: np.ndarray) -> np.ndarray:
    return means[..., 0]


@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric as a function (`value`) of the means over units of per-unit `statistics`.

    `proportion`: the statistics are [right] per unit, so the metric is a binomial proportion
    with exact intervals and McNemar's test; otherwise intervals and test are the bootstrap's.
    """

    name: str
    statistics: Callable[[Sequence[dict], pathlib.Path], list[float]]
    value: Callable[[np.ndarray], np.ndarray]
    proportion: bool


def _accuracy(name: str) -> Metric:
    return Metric(name, _all_right, _first_statistic, proportion=True)


ACCURACY = _accuracy("accuracy")
F1 = Metric("f1", _confusion, _f1, proportion=False)
MCC = Metric("mcc", _confusion, _mcc, proportion=False)
BOX_ACCURACY = Metric("accuracy", _box_accuracy, _first_statistic, proportion=False)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the comparison: a metric over units, each unit one or more item ids."""

    group: str
    metric: Metric
    units: list[tuple[str, ...]]


# ---------------------------------------------------------------------------------------------
# What each benchmark compares
# ---------------------------------------------------------------------------------------------


def _group(run: Run, ids: Sequence[str], field: str) -> dict[Any, list[str]]:
    groups: dict[Any, list[str]] = collections.defaultdict(list)
    for item in ids:
        groups[_meta(run.records[item], field, run.predictions)].append(item)
    return groups


def _singles(ids: Sequence[str]) -> list[tuple[str, ...]]:
    return [(i,) for i in ids]


def _foci_rows(run: Run, ids: Sequence[str]) -> list[Row]:
    datasets = sorted(_group(run, ids, "dataset").items())
    if len(datasets) == 1:
        return [Row(datasets[0][0], ACCURACY, _singles(ids))]
    rows = [Row(name, ACCURACY, _singles(group)) for name, group in datasets]
    return rows + [Row("all items", ACCURACY, _singles(ids))]


def _oodbench_rows(run: Run, ids: Sequence[str]) -> list[Row]:
    splits = _group(run, ids, "split")
    return [
        Row(label, metric, _singles(splits[split]))
        for split, label in OODBENCH_SPLITS.items()
        if split in splits
        for metric in (ACCURACY, F1, MCC)
    ]


def _bap_rows(run: Run, ids: Sequence[str]) -> list[Row]:
    rows = []
    splits = _group(run, ids, "split")
    for split, label in OODBENCH_SPLITS.items():
        if split not in splits:
            continue
        levels = _group(run, splits[split], "level")
        existential, logical = set(levels.get("existential", [])), set(levels.get("logical", []))
        # An L-Acc unit is a test sample with a logical question, right when its logical and
        # counting questions all are; its existential question is not part of it.
        samples = _group(run, [i for i in splits[split] if i not in existential], "sample")
        scored = [tuple(s) for s in samples.values() if logical.intersection(s)]
        rows += [
            Row(label, _accuracy("e_acc"), _singles(levels.get("existential", []))),
            Row(label, _accuracy("c_acc"), _singles(levels.get("counting", []))),
            Row(label, _accuracy("l_acc"), scored),
            Row(label, _accuracy("bap"), _singles(splits[split])),
        ]
    return rows


def _counts_oodg_rows(run: Run, ids: Sequence[str]) -> list[Row]:
    rows = []
    tasks = _group(run, ids, "task")
    metrics = {"grounding": (ACCURACY,), "mapping": (BOX_ACCURACY, _accuracy("exact_match"))}
    for task, task_metrics in metrics.items():
        cells = collections.defaultdict(list)
        for item in tasks.get(task, []):
            record = run.records[item]
            key = (_meta(record, "setting", run.predictions), _meta(record, "ice", run.predictions))
            cells[key].append(item)
        for setting, ice in sorted(cells, key=lambda k: (OODG_SETTINGS.index(k[0]), k[1])):
            name, cell = f"{task} {setting} ICE {ice}", cells[setting, ice]
            domains = sorted(_group(run, cell, "domain").items())
            groups = [(name, cell)] + [(f"{name} {domain}", members) for domain, members in domains]
            rows += [Row(g, m, _singles(members)) for g, members in groups for m in task_metrics]
    return rows


PLANS = {
    "foci": _foci_rows,
    "oodbench": _oodbench_rows,
    "oodbench-bap": _bap_rows,
    "counts-oodg": _counts_oodg_rows,
}


def _notes(a: Run, b: Run, ids: Sequence[str]) -> list[str]:
    notes = [
        f"{run.predictions} ends in a torn line (a run killed mid-write); that item is not read"
        for run in (a, b)
        if run.torn_line
    ]
    if a.benchmark == "counts-oodg":
        localization = sum(a.records[i]["meta"].get("task") == "localization" for i in ids)
        if localization:
            notes.append(
                f"localization left out ({localization} items): its mAP scores all boxes "
                "together, with no per-item verdict to pair"
            )
    return notes


# ---------------------------------------------------------------------------------------------
# Scoring a row
# ---------------------------------------------------------------------------------------------


def _failed(run: Run, unit: tuple[str, ...]) -> bool:
    return any(run.records[i]["error"] is not None for i in unit)


def _statistics(run: Run, metric: Metric, units: Sequence[tuple[str, ...]]) -> np.ndarray:
    return np.array(
        [metric.statistics([run.records[i] for i in unit], run.predictions) for unit in units],
        dtype=np.float64,
    )


def score_row(
    row: Row, a: Run, b: Run, confidence: float, interval: str, num_bootstrap: int, seed: int
) -> dict:
    """Both runs' scores and intervals, B - A with its bootstrap interval, and the p-value, over
    the row's units that neither run failed."""
    kept = [u for u in row.units if not (_failed(a, u) or _failed(b, u))]
    out: dict[str, Any] = {
        "group": row.group,
        "metric": row.metric.name,
        "n": len(kept),
        "excluded": len(row.units) - len(kept),
    }
    if not kept:
        empty = ("a", "b", "difference", "difference_interval", "test", "p_value")
        return {**out, **dict.fromkeys(empty)}
    sa, sb = _statistics(a, row.metric, kept), _statistics(b, row.metric, kept)
    boot = stats.paired_bootstrap(row.metric.value, sa, sb, num_bootstrap, seed, confidence)
    out.update(
        a={"score": boot["a"], "interval": list(boot["a_interval"])},
        b={"score": boot["b"], "interval": list(boot["b_interval"])},
        difference=boot["difference"],
        difference_interval=list(boot["difference_interval"]),
        test="paired-bootstrap",
        p_value=boot["p_value"],
    )
    if row.metric.proportion:
        right_a, right_b = sa[:, 0] > 0, sb[:, 0] > 0
        only_a, only_b = int(np.sum(right_a & ~right_b)), int(np.sum(right_b & ~right_a))
        bounds = INTERVALS[interval]
        out["a"]["interval"] = list(bounds(int(right_a.sum()), len(kept), confidence))
        out["b"]["interval"] = list(bounds(int(right_b.sum()), len(kept), confidence))
        out.update(test="mcnemar-exact", p_value=stats.mcnemar_exact(only_a, only_b))
        out.update(only_a=only_a, only_b=only_b)
    return out


def _identity_differences(a: Run, b: Run) -> dict[str, list]:
    keys = sorted(a.identity.keys() | b.identity.keys())
    return {
        k: [a.identity.get(k), b.identity.get(k)]
        for k in keys
        if a.identity.get(k) != b.identity.get(k)
    }


def compare_runs(
    dir_a: str | pathlib.Path,
    dir_b: str | pathlib.Path,
    *,
    on_common: bool = False,
    confidence: float = 0.95,
    interval: str = "clopper-pearson",
    num_bootstrap: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
) -> dict:
    """The comparison of two run directories as JSON-ready numbers (docs/guide/mllm.md)."""
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {tuple(INTERVALS)}, got {interval!r}")
    a, b = load_run(dir_a), load_run(dir_b)
    if a.benchmark not in PLANS:
        raise ValueError(f"{a.run_file}: compare knows no benchmark {a.benchmark!r}")
    pairing = pair_items(a, b, on_common)
    rows = [
        score_row(row, a, b, confidence, interval, num_bootstrap, seed)
        for row in PLANS[a.benchmark](a, pairing.ids)
    ]
    failed = sum(_failed(a, (i,)) or _failed(b, (i,)) for i in pairing.ids)
    return {
        "benchmark": a.benchmark,
        "a": {"directory": str(a.directory), "identity": a.identity},
        "b": {"directory": str(b.directory), "identity": b.identity},
        "differs": _identity_differences(a, b),
        "items": {
            "a": len(a.records),
            "b": len(b.records),
            "compared": len(pairing.ids),
            "only_a": len(pairing.only_a),
            "only_b": len(pairing.only_b),
            "failed": failed,
        },
        "difference": "b - a",
        "confidence": confidence,
        "interval": interval,
        "num_bootstrap": num_bootstrap,
        "seed": seed,
        "rows": rows,
        "notes": _notes(a, b, pairing.ids),
    }


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _score(run: dict | None) -> str:
    if run is None:
        return "-"
    low, high = run["interval"]
    return f"{_pct(run['score'])} [{_pct(low)}, {_pct(high)}]"


def _signed(value: float | None, interval: Sequence[float] | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.2f} [{100 * interval[0]:+.2f}, {100 * interval[1]:+.2f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[k]) for r in (header, *rows)) for k in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]


def _header(result: dict) -> list[str]:
    items = result["items"]
    lines = [f"A: {result['a']['directory']}", f"B: {result['b']['directory']}"]
    differs = "; ".join(f"{k} {va!r} (A), {vb!r} (B)" for k, (va, vb) in result["differs"].items())
    lines.append(f"{result['benchmark']}; the runs differ in: {differs or 'nothing'}")
    line = f"{items['compared']} items compared"
    if items["only_a"] or items["only_b"]:
        line += (
            f" (--on-common: {items['only_a']} only in A and {items['only_b']} only in B left out)"
        )
    lines.append(f"{line}; {items['failed']} with a failed request in A or B excluded")
    lines.append(
        f"{100 * result['confidence']:g}% intervals: accuracies "
        f"{INTERVAL_NAMES[result['interval']]}; other metrics and B - A: paired bootstrap "
        f"({result['num_bootstrap']} resamples, seed {result['seed']})"
    )
    lines.append(
        "p: exact McNemar for accuracies, else paired bootstrap. Scores in %, B - A in points."
    )
    return lines


def render(result: dict) -> str:
    """The comparison as a text table under a header naming the runs and what was compared."""
    header = ["group", "metric", "n", "excl", "A", "B", "B - A", "p", "test"]
    rows = [
        [
            r["group"],
            r["metric"],
            str(r["n"]),
            str(r["excluded"]),
            _score(r["a"]),
            _score(r["b"]),
            _signed(r["difference"], r["difference_interval"]),
            "-" if r["p_value"] is None else f"{r['p_value']:.3g}",
            r["test"] or "-",
        ]
        for r in result["rows"]
    ]
    lines = _header(result) + [""] + _table(header, rows)
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)
