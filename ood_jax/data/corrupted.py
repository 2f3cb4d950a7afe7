"""How a corrupted dataset (`tfds_builders/corrupted`) is asked for and named.

A `Request` says which prepared dataset, which of its splits, which corruptions and which
severities; its config name (`Request.config_name`, e.g. `synthetic_shifts-tiny-3f9a0c51d2`) is
readable and collision-free. Each source split gives `{split}__clean` and one
`{split}__{corruption}_{severity}` per corruption and severity (`split_name`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ood_jax.data import corruptions

# Source split names (`train_snow`, `ood_s`) and corruption names hold single underscores, never
# two in a row, so the last "__" separates them; a source split holding "__" is refused.
SEPARATOR = "__"
CLEAN = "clean"
_DIGEST_CHARS = 10
_SEVERITY = {str(s): s for s in corruptions.SEVERITIES}  # as a split name or a flag spells it


class Split(NamedTuple):
    """What a split of a corrupted dataset holds; corruption and severity None when clean."""

    source: str
    corruption: str | None
    severity: int | None


def split_name(source: str, corruption: str | None = None, severity: int | None = None) -> str:
    """`{source}__clean`, or `{source}__{corruption}_{severity}`."""
    if corruption is None:
        return f"{source}{SEPARATOR}{CLEAN}"
    corruptions.check(corruption, severity)
    return f"{source}{SEPARATOR}{corruption}_{severity}"


def parse_split_name(name: str) -> Split | None:
    """The `Split` a `split_name` made; None for any other name."""
    source, separator, variant = name.rpartition(SEPARATOR)
    if not separator or not source:
        return None
    if variant == CLEAN:
        return Split(source, None, None)
    corruption, _, severity = variant.rpartition("_")
    if corruption not in corruptions.NAMES or severity not in _SEVERITY:
        return None
    return Split(source, corruption, _SEVERITY[severity])


def _items(value: str | Iterable, flag: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    items = [item.strip() for item in items if item.strip()]
    if not items:
        raise ValueError(f"{flag}: empty; give a comma-separated list")
    return items


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated, canonical request: corruptions in ImageNet-C's order, severities ascending,
    splits in the source's sorted order, each without repeats."""

    dataset: str
    corruptions: tuple[str, ...]
    severities: tuple[int, ...]
    splits: tuple[str, ...]

    @classmethod
    def create(
        cls,
        dataset: str,
        available_splits: Iterable[str],
        corruption_names: str | Sequence[str] = "all",
        severities: str | Sequence[int] = "all",
        splits: str | Sequence[str] | None = None,
    ) -> "Request":
        """Checks a request against the source's splits; errors name the flag and the value.

        "all" (the default) is every corruption or severity; `splits` None every source split.
        """
        if not re.fullmatch(r"[A-Za-z]\w*(/[\w.+-]+)?", dataset):
            raise ValueError(f"--dataset {dataset!r}: expected NAME or NAME/CONFIG")
        names = _items(corruption_names, "--corruptions")
        names = list(corruptions.NAMES) if names == ["all"] else names
        for name in names:
            if name not in corruptions.NAMES:
                raise ValueError(
                    f"--corruptions: unknown corruption {name!r}; the 15 are "
                    f"{', '.join(corruptions.NAMES)} (or all)"
                )
        levels = _items(severities, "--severities")
        levels = list(_SEVERITY) if levels == ["all"] else levels
        for level in levels:
            if level not in _SEVERITY:
                raise ValueError(
                    f"--severities: {level!r} is not a severity; they are 1-5 (or all)"
                )
        available = sorted(available_splits)
        for split in available:
            if SEPARATOR in split:
                raise ValueError(
                    f"--dataset {dataset}: its split {split!r} holds {SEPARATOR!r}, which "
                    "separates a source split from its corruption in a corrupted split's name"
                )
        chosen = available if splits is None else _items(splits, "--splits")
        for split in chosen:
            if split not in available:
                raise ValueError(
                    f"--splits: {dataset} has no split {split!r}; its splits are "
                    f"{', '.join(available)}"
                )
        return cls(
            dataset=dataset,
            corruptions=tuple(n for n in corruptions.NAMES if n in names),
            severities=tuple(sorted({_SEVERITY[s] for s in levels})),
            splits=tuple(s for s in available if s in chosen),
        )

    def settings(self) -> dict:
        """The request as the build record and description hold it."""
        return dataclasses.asdict(self) | {
            "corruptions": list(self.corruptions),
            "severities": list(self.severities),
            "splits": list(self.splits),
        }

    def config_name(self) -> str:
        """The source's name and a digest of the canonical request: two requests never share a
        directory, and the same request always finds its own."""
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode())
        return f"{self.dataset.replace('/', '-')}-{digest.hexdigest()[:_DIGEST_CHARS]}"

    def split_names(self) -> list[str]:
        """Every split the request writes, each source split's clean one first."""
        return [
            name
            for source in self.splits
            for name in (
                split_name(source),
                *(split_name(source, c, s) for c in self.corruptions for s in self.severities),
            )
        ]
