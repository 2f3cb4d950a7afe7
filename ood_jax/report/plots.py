"""The report's figures as inline SVG: the in-domain vs held-out scatter of a panel, one chart
of per-domain bars, and a run's corruption curves.

Figures are matplotlib `Figure`s saved to SVG in memory, without pyplot (no backend to choose,
no global figure to close). Text stays text (`svg.fonttype: none`), so run names are in the
page's DOM and searchable; the SVG's ids are prefixed with the figure's key, so that several
figures inline in one page never share an id (matplotlib's clip paths and markers are
referenced by id), and the output is the same for the same input.
"""

from __future__ import annotations

import io
import re
import textwrap
from collections.abc import Sequence

import matplotlib
import matplotlib.colors
import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ood_jax.report.fit import Panel
from ood_jax.report.runs import Bars, Corruptions, Run, Score

FAMILY_MARKERS = {"detector": "s", "MLLM": "o", "scorer": "^"}
# As the detector evaluation's per_domain_ap.png: in-domain blue, the others orange.
IN_DOMAIN_COLOR = "#4c72b0"
OTHER_COLOR = "#dd8452"
# Keeps a fitted logit curve finite at the axes' ends.
LOGIT_EDGE = 1e-4


def run_colors(runs: Sequence[Run]) -> dict[str, str]:
    """A colour per run, the same in every scatter and in the runs table."""
    # tab10, then the darkest of each of tab20b's and tab20c's hues: 20 colours that all stand
    # out on white (tab20's pale halves do not), before they repeat.
    palette = (
        matplotlib.colormaps["tab10"].colors
        + matplotlib.colormaps["tab20b"].colors[::4]
        + matplotlib.colormaps["tab20c"].colors[::4]
    )
    return {
        run.name: matplotlib.colors.to_hex(palette[k % len(palette)]) for k, run in enumerate(runs)
    }


def to_svg(fig: Figure, key: str) -> str:
    """`fig` as an <svg> element (no XML prolog) for an HTML page; `key` unique in the page."""
    buffer = io.BytesIO()
    # A fixed salt: matplotlib's ids are otherwise random, and the page would differ each time.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "ood-jax report"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue().decode()
    # Every id, and every reference to one, prefixed with the figure's key: figures inline in
    # one page would otherwise repeat ids ("patch_1", the same clip path's hash).
    return re.sub(r'(id="|url\(#|href="#)', rf"\1{key}-", text[text.index("<svg") :])


def _error(scores: Sequence[Score]) -> np.ndarray | None:
    """matplotlib's asymmetric error bars (2 x N), zero where a score has no interval."""
    if all(s.low is None for s in scores):
        return None
    return np.array(
        [
            [0.0, 0.0] if s.low is None else [max(s.value - s.low, 0), max(s.high - s.value, 0)]
            for s in scores
        ]
    ).T


def _plain_ticks(*axes) -> None:
    """Each tick labelled with its whole value ("0.5", "6e-05"): a smoke run's tiny scores
    otherwise get ticks relative to a multiplier printed apart ("1e-5"), easily missed."""
    for axis in axes:
        axis.set_major_formatter(ticker.FormatStrFormatter("%g"))


def _wrap(text: str, width: int = 48) -> str:
    return "\n".join(textwrap.wrap(text, width))


