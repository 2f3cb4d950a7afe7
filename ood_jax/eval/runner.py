"""The resumable evaluation loop: items -> client -> DIR/predictions.jsonl -> DIR/results.{json,md}.

DIR/predictions.jsonl holds one JSON line per answered item: id, digest (SHA-256 of the prompt
and images), outcome, reply (the answer text, `<think>` blocks taken out unless strip_think is
off), parsed answer, correct, error and error_kind (null unless the request failed), reasoning
(the server's reasoning_content and any `<think>` text), finish_reason, refusal, usage
(prompt/completion/total tokens as the server reported them), latency_s, attempts, model (the
id the server reported) and the item's meta. The outcome is one of OUTCOMES:
  answered   a reply with answer text;
  truncated  cut at the token budget (finish_reason "length"), scored as it is;
  refused    the model refused (a `refusal`, or finish_reason "content_filter");
  empty      no answer text: content null or "" (perhaps with reasoning only), or only <think>;
  error      the request failed (the error says why); the next run sends it again.
results.json counts them under "outcomes", with the token usage summed; results.md ends with
the same counts.

Lines are appended and flushed as replies arrive, so a killed run keeps every reply it
received; Ctrl-C ends with one line saying how many replies the file keeps. A rerun into the
same DIR:
  * drops a torn last line (a kill in the middle of a write) and sends that item again;
  * sends only items without a reply: answered items are skipped, failed ones retried;
  * refuses to mix: an item whose digest changed, or a run with another benchmark, model,
    generation budget or request option (DIR/run.json), is an error naming what differs.
When every item of the run has been handled the file is rewritten (atomically) with one line per
item, the run's items first; records of items outside the run (beyond a --limit) are kept.

Replies are read under a parse mode (ood_jax.eval.tasks.base.PARSE_MODES, for the tasks that
have them), which is not part of the run's identity: the stored reply is what the model said, so
a rerun with another mode re-reads every stored reply and asks the model nothing. DIR/run.json
records the mode the results were last written with ("parse_mode", beside the identity); a rerun
without a mode keeps it, and a run directory written when the mode was part of the identity reads
its stored mode the same way. At the end of each run every record's parsed answer and verdict are
read again under the run's mode, so predictions.jsonl and the results always agree. The judge
mode first asks a judge (ood_jax.eval.judge) about every reply no rule reads whose verdict
DIR/judge.jsonl does not keep yet; the judge is then part of the run's identity (run.json
"judge"). `build_results` is the one place results are made, for a run and for
`ood-jax rescore` (ood_jax.eval.rescore): the task's tables with exact intervals, the judge's
count and the parser audit (ood_jax.eval.tasks.audit).

Results are written atomically at the end of every run. A run over every item writes
results.json and results.md. A run with `limit=N` that leaves items out writes
results.limitN.json and results.limitN.md beside them, never over them: they hold "limit": N,
"num_items" (at most N) and a markdown line saying they are a subset. (A limit that leaves no
item out is a full run.) "complete" is true when every item of the run, i.e. the first N for a
limited one, has a reply without a request error; it says nothing of items past the limit. A
later run without a limit sends only what the limited runs left unanswered and writes
results.json.

A run stops early (RunStopped, no results written, every reply kept) when
`max_consecutive_failures` items in a row fail with the same kind of error: a server that
fails every request is not asked every item. Requests go out from daemon threads, so Ctrl-C
never waits for a request still out; a client that takes a RunControl (the HTTP client) also
abandons its waits, adapts its concurrency and spends one retry budget across the run
(ood_jax.eval.clients).

Limits per invocation (`max_requests`, `max_cost`) stop a run the same way (LimitReached, a
RunStopped; every reply kept, no results written), checked before each request. A request is one
item asked (its retries are the retry budget's): --max-requests N sends N. The cost is counted
from the token usage the server reports, at `prices` per million prompt / completion tokens; the
run stops once what it spent reaches --max-cost. Requests already out by then still finish and
are kept, so it may spend up to 2 * concurrency - 2 replies more (none with concurrency 1). A
reply without usage cannot be priced, so under --max-cost it stops the run. Failed requests
count as costing nothing, and the judge's requests are not counted. A rerun starts its counts
from zero and continues where the last one stopped. The prices are not part of the identity:
run.json keeps the last ones given (a rerun without them keeps those), and results.json /
results.md price the usage of every record ("cost").

DIR/manifest.json (ood_jax.manifest) says what the run was made with and what it spent: the
benchmark and its data (the TFDS builds read, or the items file, with digests; "items": the count
and `manifest.items_digest` of the run's (id, digest) pairs, equal for two runs exactly when
`ood-jax compare` finds the same ids with the same digests), the client's identity and the model
ids the server reported, where the requests went, the prompt and parser versions, the limits and
prices, and this invocation's totals (requests sent, replies, failures, attempts, tokens, cost).
It is written when the run starts and again when it ends, whichever way: "complete",
"incomplete", "stopped", "interrupted" or "failed".

`ood-jax eval-mllm` (ood_jax.eval.cli) exits 0 when the run is complete with no failed item,
3 (EXIT_INCOMPLETE) when it finished with failed items, 4 (EXIT_STOPPED) when it stopped early,
130 on Ctrl-C, and 1 on a usage or data error (one "error:" line).

The items and their scoring come from a Benchmark (ood_jax.eval.tasks.base; the tasks are in
ood_jax.eval.tasks), the replies from a client of ood_jax.eval.clients.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import queue
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from ood_jax import files, manifest, prompts
from ood_jax.eval import parsing
from ood_jax.eval.clients import (
    DEFAULT_CONCURRENCY,
    Abandoned,
    ClientError,
    Reply,
    Request,
    RunControl,
)
from ood_jax.eval.tasks import audit
from ood_jax.eval.tasks.base import INTERVALS, JUDGE_MODE, Benchmark, Item, Scoring, scored

PREDICTIONS_FILE = "predictions.jsonl"
RUN_FILE = "run.json"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
OUTCOMES = ("answered", "truncated", "refused", "empty", "error")
# Enough to tell a server that fails every request from one that fails now and then, few
# enough that a misspelled model costs seconds.
DEFAULT_MAX_CONSECUTIVE_FAILURES = 5
# Identity keys added after run directories were first written, with the value every older run
# had: an older DIR/run.json without them still matches a run that uses those values.
LEGACY_IDENTITY = {
    "token_param": "max_tokens",
    "temperature": 0,
    "extra_body": {},
    "strip_think": False,
}
# What run.json holds beside the identity: how the replies are read and priced. The parse mode
# was part of the identity of older runs; it is now only the mode the results were last written
# with. Prices change no reply, so they are no part of the identity either.
SCORING_KEYS = ("parse_mode", "judge", "prices")
# Token prices are per this many tokens, as vendors quote them.
PRICE_UNIT_TOKENS = 1_000_000


def results_files(limit: int | None = None, parse_mode: str | None = None) -> tuple[str, str]:
    """(json, markdown) file names of a run's results: results.* for a run over every item,
    results.limitN.* for one over the first N only (`limit`: the "limit" of its results);
    `parse_mode`: results re-scored under a mode other than the run's, results[.limitN].MODE.*."""
    stem = "results" + (f".limit{limit}" if limit is not None else "")
    stem += f".{parse_mode}" if parse_mode is not None else ""
    return f"{stem}.json", f"{stem}.md"


