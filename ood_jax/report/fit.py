"""Effective robustness (Taori et al. 2020; Radford et al. 2021, CLIP): a line fitted to held-out
against in-domain scores across the runs of one shift, and each run's distance from it.

Pairs are grouped by the shift they measure (`runs.Shift`), one panel each, so scores of
different metrics or shifts never share a fit. The fit is least squares on logit scores by
default, as those papers fit accuracies (across models the trend is closer to linear there); a
run's effective robustness is its held-out score minus the fit's prediction, in score units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ood_jax.report.runs import Pair, Run, Shift

SCALES = ("logit", "linear")
# Two runs fix a line through both, leaving each 0.
MIN_RUNS = 3


def _check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")


def _forward(p: np.ndarray, scale: str) -> np.ndarray:
    return np.log(p / (1 - p)) if scale == "logit" else p


def _inverse(z: np.ndarray, scale: str) -> np.ndarray:
    return 1 / (1 + np.exp(-z)) if scale == "logit" else z


@dataclasses.dataclass(frozen=True)
class Fit:
    """held-out = inverse(intercept + slope * forward(in-domain)) on `scale`; `r`: Pearson's
    correlation of the (transformed) scores, None where every held-out score is the same."""

    slope: float
    intercept: float
    r: float | None
    scale: str

    def predict(self, in_domain: float | np.ndarray) -> float | np.ndarray:
        z = self.intercept + self.slope * _forward(np.asarray(in_domain, float), self.scale)
        out = _inverse(z, self.scale)
        return float(out) if out.ndim == 0 else out


def fit_line(in_domain: Sequence[float], held_out: Sequence[float], scale: str = "logit") -> Fit:
    """Least squares of held-out on in-domain scores, on `scale` (one of SCALES)."""
    _check_scale(scale)
    x = _forward(np.asarray(in_domain, float), scale)
    y = _forward(np.asarray(held_out, float), scale)
    if x.shape != y.shape or len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a line needs at least two runs with different in-domain scores")
    dx, dy = x - x.mean(), y - y.mean()
    slope = float(dx @ dy / (dx @ dx))
    intercept = float(y.mean() - slope * x.mean())
    r = float(dx @ dy / np.sqrt((dx @ dx) * (dy @ dy))) if dy @ dy > 0 else None
    return Fit(slope, intercept, r, scale)


@dataclasses.dataclass(frozen=True)
class Point:
    """One run in a panel; `effective_robustness` is None where the panel has no fit."""

    run: Run
    pair: Pair
    effective_robustness: float | None

    @property
    def drop(self) -> float:
        """Held-out minus in-domain score: the distance from y = x, with or without a fit."""
        return self.pair.held_out.value - self.pair.in_domain.value


@dataclasses.dataclass(frozen=True)
class Panel:
    """The runs of one shift, their fit (None: see `notes`), and what the page must say: why
    there is no fit, a fit on linear scores, runs left out for want of a score."""

    shift: Shift
    points: tuple[Point, ...]
    fit: Fit | None
    notes: tuple[str, ...]


def panels(runs: Sequence[Run], scale: str = "logit", min_runs: int = MIN_RUNS) -> list[Panel]:
    """One panel per shift the runs' pairs measure, in the order the runs first name them."""
    _check_scale(scale)
    groups: dict[Shift, list[tuple[Run, Pair]]] = {}
    for run in runs:
        for pair in run.pairs:
            groups.setdefault(pair.shift, []).append((run, pair))
    return [_panel(shift, members, scale, min_runs) for shift, members in groups.items()]


def _panel(shift: Shift, members: list[tuple[Run, Pair]], scale: str, min_runs: int) -> Panel:
    scored = [
        (run, pair)
        for run, pair in members
        if pair.in_domain.value is not None and pair.held_out.value is not None
    ]
    notes = [
        f"{run.name} is left out: it has no {shift.metric} on "
        f"{shift.in_domain if pair.in_domain.value is None else shift.held_out}"
        for run, pair in members
        if (run, pair) not in scored
    ]
    x = [pair.in_domain.value for _, pair in scored]
    y = [pair.held_out.value for _, pair in scored]
    fit = None
    if len(scored) < min_runs:
        notes.append(
            f"no fit: {len(scored)} run{'s' * (len(scored) != 1)} with both scores, and a fit "
            f"needs at least {min_runs}"
        )
    elif len(set(x)) < 2:
        notes.append("no fit: every run has the same in-domain score")
    else:
        if scale == "logit" and not all(0 < v < 1 for v in x + y):
            scale = "linear"
            notes.append("fitted on linear scores: a score of 0 or 1 has no logit")
        fit = fit_line(x, y, scale)
    points = tuple(
        Point(run, pair, pair.held_out.value - fit.predict(pair.in_domain.value) if fit else None)
        for run, pair in scored
    )
    return Panel(shift, points, fit, tuple(notes))