def scatter_svg(panel: Panel, colors: dict[str, str], key: str) -> str:
    """Held-out against in-domain score, one point per run with its intervals, y = x and the
    fit; both axes share one range, so the diagonal is no drop."""
    fig = Figure(figsize=(4.8, 4.5), layout="constrained")
    ax = fig.subplots()
    bounds = []
    for point in panel.points:
        x, y = point.pair.in_domain, point.pair.held_out
        bounds += [v for s in (x, y) for v in (s.value, s.low, s.high) if v is not None]
        ax.errorbar(
            x.value,
            y.value,
            xerr=_error([x]),
            yerr=_error([y]),
            fmt=FAMILY_MARKERS[point.run.family],
            color=colors[point.run.name],
            markersize=7,
            capsize=2,
            elinewidth=0.8,
        )
        ax.annotate(
            point.run.name,
            (x.value, y.value),
            xytext=(5, 4),
            textcoords="offset points",
            size=8,
            # Legible over the other runs' error bars.
            bbox={
                "boxstyle": "round,pad=0.1",
                "facecolor": "white",
                "edgecolor": "none",
                "alpha": 0.8,
            },
        )
    low, high = min(bounds), max(bounds)
    pad = 0.08 * (high - low) or 0.05
    low, high = max(0.0, low - pad), min(1.0, high + pad)
    handles = [
        ax.plot([low, high], [low, high], ls="--", lw=1, color="0.6", label="y = x (no drop)")[0]
    ]
    if panel.fit:
        grid = np.linspace(max(low, LOGIT_EDGE), min(high, 1 - LOGIT_EDGE), 200)
        label = f"fit on {panel.fit.scale} scores"
        handles += ax.plot(grid, panel.fit.predict(grid), lw=1.3, color="black", label=label)
    for family in dict.fromkeys(p.run.family for p in panel.points):
        marker = FAMILY_MARKERS[family]
        handles.append(Line2D([], [], marker=marker, ls="", color="0.35", label=family))
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal", adjustable="box")
    _plain_ticks(ax.xaxis, ax.yaxis)
    ax.grid(alpha=0.3)
    shift = panel.shift
    ax.set_xlabel(_wrap(f"in-domain {shift.metric}: {shift.in_domain}"), size=9)
    ax.set_ylabel(_wrap(f"held-out {shift.metric}: {shift.held_out}"), size=9)
    return to_svg(fig, key)


def _label(score: Score) -> str:
    return "n/a" if score.value is None else f"{score.value:.3f}"


def bars_svg(bars: Bars, key: str) -> str:
    """One bar per label with its interval and its value; the in-domain bar in blue."""
    labels, scores = list(bars.scores), list(bars.scores.values())
    fig = Figure(figsize=(max(3.4, 1.2 + 0.5 * len(labels)), 3.2), layout="constrained")
    ax = fig.subplots()
    heights = [s.value or 0.0 for s in scores]
    colors = [IN_DOMAIN_COLOR if label == bars.in_domain else OTHER_COLOR for label in labels]
    ax.bar(range(len(labels)), heights, color=colors, yerr=_error(scores), capsize=2, ecolor="0.2")
    tops = [max(h, s.high or 0.0) for h, s in zip(heights, scores)]
    top = max(tops) or 1.0
    for k, (score, bar_top) in enumerate(zip(scores, tops)):
        ax.text(k, bar_top + 0.02 * top, _label(score), ha="center", va="bottom", size=7)
    ax.set_ylim(0, 1.15 * top)
    _plain_ticks(ax.yaxis)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel(bars.metric, size=9)
    ax.set_title(_wrap(bars.title, 60), size=9)
    return to_svg(fig, key)


def corruptions_svg(corruptions: Corruptions, key: str) -> str:
    """Score against severity (0: clean), one curve per corruption and their mean."""
    fig = Figure(figsize=(6.0, 3.4), layout="constrained")
    ax = fig.subplots()
    # Fifteen corruptions (ImageNet-C, COCO-C) outnumber the colours one tells apart: after ten,
    # the colours come again with another line style.
    palette, styles = matplotlib.colormaps["tab10"].colors, ("-", "--", ":")
    for k, (name, by_severity) in enumerate(corruptions.scores.items()):
        ax.plot(
            [0, *by_severity],
            [corruptions.clean, *by_severity.values()],
            marker="o",
            markersize=3,
            lw=1,
            ls=styles[k // len(palette) % len(styles)],
            color=palette[k % len(palette)],
            label=name,
        )
    severities = sorted({s for by_severity in corruptions.scores.values() for s in by_severity})
    means = [np.mean([v[s] for v in corruptions.scores.values() if s in v]) for s in severities]
    ax.plot(
        [0, *severities],
        [corruptions.clean, *means],
        lw=2.5,
        color="black",
        label="mean over corruptions",
    )
    ax.set_xticks(range(6), ["clean", "1", "2", "3", "4", "5"])
    ax.set_xlabel("severity", size=9)
    ax.set_ylabel(corruptions.metric, size=9)
    ax.grid(alpha=0.3)
    columns = 1 if len(corruptions.scores) <= 18 else 2
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), ncol=columns, frameon=False)
    return to_svg(fig, key)
