"""Circular evaluation (`eval-mllm --circular N`): what FOCI and OODBench share of it, the
rotations an item is asked under (each its own item, `<id>#rot<s>`) and the summaries of
"circular_eval". How the rotations are drawn: docs/guide/mllm.md, "Circular evaluation"."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from ood_jax.eval.tasks.base import interval, pct, pct_ci

# Changing it draws other shifts for N < K: other prompts, so other digests.
SEED = "ood-jax circular v1"
ID_SUFFIX = "#rot"


def check_rotations(n: int | None, options: int, benchmark: str) -> None:
    """Raises ValueError unless `n` (None: a plain run) is a number of rotations of `options`."""
    if n is None:
        return
    if not 2 <= n <= options:
        allowed = "2" if options == 2 else f"2 to {options}"
        raise ValueError(
            f"--circular takes {allowed} for {benchmark} (its questions have {options} options; "
            f"a plain run has no --circular), got {n}"
        )


def asked_per_question(n: int | None) -> int:
    """How many items one question becomes: N with --circular N, else one."""
    return n or 1


def rotate(options: Sequence[Any], shift: int) -> list:
    """`options` cyclically shifted by `shift`: listed from the shift-th on, wrapping around."""
    return list(options[shift:]) + list(options[:shift])


@dataclasses.dataclass(frozen=True)
class Rotation:
    """One order a question is asked in: its item id, the shift, and the meta it adds."""

    id: str
    shift: int
    size: int
    tags: dict

    def apply(self, options: Sequence[Any]) -> list:
        """The options in this rotation's order."""
        return rotate(options, self.shift)

    def position(self, index: int) -> int:
        """Where the original option `index` is listed under this rotation."""
        return (index - self.shift) % self.size


def _shifts(item_id: str, n: int, size: int) -> list[int]:
    def draw(shift: int) -> bytes:
        return hashlib.sha256(f"{SEED}\0{item_id}\0{shift}".encode()).digest()

    return [0, *sorted(sorted(range(1, size), key=draw)[: n - 1])]


def rotations(item_id: str, n: int | None, size: int) -> Iterator[Rotation]:
    """The orders question `item_id` with `size` options is asked in: the original alone, with
    no tags, for a plain run (`n` None); else the original and n - 1 other cyclic shifts."""
    if n is None:
        yield Rotation(item_id, 0, size, {})
        return
    for shift in _shifts(item_id, n, size):
        rotated_id = item_id if shift == 0 else f"{item_id}{ID_SUFFIX}{shift}"
        yield Rotation(rotated_id, shift, size, {"rotation": shift, "rotation_of": item_id})


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def question_of(record: dict) -> str:
    """The circular group of an asked item: the question it is a rotation of."""
    return record["meta"]["rotation_of"]


def _rate(name: str, points: Sequence[bool]) -> dict:
    k, n = sum(points), len(points)
    return {name: k / n if n else float("nan"), f"{name}_ci": interval(k, n)}


def all_right(records: Sequence[dict], size: int, key: Callable[[dict], Hashable]) -> dict:
    """Over the groups of `records` by `key` that hold all `size` of their items: the share right
    in the original order alone ("original_order", every rotation-0 item of the group right) and
    under every rotation ("all_right"), with their intervals; "groups" counts them and
    "incomplete" the groups left out for missing items (a --limit cut them)."""
    groups: dict[Hashable, list[dict]] = collections.defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    oversized = [g for g, members in groups.items() if len(members) > size]
    if oversized:
        raise ValueError(
            f"circular group {oversized[0]!r} holds {len(groups[oversized[0]])} items, more "
            f"than the {size} a group has: its records are not of one circular run"
        )
    complete = [members for members in groups.values() if len(members) == size]
    return {
        **_rate(
            "original_order",
            [all(r["correct"] for r in g if r["meta"]["rotation"] == 0) for g in complete],
        ),
        **_rate("all_right", [all(r["correct"] for r in g) for g in complete]),
        "groups": len(complete),
        "incomplete": len(groups) - len(complete),
    }


def pick_rates(
    records: Sequence[dict], labels: Sequence[str], position: Callable[[dict, Any], int]
) -> dict:
    """Over the replies read (a parsed answer): the share picking the option listed at each
    position, and the share whose answer is listed there; `position(record, answer)` is where
    `answer` (a parsed value, or the meta's answer) is listed in that record's prompt."""
    read = [r for r in records if r["parsed"] is not None]
    picked = collections.Counter(position(r, r["parsed"]) for r in read)
    truth = collections.Counter(position(r, r["meta"]["answer"]) for r in read)
    n = len(read)

    def shares(counts: collections.Counter) -> dict:
        return {label: counts[k] / n if n else float("nan") for k, label in enumerate(labels)}

    return {"picked": shares(picked), "answer": shares(truth), "read": n}


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def rate_cells(summary: dict) -> list[str]:
    """The original-order and all-rotations shares of an `all_right` summary, as table cells."""
    return [
        pct_ci(summary["original_order"], summary["original_order_ci"]),
        pct_ci(summary["all_right"], summary["all_right_ci"]),
    ]


def shares_cells(shares: dict) -> list[str]:
    return [pct(value) for value in shares.values()]


def incomplete_note(incomplete: int, what: str) -> str:
    """The sentence saying how many groups (`what` they are) the circular numbers leave out;
    "" when none."""
    return f" Left out of them: {what}, {incomplete}." if incomplete else ""
