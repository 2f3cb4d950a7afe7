"""Performance under corruption (Michaelis et al., 2019, Sec. 3.2): mPC and rPC.

mPC is the mean of a metric (COCO AP here) over every corruption and severity, rPC = mPC / the
clean metric. The paper uses 15 corruptions at 5 severities; a run on fewer reports the mean
over those it has, and every corruption must have the same severities, so none weighs more than
another. corruptions.json holds one split's numbers (`summary`; format in
docs/guide/corruptions.md).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import numpy as np

from ood_jax import files

METRIC = "AP"
FILE = "corruptions.json"
PER_SPLIT_DIR = "corruptions"

Scores = Mapping[str, Mapping[int, float]]  # corruption -> severity -> metric


def mpc(scores: Scores) -> float:
    """The mean of the metric over every corruption and severity in `scores`."""
    if not scores or not all(scores.values()):
        raise ValueError("mPC needs at least one corruption with at least one severity")
    severities = {name: sorted(by_severity) for name, by_severity in scores.items()}
    first, *others = severities.items()
    for name, levels in others:
        if levels != first[1]:
            raise ValueError(
                f"corruption {name} has severities {levels} but {first[0]} has {first[1]}; "
                "mPC averages a full grid"
            )
    return float(np.mean([v for by_severity in scores.values() for v in by_severity.values()]))


def rpc(mpc_value: float, clean: float) -> float | None:
    """mPC relative to the clean metric; None (JSON null) when the clean metric is not positive,
    where the ratio means nothing."""
    return float(mpc_value / clean) if clean > 0 else None


def summary(clean: float, scores: Scores, metric: str = METRIC) -> dict:
    """corruptions.json's content for one evaluated split."""
    value = mpc(scores)
    return {
        "metric": metric,
        "clean": float(clean),
        "scores": {
            name: {str(s): float(by_severity[s]) for s in sorted(by_severity)}
            for name, by_severity in scores.items()
        },
        "mPC": value,
        "rPC": rpc(value, clean),
    }


def write(run_dir: str | pathlib.Path, summaries: Mapping[str, dict], headline: str) -> None:
    """RUN/corruptions.json (the `headline` split's summary) and RUN/corruptions/{split}.json
    for each split, written atomically."""
    run_dir = pathlib.Path(run_dir)
    for name, split_summary in summaries.items():
        files.write_json_atomic(run_dir / PER_SPLIT_DIR / f"{name}.json", split_summary)
    files.write_json_atomic(run_dir / FILE, summaries[headline])
