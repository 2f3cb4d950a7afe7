"""How far a run's numbers depend on how its replies were read: the parser audit (per parse mode,
the replies it cannot read, those it reads differently and the headline number it gives), and
the count of replies the judge mode sent to its judge."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ood_jax.eval.tasks.base import (
    CI_LABEL,
    JUDGE_MODE,
    Scoring,
    interval,
    pct,
    pct_ci,
    scored,
    table,
)


def parser_audit(scoring: Scoring, records: Sequence[dict]) -> dict | None:
    """The audit of `records` (None for a task read one way). The reference mode is the one
    `scoring` reads under: the mode of the results the audit goes with."""
    if len(scoring.parse_modes) < 2 or scoring.headline(records) is None:
        return None
    modes = [m for m in scoring.parse_modes if m != JUDGE_MODE or scoring.judge is not None]
    readings = {m: [scored(scoring.reading(m, scoring.judge), r) for r in records] for m in modes}
    # The replies a parse mode reads: answered items whose reply chooses among options.
    replies = [
        k
        for k, r in enumerate(records)
        if r["error"] is None and scoring.choice_options(r["meta"]) is not None
    ]

    def differ(a: str, b: str) -> int:
        return sum(readings[a][k]["parsed"] != readings[b][k]["parsed"] for k in replies)

    reference = scoring.parse_mode
    per_mode, headline = {}, None
    for mode, read in readings.items():
        headline, correct, n = scoring.headline(read)
        per_mode[mode] = {
            "unread": sum(read[k]["parsed"] is None for k in replies),
            "differs_from_reference": differ(mode, reference),
            "headline": correct / n if n else float("nan"),
            "headline_ci": interval(correct, n),
        }
    values = [v["headline"] for v in per_mode.values() if not math.isnan(v["headline"])]
    contested = sum(len({repr(readings[m][k]["parsed"]) for m in modes}) > 1 for k in replies)
    return {
        "headline": headline,
        "reference": reference,
        "replies": len(replies),
        "contested": contested,
        "modes": per_mode,
        "pairwise_differs": {a: {b: differ(a, b) for b in modes if b != a} for a in modes},
        "max_movement": max(values) - min(values) if values else float("nan"),
    }


def audit_markdown(audit: dict) -> str:
    reference, what = audit["reference"], audit["headline"]
    rows = []
    # Read from results.json's form, where a number over no items is null.
    base = audit["modes"][reference]["headline"]
    for mode, row in audit["modes"].items():
        known = row["headline"] is not None and base is not None
        rows.append(
            [
                mode + (" (these results)" if mode == reference else ""),
                str(row["unread"]),
                str(row["differs_from_reference"]),
                pct_ci(row["headline"], row["headline_ci"]),
                f"{100 * (row['headline'] - base):+.2f}" if known else "-",
            ]
        )
    header = [
        "parse mode",
        "replies it cannot read",
        f"read differently from {reference}",
        f"{what} (%) [{CI_LABEL}]",
        f"change vs {reference} (points)",
    ]
    return (
        "## Parser audit\n\n"
        f"The {audit['replies']} replies read under every parse mode; {audit['contested']} are "
        "read differently by at least two modes.\n\n"
        + table(header, rows)
        + f"\n\nLargest movement of the {what} between parse modes: "
        f"{pct(audit['max_movement'])} points.\n"
    )


def judge_summary(scoring: Scoring, records: Sequence[dict]) -> dict | None:
    """For judge-mode results (`records` scored by `scoring`): the replies no rule could read,
    which went to the judge, and what it made of them; None for any other mode."""
    if scoring.parse_mode != JUDGE_MODE:
        return None
    judged = named = missing = correct = 0
    for record in records:
        options = scoring.needs_judge(record)
        if options is None:
            continue
        judged += 1
        has_verdict, verdict = scoring.judge.lookup(options, record["reply"])
        missing += not has_verdict
        named += verdict is not None
        correct += bool(record["correct"])
    return {
        **scoring.judge.identity(),
        "judged": judged,
        "named_an_option": named,
        "named_none": judged - named - missing,
        "without_verdict": missing,
        "judged_correct": correct,
    }


def judge_markdown(summary: dict) -> str:
    line = (
        f"Judge ({summary['model']}, prompt {summary['prompt_version']}): "
        f"{summary['judged']} replies no rule could read went to the judge; it named an option "
        f"for {summary['named_an_option']} ({summary['judged_correct']} of them right) and none "
        f"for {summary['named_none']}."
    )
    if summary["without_verdict"]:
        line += (
            f" {summary['without_verdict']} have no verdict yet (the judge's request failed); "
            "they count as unread."
        )
    return line