class RunError(ValueError):
    """An output directory or item set that a run cannot continue with."""


class RunStopped(RuntimeError):
    """Items in a row failed with the same kind of error, so the run stopped; every reply
    received is kept. `kind`: that kind ("HTTP 500", "timeout", ...); `error`: the last one's
    message; `kept`: the replies the predictions file holds."""

    def __init__(self, message: str, kind: str, error: str, kept: int):
        super().__init__(message)
        self.kind, self.error, self.kept = kind, error, kept


class LimitReached(RunStopped):
    """A limit of this invocation (--max-requests, --max-cost: `kind`) stopped the run before
    its next request; every reply received is kept, and a rerun continues."""


class Client(Protocol):
    """What the runner asks: `generate` returns a clients.Reply or the reply text, and raises
    clients.ClientError for a request that failed. A client with `accepts_run_control` true
    takes the run's RunControl as `generate(request, control)`."""

    def identity(self) -> dict: ...

    def generate(self, request: Request) -> Reply | str: ...


# ---------------------------------------------------------------------------------------------
# The predictions file
# ---------------------------------------------------------------------------------------------


class PredictionStore:
    """DIR/predictions.jsonl: the latest record per item id, appended to as replies arrive."""

    def __init__(self, path: pathlib.Path, repair: bool = True):
        """Loads `path` if it exists; `repair` cuts a torn last line off the file (else it is
        only ignored, for readers that must not change the file)."""
        self.path = path
        self.records: dict[str, dict] = {}
        self.torn_line_dropped = False
        if path.exists():
            self._load(repair)
        self._file = None

    def _load(self, repair: bool) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            # A kill mid-write leaves a last line without its newline: drop it; it is re-sent.
            if repair:
                with open(self.path, "r+b") as f:
                    f.truncate(end)
            self.torn_line_dropped = True
        try:
            text = data[:end].decode()
        except UnicodeDecodeError as e:
            raise RunError(f"{self.path}: not UTF-8 text ({e})") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunError(f"{self.path}: line {number}: malformed JSON ({e.msg})") from None
            if not isinstance(record, dict) or not {"id", "digest"} <= record.keys():
                raise RunError(f"{self.path}: line {number}: a record needs 'id' and 'digest'")
            self.records[record["id"]] = record

    def append(self, record: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        # One write of a whole line, flushed at once: the OS has it even if the process dies.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records[record["id"]] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def compact(self, order: Sequence[str]) -> None:
        """Rewrites the file with one line per id: `order` first, then any other ids kept."""
        self.close()
        in_order = set(order)
        ids = list(order) + [i for i in self.records if i not in in_order]
        text = "".join(json.dumps(self.records[i]) + "\n" for i in ids if i in self.records)
        files.write_atomic(self.path, text)


def read_run_file(directory: pathlib.Path) -> dict | None:
    """DIR/run.json, or None where there is none yet."""
    path = directory / RUN_FILE
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{path}: malformed JSON ({e.msg})") from None
    if not isinstance(run, dict):
        raise RunError(f"{path}: not a JSON object")
    return run


def run_identity(run: dict) -> dict:
    """The identity in a run.json: what a rerun must match (the scoring keys left out)."""
    return {k: v for k, v in run.items() if k not in SCORING_KEYS}


def _check_run_file(directory: pathlib.Path, identity: dict) -> dict | None:
    """The stored run.json (None when new), after checking that it holds this run's identity."""
    stored = read_run_file(directory)
    if stored is None:
        return None
    previous = {
        **{k: v for k, v in LEGACY_IDENTITY.items() if k in identity},
        **run_identity(stored),
    }
    differs = sorted(
        k for k in identity.keys() | previous.keys() if identity.get(k) != previous.get(k)
    )
    if differs:
        detail = ", ".join(
            f"{k}: {previous.get(k)!r} there, {identity.get(k)!r} now" for k in differs
        )
        raise RunError(
            f"{directory} holds predictions of another run ({detail}); use another --output"
        )
    return stored


class Judge(Protocol):
    """What a run asks of the judge mode's judge (ood_jax.eval.judge.Judge): its identity, the
    verdicts it keeps, and `complete`, which asks it about the replies still without one."""

    verdicts: Any

    def identity(self) -> dict: ...

    def complete(self, scoring: Scoring, records: Sequence[dict], progress: bool) -> None: ...


def _scoring_mode(
    directory: pathlib.Path,
    benchmark: Benchmark,
    stored: dict | None,
    parse_mode: str | None,
    judge: Judge | None,
) -> Scoring:
    """The benchmark reading replies under the run's mode: `parse_mode`, else the mode the
    directory's results were last written with, else the benchmark's default."""
    mode = parse_mode or (stored or {}).get("parse_mode") or benchmark.parse_mode
    if mode == JUDGE_MODE and judge is None:
        origin = "--parse-mode judge" if parse_mode else f"{directory / RUN_FILE} says so"
        raise RunError(
            f"replies are read under parse mode judge ({origin}): that needs a judge "
            "(--judge-endpoint and --judge-model), or pick another --parse-mode"
        )
    if judge is not None and mode != JUDGE_MODE:
        raise ValueError(f"a judge applies to parse mode judge only, not {mode!r}")
    kept = (stored or {}).get("judge")
    if judge is not None and kept is not None and kept != judge.identity():
        raise RunError(
            f"{directory}'s replies were judged by another judge ({kept!r} there, "
            f"{judge.identity()!r} now); use that judge, or another --output"
        )
    try:
        return benchmark.reading(mode, judge.verdicts if judge is not None else None)
    except ValueError as e:
        raise RunError(f"{directory}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr with the rate and time left (tqdm), or nothing when disabled."""

    def __init__(self, total: int | None, description: str, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=description, unit="item", file=sys.stderr, dynamic_ncols=True
            )

    def update(self, done: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(done)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _json_safe(value: Any) -> Any:
    """NaN (a metric over no items) becomes null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Records and their outcomes
# ---------------------------------------------------------------------------------------------


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


def _usage_total(records: Sequence[dict]) -> dict:
    total: dict[str, int] = {}
    for record in records:
        for key, value in (record.get("usage") or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def outcome_summary(records: Sequence[dict]) -> dict:
    """{"outcomes": count per OUTCOMES, "usage": token counts summed (absent when none)}."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for record in records:
        counts[outcome_of(record)] += 1
    usage = _usage_total(records)
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


def _priceable(usage: dict | None) -> bool:
    """Whether a reply's usage says both what it read and what it wrote."""
    return bool(usage) and "prompt_tokens" in usage and "completion_tokens" in usage


@dataclasses.dataclass(frozen=True)
class Prices:
    """What PRICE_UNIT_TOKENS prompt tokens (`input`) and completion tokens (`output`) cost, in
    whatever currency they are given in."""

    input: float
    output: float

    def __post_init__(self):
        for flag, value in (("--price-in", self.input), ("--price-out", self.output)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{flag} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag} must be a non-negative number, got {value!r}")

    def cost(self, usage: dict) -> dict:
        """{"input", "output", "total"}: what `usage`'s prompt and completion tokens cost."""
        spent_in = usage.get("prompt_tokens", 0) * self.input / PRICE_UNIT_TOKENS
        spent_out = usage.get("completion_tokens", 0) * self.output / PRICE_UNIT_TOKENS
        return {"input": spent_in, "output": spent_out, "total": spent_in + spent_out}

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output, "per_tokens": PRICE_UNIT_TOKENS}


def stored_prices(run: dict | None, where: pathlib.Path) -> Prices | None:
    """The prices a run.json keeps (None: none were given yet)."""
    kept = (run or {}).get("prices")
    if kept is None:
        return None
    try:
        return Prices(kept["input"], kept["output"])
    except (TypeError, KeyError, ValueError) as e:
        raise RunError(f"{where}: 'prices' is not what eval-mllm writes ({e})") from None


def cost_summary(records: Sequence[dict], prices: Prices) -> dict:
    """results.json's "cost": the prices, what the records' summed usage cost, and how many
    replies reported no prompt and completion counts (counted as costing nothing)."""
    usage = _usage_total(records)
    unpriced = sum(r["error"] is None and not _priceable(r.get("usage")) for r in records)
    return {
        "prices": prices.to_json(),
        **prices.cost(usage),
        "replies_without_usage": unpriced,
    }


def cost_markdown(cost: dict, usage: dict) -> str:
    prices = cost["prices"]
    line = (
        f"Cost: {cost['total']:.4f} ({usage.get('prompt_tokens', 0)} prompt tokens at "
        f"{prices['input']:g} and {usage.get('completion_tokens', 0)} completion tokens at "
        f"{prices['output']:g} per {prices['per_tokens']:,})."
    )
    if cost["replies_without_usage"]:
        line += (
            f" {cost['replies_without_usage']} replies reported no token counts and are not in it."
        )
    return line


class Spent:
    """What this invocation of a run sent and got back: requests (items asked), replies,
    failed requests, HTTP attempts, tokens (summed as the server reported them)."""

    def __init__(self):
        self.requests = self.replies = self.failures = self.attempts = 0
        self.tokens: dict[str, int] = {}
        # Replies without prompt and completion counts: their cost is unknown.
        self.unpriced, self.first_unpriced = 0, None

    def received(self, item_id: str, reply: Reply | None, error: ClientError | None) -> None:
        if reply is None:
            self.failures += 1
            self.attempts += error.attempts
            return
        self.replies += 1
        self.attempts += reply.attempts
        for key, value in (reply.usage or {}).items():
            self.tokens[key] = self.tokens.get(key, 0) + value
        if not _priceable(reply.usage):
            self.unpriced += 1
            self.first_unpriced = self.first_unpriced or item_id

    def cost(self, prices: Prices | None) -> float | None:
        return prices.cost(self.tokens)["total"] if prices is not None else None

    def to_json(self, prices: Prices | None) -> dict:
        totals = {
            "requests": self.requests,
            "replies": self.replies,
            "failures": self.failures,
            "attempts": self.attempts,
            "tokens": dict(self.tokens),
        }
        if prices is not None:
            totals["cost"] = self.cost(prices)
            totals["replies_without_usage"] = self.unpriced
        return totals


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one invocation may send (None: no limit): `max_requests` items asked, and requests
    while the cost of its replies is below `max_cost`."""

    max_requests: int | None = None
    max_cost: float | None = None

    def __post_init__(self):
        if self.max_requests is not None and not (
            isinstance(self.max_requests, int) and self.max_requests >= 0
        ):
            raise ValueError(
                f"--max-requests must be a non-negative integer, got {self.max_requests!r}"
            )
        if self.max_cost is not None and not (math.isfinite(self.max_cost) and self.max_cost >= 0):
            raise ValueError(f"--max-cost must be a non-negative number, got {self.max_cost!r}")

    def reached(self, spent: Spent, prices: Prices | None) -> tuple[str, str] | None:
        """(the limit, why) when the next request must not go out; None while it may."""
        if self.max_requests is not None and spent.requests >= self.max_requests:
            return "--max-requests", (
                f"--max-requests {self.max_requests} reached: this run sent {spent.requests} "
                "requests"
            )
        if self.max_cost is None:
            return None
        if spent.first_unpriced is not None:
            return "--max-cost", (
                f"--max-cost {self.max_cost:g} cannot be kept: the reply to item "
                f"{spent.first_unpriced!r} reports no prompt and completion token counts"
            )
        cost = spent.cost(prices)
        if cost >= self.max_cost:
            return "--max-cost", f"--max-cost {self.max_cost:g} reached: this run spent {cost:.6g}"
        return None


def _record(
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
    results = _json_safe(results)
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


def _limited(items: Iterable[Item], limit: int | None) -> Iterator[Item]:
    for k, item in enumerate(items):
        if limit is not None and k >= limit:
            return
        yield item


def _check_digests(benchmark: Benchmark, store: PredictionStore, limit: int | None) -> None:
    """Before anything is sent: every stored record must still match its item's prompt."""
    for item in _limited(benchmark.items(), limit):
        stored = store.records.get(item.id)
        if stored is not None and stored["digest"] != item.digest:
            raise RunError(
                f"{store.path}: item {item.id!r} was answered for another prompt or image "
                f"(digest {stored['digest'][:12]} there, {item.digest[:12]} now); "
                "use another --output"
            )


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------


def _dataset(benchmark: Benchmark) -> dict:
    """Where the benchmark's items come from, as its task keeps it: the built TFDS directories
    (DATA_DIR/NAME/CONFIG/VERSION; foci one per config, oodbench one) or the items file
    (counts-oodg), with digests. What the items are is the items digest's job."""
    builds = dict(getattr(benchmark, "directories", None) or {})
    one = getattr(benchmark, "directory", None)
    if isinstance(one, pathlib.Path):
        builds[one.parent.name] = one
    dataset: dict[str, Any] = {"name": benchmark.name}
    if builds:
        dataset["builds"] = [
            {
                "name": path.parent.parent.name,
                "config": path.parent.name,
                "version": path.name,
                "path": str(path.resolve()),
                "digest": manifest.tfds_digest(path)["sha256"],
            }
            for path in builds.values()
        ]
    items_file = getattr(benchmark, "path", None)
    if isinstance(items_file, pathlib.Path) and items_file.is_file():
        dataset["items_file"] = {
            "path": str(items_file.resolve()),
            "sha256": manifest.file_sha256(items_file),
        }
    return dataset


def _without_credentials(url: str) -> str:
    """An endpoint as a manifest may show it: no user, password or query (where keys hide)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# The load settings of ood_jax.eval.clients' clients a manifest reports, where a client has them.
_CLIENT_SETTINGS = (
    "api_key_env",
    "timeout_s",
    "max_attempts",
    "backoff_base_s",
    "max_retry_after_s",
    "device",
)


def _client_manifest(client: Client, limits: Limits, **options: Any) -> dict:
    """What the manifest says of a client run: the client's identity (and a local model's
    weights digest), where the requests went and how, the limits and the prices."""
    identity = client.identity()
    model = dict(identity)
    path = getattr(client, "path", None)
    if identity.get("client") == "transformers" and isinstance(path, str):
        model["weights"] = manifest.weights_digest(path)
    request = {}
    endpoint = getattr(client, "endpoint", None)
    if isinstance(endpoint, str):
        request["endpoint"] = _without_credentials(endpoint)
    request.update({k: getattr(client, k) for k in _CLIENT_SETTINGS if hasattr(client, k)})
    request.update(options, max_requests=limits.max_requests, max_cost=limits.max_cost)
    return {
        "model": model,
        "request": request,
        "packages": ("transformers", "torch") if identity.get("client") == "transformers" else (),
    }


def _ending(error: BaseException) -> dict:
    """The manifest's status (and its reason) for a run that `error` ended."""
    if isinstance(error, RunStopped):
        return {"status": "stopped", "reason": str(error)}
    return manifest.ending(error)


def _check_priced(limits: Limits, prices: Prices | None, directory: pathlib.Path) -> None:
    """A cost limit needs prices: given now, or kept in run.json by an earlier invocation."""
    if limits.max_cost is None or prices is not None:
        return
    if stored_prices(read_run_file(directory), directory / RUN_FILE) is None:
        raise RunError(
            f"--max-cost needs prices: --price-in and --price-out ({directory / RUN_FILE} "
            "keeps none yet)"
        )


class _Session:
    """What a run shares between its answering loop and its ending: store, ids, progress, what
    this invocation spent, and the manifest."""

    def __init__(
        self,
        benchmark: Benchmark,
        identity: dict,
        output: str | pathlib.Path,
        limit: int | None,
        progress: bool,
        strip_think: bool = False,
        warnings: Sequence[str] = (),
        parse_mode: str | None = None,
        judge: Judge | None = None,
        *,
        about: dict,
        prices: Prices | None = None,
    ):
        """`about`: the manifest's fields for this kind of run (`model`, `request`, and
        `packages` and `devices` for manifest.collect); `prices`: None keeps run.json's."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be non-negative, got {limit}")
        self.benchmark, self.identity, self.limit = benchmark, identity, limit
        self.strip_think, self.warnings = strip_think, list(warnings)
        self.judge, self.show_progress = judge, progress
        # Set by `pending` when the limit left items out: the results are then a subset's.
        self.subset = False
        self.directory = pathlib.Path(output)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_file = _check_run_file(self.directory, identity)
        self.scoring = _scoring_mode(self.directory, benchmark, self.run_file, parse_mode, judge)
        self.prices = (
            prices
            if prices is not None
            else stored_prices(self.run_file, self.directory / RUN_FILE)
        )
        self._write_run_file(
            judge=judge.identity() if judge is not None else None,
            # A new run records its mode at once, so that a killed one resumes with it.
            parse_mode=None if "parse_mode" in (self.run_file or {}) else self.scoring.parse_mode,
            prices=prices.to_json() if prices is not None else None,
        )
        self.store = PredictionStore(self.directory / PREDICTIONS_FILE)
        if self.store.records:
            _check_digests(benchmark, self.store, limit)
        self.order: list[str] = []
        self.failed = 0
        self.spent = Spent()
        self.served_models: set[str] = set()
        self.manifest = self._start_manifest(about)
        total = benchmark.count()
        if total is not None and limit is not None:
            total = min(total, limit)
        self.progress = Progress(total, benchmark.name, progress)

    def _start_manifest(self, about: dict) -> dict:
        about = dict(about)
        started = manifest.collect(
            "eval-mllm",
            devices=about.pop("devices", False),
            packages=about.pop("packages", ()),
            benchmark=self.benchmark.identity(),
            dataset=_dataset(self.benchmark),
            **about,
            prompts={"version": prompts.PROMPTS_VERSION},
            parser={"version": parsing.PARSER_VERSION, "parse_mode": self.scoring.parse_mode},
            judge=self.judge.identity() if self.judge is not None else None,
            strip_think=self.strip_think,
            limit=self.limit,
            prices=self.prices.to_json() if self.prices is not None else None,
        )
        try:
            manifest.write(self.directory, started)
        except manifest.ManifestError as e:
            raise RunError(str(e)) from None
        return started

    def _end_manifest(self, status: str, **fields: Any) -> None:
        manifest.finish(
            self.directory,
            self.manifest,
            status,
            served_models=sorted(self.served_models),
            totals=self.spent.to_json(self.prices),
            **fields,
        )

    def _write_run_file(self, **scoring: Any) -> None:
        """run.json: this run's identity (an older file, which matched it, gains the keys it
        lacked), then the scoring keys (a new judge, the results' mode, the prices); written
        when changed."""
        kept = {k: v for k, v in (self.run_file or {}).items() if k in SCORING_KEYS}
        kept.update({k: v for k, v in scoring.items() if v is not None})
        content = {**self.identity, **kept}
        if content != self.run_file:
            files.write_atomic(self.directory / RUN_FILE, json.dumps(content, indent=2) + "\n")
            self.run_file = content

    def pending(self) -> Iterator[Item]:
        """The run's items that still need a reply, in order; answered ones only tick the bar."""
        seen = set()
        for k, item in enumerate(self.benchmark.items()):
            if self.limit is not None and k == self.limit:
                # One item past the limit exists: this run covers a subset.
                self.subset = True
                return
            if item.id in seen:
                raise RunError(f"{self.benchmark.name}: item id {item.id!r} occurs twice")
            seen.add(item.id)
            self.order.append(item.id)
            stored = self.store.records.get(item.id)
            # The digest was checked up front; a changed item can only be new here.
            if stored is not None and stored["digest"] != item.digest:
                raise RunError(f"{self.store.path}: item {item.id!r} changed during the run")
            if stored is not None and stored["error"] is None:
                self.progress.update()
                continue
            yield item

    def sent(self, requests: int = 1) -> None:
        self.spent.requests += requests

    def record(
        self, item: Item, reply: Reply | None, error: ClientError | None, **postfix: Any
    ) -> None:
        self.store.append(_record(self.scoring, item, reply, error, self.strip_think))
        self.failed += error is not None
        self.spent.received(item.id, reply, error)
        if reply is not None and reply.model:
            self.served_models.add(reply.model)
        self.progress.update(failed=self.failed, **postfix)

    def finish(self) -> dict:
        """Judges, re-reads every reply, writes the results and ends the manifest."""
        try:
            results, json_name = self._write_results()
        except BaseException as error:
            self._end_manifest(**_ending(error))
            raise
        records = [self.store.records[i] for i in self.order]
        self._end_manifest(
            "complete" if results["complete"] else "incomplete",
            items={
                "count": len(records),
                "digest": manifest.items_digest((r["id"], r["digest"]) for r in records),
            },
            results={
                "file": json_name,
                "num_items": results["num_items"],
                "complete": results["complete"],
                "usage": results.get("usage", {}),
                **({"cost": results["cost"]["total"]} if "cost" in results else {}),
            },
        )
        return results

    def _write_results(self) -> tuple[dict, str]:
        self.progress.close()
        records = [self.store.records[i] for i in self.order]
        if self.judge is not None:
            self.judge.complete(self.scoring, records, self.show_progress)
        # Every reply read again under the run's mode, which may differ from the one it was
        # first read with: predictions.jsonl then says what the results count.
        for record in records:
            self.store.records[record["id"]] = scored(self.scoring, record)
        self.store.compact(self.order)
        records = [self.store.records[i] for i in self.order]
        limit = self.limit if self.subset else None
        results, markdown = build_results(
            self.scoring, self.identity, records, limit, self.warnings, self.prices
        )
        json_name, md_name = results_files(limit)
        files.write_atomic(self.directory / json_name, json.dumps(results, indent=2) + "\n")
        files.write_atomic(self.directory / md_name, markdown)
        self._write_run_file(parse_mode=self.scoring.parse_mode)
        return results, json_name

    def kept(self) -> int:
        return sum(r["error"] is None for r in self.store.records.values())

    def interrupted(self) -> KeyboardInterrupt:
        """What Ctrl-C re-raises: the one line ood_jax.cli prints says what was kept."""
        return KeyboardInterrupt(
            f"{self.kept()} replies kept in {self.store.path}; rerun the same command to continue"
        )

    def stopped(self, streak: "Streak") -> RunStopped:
        kept = self.kept()
        return RunStopped(
            f"{streak.count} items in a row failed with {streak.kind} (the last: {streak.last}); "
            f"{kept} replies kept in {self.store.path}",
            streak.kind,
            streak.last,
            kept,
        )

    def limit_reached(self, limit: str, why: str) -> LimitReached:
        kept = self.kept()
        return LimitReached(f"{why}; {kept} replies kept in {self.store.path}", limit, why, kept)

    def abort(self, error: BaseException) -> BaseException:
        """Closes what the run has open and ends the manifest with `error`'s status; returns
        `error`, for the caller to raise."""
        self.progress.close()
        self.store.close()
        self._end_manifest(**_ending(error))
        return error


class Streak:
    """Items in a row whose requests failed with the same kind of error."""

    def __init__(self, limit: int):
        self.limit, self.kind, self.count, self.last = limit, None, 0, ""

    def add(self, error: ClientError | None) -> bool:
        """Counts one finished item; True when the run should stop."""
        if error is None:
            self.kind, self.count = None, 0
            return False
        if error.kind != self.kind:
            self.kind, self.count = error.kind, 0
        self.count += 1
        self.last = str(error)
        return 0 < self.limit <= self.count


class _TooManyFailures(Exception):
    pass


class _LimitHit(Exception):
    def __init__(self, limit: str, why: str):
        super().__init__(why)
        self.limit, self.why = limit, why


class Workers:
    """`size` daemon threads answering jobs (items, or the judge's questions); (job, answer,
    error, crash) come back on `done`, from `ask(job)` -> (answer, error).

    Daemon threads, unlike ThreadPoolExecutor's (joined when the interpreter exits), let Ctrl-C
    end the process while a request is still out; `stop` also keeps them from taking more.
    """

    def __init__(self, size: int, ask: Callable[[Any], tuple[Any, ClientError | None]]):
        self._ask, self._size = ask, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        for k in range(size):
            threading.Thread(target=self._work, name=f"eval-mllm-{k}", daemon=True).start()

    def submit(self, job: Any) -> None:
        self._jobs.put(job)

    def next_done(self) -> tuple:
        # A timeout keeps the main thread where a signal can reach it on every platform.
        while True:
            try:
                return self.done.get(timeout=0.5)
            except queue.Empty:
                continue

    def stop(self) -> None:
        self._stopped.set()
        for _ in range(self._size):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopped.is_set():
                return
            try:
                answer, error = self._ask(job)
            # Whatever stops a call (a KeyboardInterrupt or SystemExit raised in this thread too)
            # goes to the main thread, which keeps the replies that arrived alongside.
            except BaseException as crash:
                # The run is over: no worker takes another job (one already queued would be
                # asked, and its reply never recorded).
                self._stopped.set()
                self.done.put((job, None, None, crash))
            else:
                self.done.put((job, answer, error, None))


def run(
    benchmark: Benchmark,
    client: Client,
    output: str | pathlib.Path,
    concurrency: int = DEFAULT_CONCURRENCY,
    limit: int | None = None,
    progress: bool = True,
    *,
    retry_budget: int | None = None,
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
    strip_think: bool = True,
    warnings: Sequence[str] = (),
    parse_mode: str | None = None,
    judge: Judge | None = None,
    prices: Prices | None = None,
    max_requests: int | None = None,
    max_cost: float | None = None,
) -> dict:
    """Asks `client` every item of `benchmark` not yet answered in `output`; returns the results.

    `limit`: only the first `limit` items (results beside the full ones, see the module
    docstring). Up to `concurrency` requests are in flight (1 for clients that say so; a client
    that takes a RunControl adapts below that). `retry_budget`: retries the whole run may make
    (None: clients.RetryBudget's default). `max_consecutive_failures`: items failing in a row
    with the same kind of error that stop the run with RunStopped (0: never). `strip_think`:
    `<think>` blocks are taken out of replies before scoring and kept as reasoning (part of the
    run's identity). `warnings`: what the results must say about how far to trust them (in
    results.json and results.md). `parse_mode`: how replies are read (None: the mode the
    directory's results were last written with, else the benchmark's default); `judge`: the
    judge parse mode's judge (ood_jax.eval.judge.Judge), asked at the end about every reply no
    rule reads. `prices`: what a million prompt and completion tokens cost (None: the prices
    run.json keeps, if any); `max_requests`, `max_cost`: this invocation's limits (see the
    module docstring), which stop the run with LimitReached. A request that fails for good
    (`ClientError`) is recorded with its error and retried by the next run; any other exception
    stops the run after recording the replies already received, and a KeyboardInterrupt is
    re-raised with a message saying how many replies were kept, and where. DIR/manifest.json
    is written at the start and at the end, however the run ends.
    """
    concurrency = min(concurrency, getattr(client, "concurrency_limit", concurrency))
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if max_consecutive_failures < 0:
        raise ValueError(
            f"max_consecutive_failures must be non-negative, got {max_consecutive_failures}"
        )
    limits = Limits(max_requests, max_cost)
    _check_priced(limits, prices, pathlib.Path(output))
    identity = {**benchmark.identity(), **client.identity(), "strip_think": strip_think}
    about = _client_manifest(
        client,
        limits,
        concurrency=concurrency,
        retry_budget=retry_budget,
        max_consecutive_failures=max_consecutive_failures,
    )
    session = _Session(
        benchmark,
        identity,
        output,
        limit,
        progress,
        strip_think,
        warnings,
        parse_mode,
        judge,
        about=about,
        prices=prices,
    )
    control = (
        RunControl(concurrency, retry_budget)
        if getattr(client, "accepts_run_control", False)
        else None
    )

    def ask(item: Item) -> tuple[Reply | None, ClientError | None]:
        try:
            if control is not None:
                return Reply.of(client.generate(item.request, control)), None
            return Reply.of(client.generate(item.request)), None
        except ClientError as e:
            return None, e

    workers = Workers(concurrency, ask)
    streak = Streak(max_consecutive_failures)
    in_flight = 0

    def settle(done: tuple) -> None:
        item, reply, error, crash = done
        if crash is not None:
            raise crash
        postfix = {"concurrency": control.limit.limit} if control is not None else {}
        session.record(item, reply, error, **postfix)
        if streak.add(error):
            raise _TooManyFailures

    try:
        hit = None
        for item in session.pending():
            # A bounded window keeps memory flat however many items there are.
            while in_flight >= 2 * concurrency - 1:
                in_flight -= 1
                settle(workers.next_done())
            # Checked before each request, against every reply settled so far (all of them
            # with concurrency 1).
            hit = limits.reached(session.spent, session.prices)
            if hit is not None:
                break
            workers.submit(item)
            session.sent()
            in_flight += 1
        # Requests already out finish, also after a limit: what they cost is spent.
        while in_flight:
            in_flight -= 1
            settle(workers.next_done())
        if hit is not None:
            raise _LimitHit(*hit)
    except BaseException as e:
        # Requests still out are abandoned, those not yet sent dropped; replies that already
        # came back are kept.
        if control is not None:
            control.abandon()
        workers.stop()
        _keep_finished(workers, session)
        if isinstance(e, KeyboardInterrupt):
            raise session.abort(session.interrupted()) from e
        if isinstance(e, _TooManyFailures):
            raise session.abort(session.stopped(streak)) from None
        if isinstance(e, _LimitHit):
            raise session.abort(session.limit_reached(e.limit, e.why)) from None
        session.abort(e)
        raise
    workers.stop()
    return session.finish()


def _keep_finished(workers: Workers, session: _Session) -> None:
    while True:
        try:
            item, reply, error, crash = workers.done.get_nowait()
        except queue.Empty:
            return
        if crash is None and not isinstance(error, Abandoned):
            session.record(item, reply, error)


def run_batched(
    benchmark: Benchmark,
    identity: dict,
    answer_batch: Callable[[list[Item]], list[str]],
    output: str | pathlib.Path,
    batch_size: int = 64,
    limit: int | None = None,
    progress: bool = True,
    parse_mode: str | None = None,
) -> dict:
    """`run` for answerers that work on batches (the CLIP baseline): same files, same resume,
    and a manifest whose "model" is `identity` and whose devices are jax's (they compute here)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    about = {"model": dict(identity), "request": {"batch_size": batch_size}, "devices": True}
    identity = {**benchmark.identity(), **identity}
    session = _Session(
        benchmark, identity, output, limit, progress, parse_mode=parse_mode, about=about
    )
    batch: list[Item] = []

    def flush() -> None:
        replies = answer_batch(batch)
        if len(replies) != len(batch):
            raise RuntimeError(f"answered {len(replies)} of a batch of {len(batch)} items")
        session.sent(len(batch))
        for item, reply in zip(batch, replies):
            session.record(item, Reply.of(reply), None)
        batch.clear()

    try:
        for item in session.pending():
            batch.append(item)
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise session.abort(session.interrupted()) from e
        session.abort(e)
        raise
    return session.finish()
