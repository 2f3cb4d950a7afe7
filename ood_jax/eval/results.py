"""A run's records and results: each reply's record and outcome, and `build_results`, the one
place results.json and results.md are made (for a run and for `ood-jax rescore`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ood_jax.eval import parsing
from ood_jax.eval.accounting import Prices, cost_markdown, cost_summary, usage_total
from ood_jax.eval.clients import ClientError, Reply
from ood_jax.eval.store import RESULTS_JSON, RESULTS_MD
from ood_jax.eval.tasks import audit
from ood_jax.eval.tasks.base import INTERVALS, Item, Scoring, scored

OUTCOMES = ("answered", "truncated", "refused", "empty", "error")


def json_safe(value: Any) -> Any:
    """NaN (a metric over no items) becomes null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _outcome(answer: str, reply: Reply) -> str:
    if reply.refusal or reply.finish_reason == "content_filter":
        return "refused"
    # Before "empty": a reasoning model that spent the whole budget thinking needs more tokens.
    if reply.finish_reason == "length":
        return "truncated"
    if not answer.strip():
        return "empty"
    return "answered"


def outcome_of(record: dict) -> str:
    """A record's outcome; records written before outcomes were kept get theirs from the reply."""
    if record.get("outcome") in OUTCOMES:
        return record["outcome"]
    if record["error"] is not None:
        return "error"
    return "answered" if (record.get("reply") or "").strip() else "empty"


def outcome_summary(records: Sequence[dict]) -> dict:
    """{"outcomes": count per OUTCOMES, "usage": token counts summed (absent when none)}."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for record in records:
        counts[outcome_of(record)] += 1
    usage = usage_total(records)
    return {"outcomes": counts, **({"usage": usage} if usage else {})}


def summary_markdown(results: dict) -> str:
    """The line results.md ends with: the outcomes, and the tokens when the server said."""
    counts = results["outcomes"]
    line = (
        f"Replies: {counts['answered']} answered, {counts['truncated']} truncated at the token "
        f'budget (finish_reason "length"), {counts["refused"]} refused, {counts["empty"]} with no '
        f"answer text, {counts['error']} failed requests."
    )
    usage = results.get("usage", {})
    if "prompt_tokens" in usage and "completion_tokens" in usage:
        line += (
            f" Tokens: {usage['prompt_tokens']} prompt, {usage['completion_tokens']} completion."
        )
    if "cost" in results:
        line += " " + cost_markdown(results["cost"], usage)
    return line


# ---------------------------------------------------------------------------------------------
# Cost and limits
# ---------------------------------------------------------------------------------------------


def make_record(
    scoring: Scoring,
    item: Item,
    reply: Reply | None,
    error: ClientError | None,
    strip_think: bool,
) -> dict:
    record: dict[str, Any] = {"id": item.id, "digest": item.digest}
    # parsed and correct are filled in by `scored`, in their place among the fields.
    if reply is None:
        record.update(
            outcome="error", reply=None, parsed=None, correct=None, error=str(error),
            error_kind=error.kind, reasoning=None, finish_reason=None, refusal=None, usage=None,
            latency_s=None, attempts=error.attempts, model=None,
        )  # fmt: skip
    else:
        answer, thought = parsing.split_think(reply.text) if strip_think else (reply.text, None)
        reasoning = "\n\n".join(r for r in (reply.reasoning, thought) if r) or None
        record.update(
            outcome=_outcome(answer, reply), reply=answer, parsed=None, correct=None,
            error=None, error_kind=None, reasoning=reasoning, finish_reason=reply.finish_reason,
            refusal=reply.refusal, usage=reply.usage, latency_s=reply.latency_s,
            attempts=reply.attempts, model=reply.model,
        )  # fmt: skip
    record["meta"] = item.meta
    return scored(scoring, record)


def build_results(
    scoring: Scoring,
    identity: dict,
    records: Sequence[dict],
    limit: int | None = None,
    warnings: Sequence[str] = (),
    prices: Prices | None = None,
) -> tuple[dict, str]:
    """(results.json's object, results.md's text) of `records`, each already `scored` by
    `scoring`: the one way results are made, for a run and for a re-scoring. `limit`: the
    records are the first `limit` items only; `prices`: the usage is priced ("cost")."""
    judged = audit.judge_summary(scoring, records)
    parser = audit.parser_audit(scoring, records)
    results = {
        **identity,
        **({"parse_mode": scoring.parse_mode} if scoring.parse_mode else {}),
        "num_items": len(records),
        **({"limit": limit} if limit is not None else {}),
        # A reply the judge has not ruled on yet is as unfinished as a failed request.
        "complete": all(r["error"] is None for r in records)
        and not (judged and judged["without_verdict"]),
        **outcome_summary(records),
        **({"cost": cost_summary(records, prices)} if prices is not None else {}),
        **scoring.results(records),
        "intervals": INTERVALS,
        **({"judge": judged} if judged else {}),
        **({"parser_audit": parser} if parser else {}),
        **({"warnings": list(warnings)} if warnings else {}),
    }
    results = json_safe(results)
    markdown = scoring.markdown(results).rstrip("\n") + "\n\n"
    if judged:
        markdown += audit.judge_markdown(results["judge"]) + "\n\n"
    if parser:
        markdown += audit.audit_markdown(results["parser_audit"]) + "\n"
    markdown += summary_markdown(results) + "\n"
    markdown += "".join(f"\nWarning: {warning}\n" for warning in warnings)
    if limit is not None:
        markdown = (
            f"Subset: the first {limit} items only (--limit {limit}); a run without "
            f"--limit writes the results of every item to {RESULTS_JSON} and {RESULTS_MD}."
            f"\n\n{markdown}"
        )
    return results, markdown


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
