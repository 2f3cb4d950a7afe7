"""A paired bootstrap of two detectors' AP on the same splits (`ood-jax compare-detectors`),
from the per-image matches each workdir keeps; this module owns that file (matches.npz). How the
resamples are paired: docs/guide/detectors.md, "Intervals and comparing detectors"."""

from __future__ import annotations

import io
import pathlib
from typing import Any, Mapping

import numpy as np

from ood_jax import files
from ood_jax.metrics import bootstrap, coco

MATCHES_FILE = "matches.npz"
_FORMAT = 1
STATS = bootstrap.STATS
DEFAULT_RESAMPLES = 1000


def write_matches(workdir: str | pathlib.Path, matches: Mapping[str, coco.Matches]) -> None:
    """matches.npz in `workdir`, atomically: every split's `coco.Matches` (split -> matches)."""
    arrays: dict[str, np.ndarray] = {
        "format": np.asarray(_FORMAT),
        "splits": np.asarray(list(matches), dtype=str),
    }
    for index, m in enumerate(matches.values()):
        # Keys by position, not by name: a split name is free text, a zip member name is not.
        arrays.update({f"{index}.{field}": value for field, value in m.arrays().items()})
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    files.write_atomic(pathlib.Path(workdir) / MATCHES_FILE, buffer.getvalue())


def read_matches(workdir: str | pathlib.Path) -> dict[str, coco.Matches]:
    """What `write_matches` wrote, checked; ValueError naming the file and field otherwise."""
    path = pathlib.Path(workdir) / MATCHES_FILE
    if not path.is_file():
        raise ValueError(
            f"{path}: not found; evaluate the workdir first (ood-jax evaluate) to write it"
        )
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a matches file ({e})") from None
    with data:
        for field in ("format", "splits"):
            if field not in data.files:
                raise ValueError(f"{path}: missing field '{field}'")
        if int(data["format"]) != _FORMAT:
            raise ValueError(
                f"{path}: field 'format' is {int(data['format'])}; this version reads {_FORMAT}"
            )
        out = {}
        for index, split in enumerate(data["splits"].tolist()):
            arrays = {
                key.partition(".")[2]: data[key]
                for key in data.files
                if key.partition(".")[0] == str(index)
            }
            out[split] = coco.Matches.from_saved(arrays, f"{path} split '{split}'")
    return out


def check_comparable(
    a: Mapping[str, coco.Matches], b: Mapping[str, coco.Matches], name_a: str, name_b: str
) -> None:
    """ValueError (one line) unless both hold the same splits, each with the same images,
    categories and ground truth."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"{name_a} and {name_b} were evaluated on different splits: only {name_a} has "
            f"{only_a or 'none'}, only {name_b} has {only_b or 'none'}"
        )
    for split in a:
        ma, mb = a[split], b[split]
        if not np.array_equal(ma.image_ids, mb.image_ids):
            ids_a, ids_b = set(ma.image_ids.tolist()), set(mb.image_ids.tolist())
            raise ValueError(
                f"split '{split}': {name_a} and {name_b} hold different images "
                f"({len(ids_a)} and {len(ids_b)}; {len(ids_a - ids_b)} only in {name_a}, "
                f"{len(ids_b - ids_a)} only in {name_b})"
            )
        if not np.array_equal(ma.category_ids, mb.category_ids):
            raise ValueError(f"split '{split}': {name_a} and {name_b} have different categories")
        if ma.ground_truth != mb.ground_truth or not np.array_equal(
            ma.num_positive, mb.num_positive
        ):
            raise ValueError(
                f"split '{split}': {name_a} and {name_b} have the same images but different "
                f"ground truth (digests {ma.ground_truth[:12]} and {mb.ground_truth[:12]})"
            )


def paired(
    a: Mapping[str, coco.Matches],
    b: Mapping[str, coco.Matches],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """The paired bootstrap of comparable matches (`check_comparable`): per split and for the
    OOD average (every split but "iid"), each stat's A, B, A - B, interval and p-value."""
    plain_a, plain_b, diff = {}, {}, {}
    for split in a:
        num_images = len(a[split].image_ids)
        # Row 0: every image once, the plain evaluation; the others the split's resamples,
        # shared by both detectors.
        weights = np.concatenate(
            [
                np.ones((1, num_images), np.int32),
                bootstrap.resample_weights(num_images, resamples, seed, stream=split),
            ]
        )
        ra = {k: bootstrap.defined(v) for k, v in bootstrap.ap_resamples(a[split], weights).items()}
        rb = {k: bootstrap.defined(v) for k, v in bootstrap.ap_resamples(b[split], weights).items()}
        plain_a[split] = {k: v[0] for k, v in ra.items()}
        plain_b[split] = {k: v[0] for k, v in rb.items()}
        diff[split] = {k: ra[k][1:] - rb[k][1:] for k in STATS}
    rows = {split: _row(plain_a[split], plain_b[split], diff[split], confidence) for split in a}
    domains = [s for s in a if s != "iid"]
    if domains:
        rows["ood_average"] = _row(
            {k: float(np.mean([plain_a[d][k] for d in domains])) for k in STATS},
            {k: float(np.mean([plain_b[d][k] for d in domains])) for k in STATS},
            bootstrap.average([diff[d] for d in domains]),
            confidence,
        )
    return {
        "method": "paired percentile bootstrap over images",
        "resamples": resamples,
        "confidence": confidence,
        "seed": seed,
        "splits": rows,
    }


def _row(plain_a, plain_b, diff, confidence) -> dict[str, dict[str, float | None]]:
    out = {}
    for k in STATS:
        low, high = bootstrap.percentile_interval(diff[k], confidence)
        out[k] = {
            "a": _finite(plain_a[k]),
            "b": _finite(plain_b[k]),
            "difference": _finite(plain_a[k] - plain_b[k]),
            "low": _finite(low),
            "high": _finite(high),
            "p_value": _finite(bootstrap.paired_p_value(diff[k])),
        }
    return out


def _finite(value: float) -> float | None:
    """JSON has no NaN: an undefined number (no ground truth) is null."""
    return None if np.isnan(value) else float(value)


def compare(
    workdir_a: str | pathlib.Path,
    workdir_b: str | pathlib.Path,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """`paired` on two workdirs' saved matches, after `check_comparable`."""
    a, b = read_matches(workdir_a), read_matches(workdir_b)
    check_comparable(a, b, str(workdir_a), str(workdir_b))
    result = paired(a, b, resamples, seed, confidence)
    return {"a": str(workdir_a), "b": str(workdir_b), **result}


def format_table(result: Mapping[str, Any], stat: str = "AP") -> str:
    """The comparison as text: one row per split, then the OOD average."""
    level = f"{100 * result['confidence']:g}%"
    lines = [
        f"A = {result['a']}",
        f"B = {result['b']}",
        f"COCO {stat}; {result['resamples']} paired resamples of each split's images "
        f"(seed {result['seed']}), {level} percentile intervals of A - B",
        "",
        f"{'split':<14}{'A':>8}{'B':>8}{'A - B':>9}  {level + ' interval':<20}{'p':>7}",
    ]
    for split, row in result["splits"].items():
        r = row[stat]
        interval = "n/a" if r["low"] is None else f"[{r['low']:+.3f}, {r['high']:+.3f}]"
        lines.append(
            f"{split:<14}{_number(r['a']):>8}{_number(r['b']):>8}"
            f"{_number(r['difference'], sign=True):>9}  {interval:<20}{_number(r['p_value']):>7}"
        )
    return "\n".join(lines)


def _number(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if sign else f"{value:.3f}"
