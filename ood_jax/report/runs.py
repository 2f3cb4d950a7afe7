"""The record `ood-jax report` makes of one run directory, whichever command wrote it.

Every score is a fraction in [0, 1] (COCO AP, accuracy, F1, OODBench's BAP), as the run's
results.json holds it, with its 95% interval where the run has one. A run enters the
in-domain vs held-out scatters through its `pairs`, each tagged with the `Shift` it measures;
runs whose pairs measure the same shift share a scatter and a fit (report/fit.py).
"""

from __future__ import annotations

import dataclasses
import pathlib


class RunError(ValueError):
    """A run directory that cannot be read; the message names it and what was expected."""


@dataclasses.dataclass(frozen=True)
class Score:
    """A score and its interval; `value` is None where the run has no number (COCO's -1 for a
    split without ground truth, a metric over no items)."""

    value: float | None
    low: float | None = None
    high: float | None = None


@dataclasses.dataclass(frozen=True)
class Shift:
    """What an in-domain / held-out pair measures: benchmark (with its data where runs can
    differ in it), metric, and what the in-domain and the held-out score are each over."""

    benchmark: str
    metric: str
    in_domain: str
    held_out: str

    @property
    def title(self) -> str:
        return f"{self.benchmark}: {self.metric}, {self.in_domain} vs {self.held_out}"


@dataclasses.dataclass(frozen=True)
class Pair:
    shift: Shift
    in_domain: Score
    held_out: Score


@dataclasses.dataclass(frozen=True)
class Bars:
    """One chart of per-domain (or per-split, per-dataset) scores, in the order shown;
    `in_domain`: the label of the bar that is the run's in-domain score, if one is."""

    title: str
    metric: str
    scores: dict[str, Score]
    in_domain: str | None = None


@dataclasses.dataclass(frozen=True)
class Corruptions:
    """RUN/corruptions.json: the clean score, each corruption's score per severity (1 to 5),
    mPC (the mean over corruptions and severities) and rPC (mPC / clean; None where the clean
    score is not positive)."""

    metric: str
    clean: float
    scores: dict[str, dict[int, float]]
    mpc: float
    rpc: float | None


@dataclasses.dataclass(frozen=True)
class Run:
    """One run directory. `family`: what kind of model made it, "detector" (a train / evaluate
    workdir), "MLLM" (eval-mllm) or "scorer" (eval-mllm's CLIP baseline), or None for a
    directory holding only a corruptions.json; `notes` say what the page must tell about the run (why it has no pair,
    an incomplete run, corruption numbers that do not add up)."""

    name: str
    path: pathlib.Path
    family: str | None
    benchmark: str
    model: str | None
    pairs: tuple[Pair, ...] = ()
    bars: tuple[Bars, ...] = ()
    corruptions: Corruptions | None = None
    notes: tuple[str, ...] = ()
