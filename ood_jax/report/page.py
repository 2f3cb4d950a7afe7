"""The report as one static HTML page: every figure inline SVG, every style inline, no script.

Its Content-Security-Policy forbids loading anything (scripts, fonts, images, styles from
elsewhere), so the page reads the same offline, from a file, or mailed, and a browser would
refuse (and log) anything that tried to reach out.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from ood_jax import __version__
from ood_jax.report import plots
from ood_jax.report.fit import MIN_RUNS, Panel
from ood_jax.report.runs import Run, Score

POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 0; background: #fafafa; }
main { max-width: 1320px; margin: 0 auto; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin-top: 36px; border-bottom: 2px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 16px; margin: 18px 0 6px; }
p, li { font-size: 14px; line-height: 1.45; max-width: 110ch; }
nav a { margin-right: 14px; font-size: 14px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.path { display: block; word-break: break-all; color: #666; font-size: 11px; }
.name { white-space: nowrap; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px;
          border-radius: 2px; }
.panel { display: grid; grid-template-columns: minmax(0, 470px) minmax(0, 1fr); gap: 4px 20px;
         align-items: start; }
.panel > div { overflow-x: auto; }
.panel h3 { grid-column: 1 / -1; }
.panel, .card { border: 1px solid #e2e2e2; border-radius: 6px; padding: 8px 12px;
                margin-bottom: 16px; }
.cards { display: flex; flex-wrap: wrap; gap: 0 16px; align-items: flex-start; }
.figures { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
figure { margin: 0; }
svg { max-width: 100%; height: auto; }
.note { color: #8a4b00; }
"""


def _esc(text: object) -> str:
    return html.escape(str(text))


