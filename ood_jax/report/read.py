"""Run directories -> `runs.Run` records: what each writer leaves, and what the report takes.

A run directory is a detector workdir (`ood-jax train` / `evaluate`), an eval-mllm output (an
MLLM or the CLIP baseline) or any directory holding a corruptions.json. Each gives its scores
per domain and, where a benchmark defines an in-domain / held-out pair, the pairs the
effective-robustness fit plots; mining outputs hold no scores and are not runs. The files and
pairs read: docs/guide/report.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ood_jax import manifest
from ood_jax.report.runs import Bars, Corruptions, Pair, Run, RunError, Score, Shift

RESULTS_FILE = "results.json"
CORRUPTIONS_FILE = "corruptions.json"
EXPECTED = (
    "expected results.json from `ood-jax train` / `evaluate` (a detector workdir) or `ood-jax "
    f"eval-mllm` (an MLLM or CLIP run), or a {CORRUPTIONS_FILE}"
)

CORRUPTION_METRICS = ("AP", "accuracy", "F1")
SEVERITIES = (1, 2, 3, 4, 5)
# How far corruptions.json's mPC and rPC may be from what its scores give before the page says
# so: the rounding of a writer that keeps three decimals.
CONSISTENCY_TOLERANCE = 5e-4

# ImageNet-1k against ImageNet-A, -R and -Sketch: the shifts of effective robustness' papers.
# FOCI's other datasets are different tasks, not shifts of one another: no pair.
FOCI_IN_DOMAIN = "imagenet_1k"
FOCI_SHIFTS = {
    "imagenet_a": "ImageNet-A",
    "imagenet_r": "ImageNet-R",
    "imagenet_sketch": "ImageNet-Sketch",
}
OODBENCH_SPLITS = {"id": "ID", "ood_s": "OOD-S", "ood_h": "OOD-H"}
# COUNTS OODG moves the shift into the in-context examples: the pair is a task's score with
# examples from the test's domain against a shifted setting, at the same number of examples.
OODG_IN_DOMAIN = "iid"
OODG_SHIFTED = ("covariate_shift", "label_shift", "spurious_correlation")
OODG_METRICS = {"grounding": "accuracy", "mapping": "accuracy", "localization": "mAP"}
# eval-mllm's client identities; every other client is a language model.
SCORER_CLIENTS = ("clip",)


def read_runs(paths: Sequence[str | os.PathLike]) -> list[Run]:
    """The runs in `paths`, each named by its directory's name, or by the path as given where
    two directories share a name."""
    paths = [pathlib.Path(p) for p in paths]
    names = [p.resolve().name for p in paths]
    shared = {n for n in names if names.count(n) > 1}
    return [read_run(p, str(p) if n in shared else n) for p, n in zip(paths, names)]


def read_run(path: str | os.PathLike, name: str | None = None) -> Run:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise RunError(f"{path}: not a directory; {EXPECTED}")
    name = name or path.resolve().name
    results = _read_json(path / RESULTS_FILE)
    corruptions = _read_json(path / CORRUPTIONS_FILE)
    if results is None and corruptions is None:
        raise RunError(f"{path}: not a run directory ood-jax report knows; {EXPECTED}")
    if results is None:
        notes = ("corruptions.json only: no in-domain or held-out score",)
        run = Run(name, path, None, "corruptions.json only", None, notes=notes)
    else:
        run = _guarded(path / RESULTS_FILE, lambda: _from_results(name, path, results))
    if corruptions is None:
        return run
    curves = _guarded(path / CORRUPTIONS_FILE, lambda: _corruptions(corruptions))
    return dataclasses.replace(run, corruptions=curves, notes=run.notes + _consistency(curves))


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: not JSON ({e})") from None


class _FieldError(Exception):
    """A field of a file that breaks its format; `_guarded` names the file."""


def _guarded(where: pathlib.Path, read: Callable[[], Any]) -> Any:
    """`read()`, a bad, missing or mistyped field turned into one line naming the file."""
    try:
        return read()
    except _FieldError as e:
        raise RunError(f"{where}: {e}") from None
    except KeyError as e:
        raise RunError(f"{where}: not the format ood-jax writes: field {e} is missing") from None
    except (IndexError, TypeError, AttributeError) as e:
        raise RunError(
            f"{where}: not the format ood-jax writes: a field of the wrong type ({e})"
        ) from None


def _from_results(name: str, path: pathlib.Path, results: Mapping[str, Any]) -> Run:
    if not isinstance(results, dict):
        raise RunError(f"{path / RESULTS_FILE}: not a JSON object; {EXPECTED}")
    if "iid" in results and "per_domain" in results:
        return _detector(name, path, results)
    readers = {
        "foci": _foci,
        "oodbench": _oodbench,
        "oodbench-bap": _oodbench_bap,
        "counts-oodg": _counts_oodg,
    }
    benchmark = results.get("benchmark")
    if benchmark not in readers:
        raise RunError(
            f"{path / RESULTS_FILE}: neither a detector's results (no 'iid' and 'per_domain') "
            f"nor an eval-mllm run of {', '.join(readers)} (benchmark {benchmark!r}); {EXPECTED}"
        )
    title, pairs, bars, notes = readers[benchmark](results)
    if not results["complete"]:
        notes = (*notes, "incomplete: some requests failed, and count as wrong answers")
    family = "scorer" if results.get("client") in SCORER_CLIENTS else "MLLM"
    return Run(name, path, family, title, results.get("model"), pairs, bars, notes=notes)


def _score(value: float | None, interval: Sequence[float] | None = None) -> Score:
    # COCO's AP is -1 where a split has no ground truth; eval-mllm writes null for no items.
    if value is None or value < 0:
        return Score(None)
    return Score(float(value), *(interval or (None, None)))


# ---------------------------------------------------------------------------------------------
# Detectors
# ---------------------------------------------------------------------------------------------


def _ap(stats: Mapping[str, float], intervals: Mapping[str, Any] | None) -> Score:
    bounds = (intervals or {}).get("AP") or {}
    if bounds.get("low") is None:
        return _score(stats["AP"])
    return _score(stats["AP"], (bounds["low"], bounds["high"]))


def _detector(name: str, path: pathlib.Path, results: Mapping[str, Any]) -> Run:
    about = manifest.read(path / manifest.MANIFEST_FILE) or {}
    dataset = about.get("dataset") or {}
    data = "/".join(str(dataset[k]) for k in ("name", "config") if dataset.get(k))
    # Runs share a scatter only when evaluated on the same dataset and held-out domains.
    benchmark = f"O(OD)² on {data}" if data else "O(OD)²"
    intervals = results.get("intervals") or {}
    domains = results["per_domain"]
    iid = _ap(results["iid"], intervals.get("iid"))
    scores = {"iid": iid}
    for domain, stats in domains.items():
        scores[domain] = _ap(stats, intervals.get("per_domain", {}).get(domain))
    pairs, notes = (), ()
    if domains:
        held_out = _ap(results["ood_average"], intervals.get("ood_average"))
        scores["held-out mean"] = held_out
        shift = Shift(benchmark, "AP", "iid", f"mean over {', '.join(domains)}")
        pairs = (Pair(shift, iid, held_out),)
    else:
        notes = ("evaluated in-domain only: no held-out domain, so no pair",)
    bars = Bars(f"COCO AP per split (step {results['step']})", "AP", scores, in_domain="iid")
    model = (about.get("config") or {}).get("model_name")
    return Run(name, path, "detector", benchmark, model, pairs, (bars,), notes=notes)


# ---------------------------------------------------------------------------------------------
# eval-mllm tasks: each returns (benchmark title, pairs, bars, notes)
# ---------------------------------------------------------------------------------------------


def _accuracy(summary: Mapping[str, Any]) -> Score:
    return _score(summary["accuracy"], summary.get("accuracy_ci"))


def _foci(results: Mapping[str, Any]) -> tuple:
    datasets = results["datasets"]
    # One dataset's numbers are the run's own (tasks/foci.py writes no per_dataset then).
    per_dataset = results.get("per_dataset") or {d: results for d in datasets}
    scores = {d: _accuracy(s) for d, s in per_dataset.items()}
    bars = [
        Bars(
            "accuracy per dataset",
            "accuracy",
            scores,
            FOCI_IN_DOMAIN if FOCI_IN_DOMAIN in scores else None,
        )
    ]
    for config, splits in results.get("per_split", {}).items():
        split_scores = {s: _accuracy(v) for s, v in splits.items()}
        bars.append(Bars(f"{config}: accuracy per split", "accuracy", split_scores))
    pairs = tuple(
        Pair(Shift("FOCI", "accuracy", "ImageNet-1k", label), scores[FOCI_IN_DOMAIN], scores[d])
        for d, label in FOCI_SHIFTS.items()
        if FOCI_IN_DOMAIN in scores and d in scores
    )
    notes = ()
    if not pairs:
        notes = (
            f"no in-domain/held-out pair: FOCI pairs ImageNet-1k with ImageNet-A, -R or "
            f"-Sketch, and this run holds {', '.join(datasets) or 'no dataset'}",
        )
    return "FOCI", pairs, tuple(bars), notes


def _split_pairs(
    benchmark: str, metric: str, splits: Mapping[str, Score]
) -> tuple[tuple[Pair, ...], tuple[str, ...]]:
    """ID vs OOD-S and ID vs OOD-H, those the run has."""
    if "ID" not in splits:
        return (), ("no ID split: no in-domain/held-out pair",)
    pairs = tuple(
        Pair(Shift(benchmark, metric, "ID", split), splits["ID"], splits[split])
        for split in ("OOD-S", "OOD-H")
        if split in splits
    )
    return pairs, () if pairs else ("no OOD split: no in-domain/held-out pair",)


def _oodbench(results: Mapping[str, Any]) -> tuple:
    splits = {OODBENCH_SPLITS[s]: r for s, r in results["splits"].items()}
    accuracy = {s: _accuracy(r) for s, r in splits.items()}
    f1 = {s: _score(r["f1"]) for s, r in splits.items()}
    bars = (
        Bars("accuracy per split", "accuracy", accuracy, "ID"),
        Bars("F1 per split (no interval in results.json)", "F1", f1, "ID"),
    )
    setting = results.get("setting", "plain")
    title = "OODBench" if setting == "plain" else f"OODBench ({setting})"
    # Plain and chain-of-thought runs ask the same questions: they share the scatters.
    pairs, notes = _split_pairs("OODBench", "accuracy", accuracy)
    return title, pairs, bars, notes


def _oodbench_bap(results: Mapping[str, Any]) -> tuple:
    splits = {
        OODBENCH_SPLITS[s]: _score(r["bap"], r.get("bap_ci")) for s, r in results["splits"].items()
    }
    pairs, notes = _split_pairs("OODBench BAP", "BAP (C/N)", splits)
    bars = (Bars("BAP (C/N) per split", "BAP (C/N)", splits, "ID"),)
    return "OODBench BAP", pairs, bars, notes


def _counts_oodg(results: Mapping[str, Any]) -> tuple:
    pairs, bars = [], []
    for task, metric in OODG_METRICS.items():
        rows = results.get(task, [])
        row_scores = {}
        for row in rows:
            row_scores[row["setting"], row["ice"]] = _score(row[metric], row.get(f"{metric}_ci"))
            domains = {}
            for domain, cells in row["per_domain"].items():
                # Grounding and mapping cells are per size with "all" besides; localization's
                # domain holds its mAP directly.
                cell = cells.get("all", cells)
                domains[domain] = _score(cell[metric], cell.get(f"{metric}_ci"))
            bars.append(Bars(f"{task}: {row['setting']}, {row['ice']} ICE", metric, domains))
        for (setting, ice), score in row_scores.items():
            if setting in OODG_SHIFTED and (OODG_IN_DOMAIN, ice) in row_scores:
                shift = Shift(
                    f"COUNTS OODG {task}", metric, f"iid, {ice} ICE", f"{setting}, {ice} ICE"
                )
                pairs.append(Pair(shift, row_scores[OODG_IN_DOMAIN, ice], score))
    notes = ()
    if not pairs:
        notes = (
            "no in-domain/held-out pair: COUNTS OODG pairs setting iid with a shifted setting "
            "at the same number of in-context examples, and this run has no such two rows",
        )
    return "COUNTS OODG", tuple(pairs), tuple(bars), notes


# ---------------------------------------------------------------------------------------------
# corruptions.json
# ---------------------------------------------------------------------------------------------


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _FieldError(f"field {field!r} must be a finite number, got {value!r}")
    return float(value)


def _corruptions(data: Any) -> Corruptions:
    if not isinstance(data, dict):
        raise _FieldError("not a JSON object")
    metric = data["metric"]
    if metric not in CORRUPTION_METRICS:
        raise _FieldError(f"field 'metric' must be one of {CORRUPTION_METRICS}, got {metric!r}")
    if not isinstance(data["scores"], dict) or not data["scores"]:
        raise _FieldError("field 'scores' must map each corruption to its scores per severity")
    scores = {}
    for corruption, by_severity in data["scores"].items():
        where = f"scores.{corruption}"
        if not isinstance(by_severity, dict) or not by_severity:
            raise _FieldError(f"field {where!r} must map severities '1' to '5' to scores")
        unknown = [s for s in by_severity if s not in {str(k) for k in SEVERITIES}]
        if unknown:
            raise _FieldError(f"field {where!r}: severity {unknown[0]!r} is not one of '1' to '5'")
        scores[corruption] = {
            int(s): _number(v, f"{where}.{s}") for s, v in sorted(by_severity.items())
        }
    return Corruptions(
        metric,
        _number(data["clean"], "clean"),
        scores,
        _number(data["mPC"], "mPC"),
        None if data["rPC"] is None else _number(data["rPC"], "rPC"),
    )


def _consistency(c: Corruptions) -> tuple[str, ...]:
    """What the page must say where corruptions.json's mPC or rPC is not what its scores give."""
    values = [v for by_severity in c.scores.values() for v in by_severity.values()]
    mpc = sum(values) / len(values)
    notes = []
    if abs(mpc - c.mpc) > CONSISTENCY_TOLERANCE:
        notes.append(f"corruptions.json: mPC {c.mpc:.4f} is not the mean of its scores, {mpc:.4f}")
    if (c.clean > 0) != (c.rpc is not None):
        notes.append(f"corruptions.json: rPC is {c.rpc}, with a clean score of {c.clean:.4f}")
    elif c.rpc is not None and abs(c.mpc / c.clean - c.rpc) > CONSISTENCY_TOLERANCE:
        notes.append(f"corruptions.json: rPC {c.rpc:.4f} is not mPC / clean, {c.mpc / c.clean:.4f}")
    return tuple(notes)
