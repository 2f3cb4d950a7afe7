"""What a run costs and may spend: token prices, this invocation's totals (`Spent`) and its
limits (`Limits`: --max-requests, --max-cost), checked before each request."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence

from ood_jax.eval.clients import ClientError, Reply
from ood_jax.eval.store import RUN_FILE, RunError, read_run_file

# Token prices are per this many tokens, as vendors quote them.
PRICE_UNIT_TOKENS = 1_000_000


def usage_total(records: Sequence[dict]) -> dict:
    total: dict[str, int] = {}
    for record in records:
        for key, value in (record.get("usage") or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def priceable(usage: dict | None) -> bool:
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
    usage = usage_total(records)
    unpriced = sum(r["error"] is None and not priceable(r.get("usage")) for r in records)
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
        if not priceable(reply.usage):
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


def check_priced(limits: Limits, prices: Prices | None, directory: pathlib.Path) -> None:
    """A cost limit needs prices: given now, or kept in run.json by an earlier invocation."""
    if limits.max_cost is None or prices is not None:
        return
    if stored_prices(read_run_file(directory), directory / RUN_FILE) is None:
        raise RunError(
            f"--max-cost needs prices: --price-in and --price-out ({directory / RUN_FILE} "
            "keeps none yet)"
        )