def _score(score: Score) -> str:
    if score.value is None:
        return "n/a"
    if score.low is None:
        return f"{score.value:.3f}"
    return f"{score.value:.3f} [{score.low:.3f}, {score.high:.3f}]"


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], numbers: Sequence[int]) -> str:
    """A table of already-escaped cells; columns in `numbers` right-aligned."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="number">{c}</td>' if k in numbers else f"<td>{c}</td>"
            for k, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _notes(notes: Iterable[str]) -> str:
    items = "".join(f'<li class="note">{_esc(n)}</li>' for n in notes)
    return f"<ul>{items}</ul>" if items else ""


def _name(run: Run, colors: dict[str, str]) -> str:
    swatch = f'<span class="swatch" style="background:{colors[run.name]}"></span>'
    return f'<span class="name">{swatch}<strong>{_esc(run.name)}</strong></span>'


def _runs_section(runs: Sequence[Run], colors: dict[str, str]) -> str:
    rows = []
    for run in runs:
        pairs = "<br>".join(
            f"{_esc(p.shift.in_domain)} {_score(p.in_domain)} &rarr; "
            f"{_esc(p.shift.held_out)} {_score(p.held_out)}"
            for p in run.pairs
        )
        rows.append(
            [
                f'{_name(run, colors)}<span class="path">{_esc(run.path)}</span>',
                _esc(run.family or "-"),
                _esc(run.benchmark),
                _esc(run.model or "-"),
                pairs or "none (see notes)",
                "yes" if run.corruptions else "no",
                "<br>".join(_esc(n) for n in run.notes),
            ]
        )
    header = [
        "run (directory)",
        "family",
        "benchmark",
        "model",
        "in-domain &rarr; held-out [95% CI]",
        "corruptions",
        "notes",
    ]
    return f'<section id="runs"><h2>Runs</h2>{_table(header, rows, ())}</section>'


def _fit_text(panel: Panel) -> str:
    fit = panel.fit
    if fit is None:
        return ""
    held_out, in_domain = (
        ("logit(held-out)", "logit(in-domain)")
        if fit.scale == "logit"
        else ("held-out", "in-domain")
    )
    r = "n/a" if fit.r is None else f"{fit.r:.3f}"
    return (
        f"<p>Fit over {len(panel.points)} runs: {held_out} = {fit.slope:.3f} &times; "
        f"{in_domain} {'+' if fit.intercept >= 0 else '&minus;'} "
        f"{abs(fit.intercept):.3f}; Pearson r = {r}.</p>"
    )


def _panel(panel: Panel, colors: dict[str, str], index: int) -> str:
    rows = [
        [
            _name(point.run, colors),
            _esc(point.run.family),
            _score(point.pair.in_domain),
            _score(point.pair.held_out),
            _signed(point.drop),
            "n/a" if panel.fit is None else f"{panel.fit.predict(point.pair.in_domain.value):.3f}",
            _signed(point.effective_robustness),
        ]
        for point in panel.points
    ]
    header = [
        "run",
        "family",
        "in-domain [95% CI]",
        "held-out [95% CI]",
        "held-out &minus; in-domain",
        "fit's prediction",
        "effective robustness",
    ]
    figure = plots.scatter_svg(panel, colors, f"scatter-{index}") if panel.points else ""
    return (
        f'<article class="panel"><h3>{_esc(panel.shift.title)}</h3>'
        f"<figure>{figure}</figure><div>{_fit_text(panel)}{_notes(panel.notes)}"
        f"{_table(header, rows, (2, 3, 4, 5, 6))}</div></article>"
    )


def _robustness_section(
    runs: Sequence[Run], panels: Sequence[Panel], colors: dict[str, str], scale: str
) -> str:
    on = "logit scores" if scale == "logit" else "the scores themselves"
    intro = (
        "<p>One panel per shift: runs share a panel, and a fit, only when they report the same "
        "metric on the same in-domain and held-out data; detectors, MLLMs and CLIP-style "
        "scorers evaluated alike share it (marker: family). Both axes of a panel have one range "
        "and one unit, the score as a fraction of 1, so the dashed diagonal is no drop. The fit "
        "is least squares of held-out on in-domain score across the panel's runs, on "
        f"{on} unless a panel says otherwise (Taori et al. 2020, Radford et al. 2021); a run's "
        "<em>effective robustness</em> is its held-out score minus the fit's prediction at its "
        f"in-domain score. A panel with fewer than {MIN_RUNS} runs has no fit. Brackets: 95% "
        "intervals as the runs report them (bootstrap over images for detectors, "
        "Clopper-Pearson for accuracies).</p>"
    )
    body = "".join(_panel(p, colors, k) for k, p in enumerate(panels))
    body = body or "<p>No run has a pair.</p>"
    absent = [run for run in runs if not run.pairs]
    if absent:
        items = "".join(
            f"<li>{_name(run, colors)}: {_esc('; '.join(run.notes))}</li>" for run in absent
        )
        body += f"<h3>Not in any scatter</h3><ul>{items}</ul>"
    return f'<section id="robustness"><h2>In-domain vs held-out</h2>{intro}{body}</section>'


def _domains_section(runs: Sequence[Run], colors: dict[str, str]) -> str:
    cards = []
    for k, run in enumerate(runs):
        if not run.bars:
            continue
        figures = "".join(
            f"<figure>{plots.bars_svg(bars, f'bars-{k}-{j}')}</figure>"
            for j, bars in enumerate(run.bars)
        )
        cards.append(
            f'<article class="card"><h3>{_name(run, colors)} &middot; {_esc(run.benchmark)}</h3>'
            f'<div class="figures">{figures}</div></article>'
        )
    intro = (
        "<p>Every score a run reports per domain, split or dataset, with its 95% interval "
        "(none where the run has none: F1, mapping accuracy, localization mAP); blue: the "
        "in-domain score of the run's pair.</p>"
    )
    cards = f'<div class="cards">{"".join(cards)}</div>'
    return f'<section id="domains"><h2>Per-domain scores</h2>{intro}{cards}</section>'


def _corruptions_section(runs: Sequence[Run], colors: dict[str, str]) -> str:
    corrupted = [run for run in runs if run.corruptions]
    if not corrupted:
        body = "<p>No run directory holds a corruptions.json.</p>"
    else:
        rows = [
            [
                _name(run, colors),
                _esc(run.corruptions.metric),
                f"{run.corruptions.clean:.3f}",
                f"{run.corruptions.mpc:.3f}",
                "n/a" if run.corruptions.rpc is None else f"{run.corruptions.rpc:.3f}",
                str(len(run.corruptions.scores)),
            ]
            for run in corrupted
        ]
        header = ["run", "metric", "clean", "mPC", "rPC", "corruptions"]
        cards = "".join(
            f'<article class="card"><h3>{_name(run, colors)}</h3><figure>'
            f"{plots.corruptions_svg(run.corruptions, f'corruptions-{k}')}</figure></article>"
            for k, run in enumerate(corrupted)
        )
        body = (
            "<p>mPC: the mean score over corruptions and severities; rPC: mPC / clean score "
            "(as each run's corruptions.json gives them). Curves: score against severity, "
            "severity 0 being the clean score.</p>"
            f'{_table(header, rows, (2, 3, 4, 5))}<div class="cards">{cards}</div>'
        )
    return f'<section id="corruptions"><h2>Corruptions</h2>{body}</section>'


METHOD = """
<section id="method"><h2>What in-domain and held-out mean here</h2><ul>
<li><strong>Detectors</strong> (COUNTS O(OD)&sup2;, <code>ood-jax train</code> /
<code>evaluate</code> workdirs): COCO AP on the in-domain test images (iid) vs the mean AP over
the held-out domains, COUNTS' Table 2; intervals from the evaluation's bootstrap over images.
Detectors share a panel only when evaluated on the same dataset and held-out domains.</li>
<li><strong>FOCI</strong> (<code>eval-mllm foci</code>, MLLMs and the CLIP baseline): accuracy
on ImageNet-1k vs on each of ImageNet-A, ImageNet-R and ImageNet-Sketch the run holds, the
natural shifts of effective robustness' papers. FOCI's other datasets (Food-101, Flowers102, ...)
are different tasks, not shifts of one another, so a run without ImageNet-1k and a variant is in
the per-domain bars only.</li>
<li><strong>OODBench</strong> (<code>eval-mllm oodbench</code>): accuracy on ID vs on OOD-S, and
ID vs OOD-H (F1 is in the bars; it has no interval). BAP runs: BAP (C/N) likewise.</li>
<li><strong>COUNTS OODG</strong> (<code>eval-mllm counts-oodg</code>): the benchmark puts the
shift in the in-context examples, so a task's score with examples from the test's domain
(setting iid) is paired with its score under each shifted setting (covariate_shift,
label_shift, spurious_correlation) at the same number of examples.</li>
<li><strong>Scorers</strong>: CLIP-style zero-shot runs (<code>eval-mllm --clip</code>) are read
as the benchmark they answered and share its panels. Mining outputs (FOCI options, OODBench
splits, OODG items) hold no scores, and are not runs.</li>
<li><strong>Corruptions</strong>: a run directory's corruptions.json, drawn as given.</li>
</ul></section>
"""


def render(runs: Sequence[Run], panels: Sequence[Panel], title: str, scale: str) -> str:
    """The page for `runs` and their `panels` (report/fit.py), fitted on `scale`."""
    colors = plots.run_colors(runs)
    names = ", ".join(_esc(run.name) for run in runs)
    nav = "".join(
        f'<a href="#{anchor}">{label}</a>'
        for anchor, label in (
            ("runs", "Runs"),
            ("robustness", "In-domain vs held-out"),
            ("domains", "Per-domain scores"),
            ("corruptions", "Corruptions"),
            ("method", "Definitions"),
        )
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{POLICY}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body><main>"
        f"<h1>{_esc(title)}</h1><p>{len(runs)} runs: {names}. Written by ood-jax "
        f"{_esc(__version__)} (<code>ood-jax report</code>).</p><nav>{nav}</nav>"
        f"{_runs_section(runs, colors)}{_robustness_section(runs, panels, colors, scale)}"
        f"{_domains_section(runs, colors)}{_corruptions_section(runs, colors)}{METHOD}"
        "</main></body></html>\n"
    )
