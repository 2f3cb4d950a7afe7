"""Model selection for O(OD)^2: which of a run's evaluated checkpoints a protocol reports.

The protocols (`PROTOCOLS`) are DomainBed's (Gulrajani & Lopez-Paz 2020, "In Search of Lost
Domain Generalization", section 3) with COCO AP in place of accuracy, plus the COUNTS paper's
own, `last`. Candidates are the steps a run evaluated (`evaluation_record`, kept in
WORKDIR/evaluations.json). The rules, and where they differ from DomainBed:
docs/guide/model-selection.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from ood_jax import files
from ood_jax.data import counts, iteration
from ood_jax.metrics import bootstrap, coco

PROTOCOLS = {
    "last": "last checkpoint (the COUNTS paper's)",
    "training_domain": "training-domain validation",
    "leave_one_domain_out": "leave-one-domain-out cross-validation",
    "oracle": "test-domain oracle (upper bound: selects on test images)",
}
# The splits model selection adds to a run's evaluation (never a domain's name).
VALIDATION, LEFT_OUT = "validation", "left_out"
SPLITS = (VALIDATION, LEFT_OUT)
VALIDATION_BY_DOMAIN = "validation_by_domain"
EVALUATIONS_FILE = "evaluations.json"
ORACLE_FRACTION = 0.2  # DomainBed's share of a test domain for its oracle; the configs' default
# How a sweep selects and summarizes (docs/guide/model-selection.md): ours, or DomainBed's own
# model_selection.py and collect_results.py.
CONVENTIONS = {
    "ours": "ties to the later step; the oracle's best step; validation AP on the pooled "
    "validation images; mean ± sample std",
    "domainbed": "DomainBed's: ties to the earlier step; the oracle's last step; validation AP "
    "averaged over the training domains; mean ± standard error",
}


def selection_splits(
    splits: Mapping[str, str],
    builder: tfds.core.DatasetBuilder,
    dataset: ml_collections.ConfigDict,
    selection: ml_collections.ConfigDict,
    seed: int,
) -> dict[str, str]:
    """`splits` (`counts.held_out_split_expressions`'s) with what `selection` asks for: without
    `selection.leave_out`'s training images and the validation slice in "train", and those as
    LEFT_OUT and VALIDATION."""
    splits = dict(splits)
    if selection.leave_out:
        domain = counts.canonical_domain(selection.leave_out)
        if domain in {counts.canonical_domain(t) for t in dataset.target_domains}:
            raise ValueError(
                f"config.selection.leave_out: {domain} is a target domain; leave out one of "
                "the training domains"
            )
        kept = counts.held_out_split_expressions(
            builder.info.splits.keys(),
            (*dataset.target_domains, domain),
            train_split=dataset.train_split,
            test_split=dataset.test_split,
        )["train"].split("+")
        splits[LEFT_OUT] = "+".join(s for s in splits["train"].split("+") if s not in kept)
        if not splits[LEFT_OUT]:
            raise ValueError(f"config.selection.leave_out: no training image carries {domain}")
        splits["train"] = "+".join(kept)
    if selection.val_fraction:
        sizes = {name: info.num_examples for name, info in builder.info.splits.items()}
        splits["train"], splits[VALIDATION] = counts.hold_out_windows(
            splits["train"], sizes, selection.val_fraction, seed
        )
        if not splits[VALIDATION] or not splits["train"]:
            raise ValueError(
                f"config.selection.val_fraction: {selection.val_fraction} of each training "
                f"split leaves {'no validation' if splits['train'] else 'no training'} image"
            )
    return splits


def oracle_mask(image_ids: np.ndarray, fraction: float, seed: int, domain: str) -> np.ndarray:
    """Which of a target's test images the oracle selects on: round(fraction * n) of them,
    at least one, drawn from (seed, domain) whatever order `image_ids` lists them in."""
    order = np.argsort(image_ids, kind="stable")
    rng = np.random.default_rng([seed, zlib.crc32(domain.encode())])
    chosen = order[rng.permutation(len(order))[: max(1, round(fraction * len(order)))]]
    mask = np.zeros(len(order), bool)
    mask[chosen] = True
    return mask


def subset_ap(matches: coco.Matches, mask: np.ndarray) -> dict[str, float]:
    """AP, AP50, AP75 of the images `mask` keeps, from the evaluation's own per-image matches
    (`bootstrap.ap_resamples` with 0/1 weights): exactly what evaluating the subset alone
    gives."""
    stats = bootstrap.ap_resamples(matches, mask[None].astype(np.int32))
    return {name: float(values[0]) for name, values in stats.items()}


def validation_domains(builder: tfds.core.DatasetBuilder, split: str) -> dict[str, np.ndarray]:
    """Training domain -> the sorted image ids of the validation slice `split` that carry it (a
    COUNTS image may carry several): what DomainBed's training-domain validation averages over."""
    features = builder.info.features
    names = features["domain"].names
    key = "domains" if "domains" in features else "domain"
    dataset = builder.as_dataset(
        split=split, decoders={"image": tfds.decode.SkipDecoding()}, shuffle_files=False
    )
    ids: dict[str, list[int]] = {}
    for example in iteration.numpy_iterator(dataset):
        for index in np.atleast_1d(example[key]):
            ids.setdefault(names[int(index)], []).append(int(example["image/id"]))
    return {name: np.unique(ids[name]) for name in names if name in ids}


def evaluation_record(
    step: int,
    evaluated: Mapping[str, coco.CocoEvalResult],
    selection: ml_collections.ConfigDict | None,
    seed: int,
    validation_by_domain: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """What evaluations.json keeps of one evaluation: the 12 COCO numbers of every evaluated
    split, their mean over the targets, each target's AP on its oracle slice with their mean
    (the oracle's criterion), and the validation slice's AP per training domain
    (`validation_by_domain`, `validation_domains`'s)."""
    fraction = selection.oracle_fraction if selection else ORACLE_FRACTION
    targets = [name for name in evaluated if name != "iid" and name not in SPLITS]
    record: dict[str, Any] = {
        "step": int(step),
        "iid": evaluated["iid"].stats,
        "per_domain": {t: evaluated[t].stats for t in targets},
        "ood_average": {
            k: float(np.mean([evaluated[t].stats[k] for t in targets])) for k in coco.STAT_NAMES
        },
    }
    record.update({name: evaluated[name].stats for name in SPLITS if name in evaluated})
    if VALIDATION in evaluated and validation_by_domain:
        matches = evaluated[VALIDATION].matches
        record[VALIDATION_BY_DOMAIN] = {
            domain: subset_ap(matches, np.isin(matches.image_ids, ids))
            for domain, ids in validation_by_domain.items()
        }
    record["oracle"] = {
        t: subset_ap(
            evaluated[t].matches, oracle_mask(evaluated[t].matches.image_ids, fraction, seed, t)
        )
        for t in targets
    }
    record["oracle_average"] = float(np.mean([v["AP"] for v in record["oracle"].values()]))
    return record


def read_evaluations(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    """The evaluation records of a workdir, by step; none when it has no evaluations.json."""
    path = pathlib.Path(workdir) / EVALUATIONS_FILE
    if not path.is_file():
        return []
    return json.loads(path.read_text())["evaluations"]


def write_evaluations(workdir: str | pathlib.Path, records: Sequence[Mapping[str, Any]]) -> None:
    files.write_json_atomic(
        pathlib.Path(workdir) / EVALUATIONS_FILE,
        {"evaluations": sorted(records, key=lambda r: r["step"])},
    )


@dataclasses.dataclass(frozen=True)
class Selected:
    """A protocol's choice in one seed's runs: the step, the value it was chosen by (None for
    `last`), and the reported run's record at that step."""

    step: int
    value: float | None
    record: Mapping[str, Any]


def _argmax(values: Mapping[int, float], later_on_ties: bool) -> int:
    """The step of the highest value. Ours gives a tie to the later step, so a criterion that
    cannot tell steps apart selects what `last` does; DomainBed's (`Q.argmax`, Python's max over
    the steps in order) to the earlier."""
    return max(values, key=lambda step: (values[step], step if later_on_ties else -step))


def select(
    protocol: str,
    records: Sequence[Mapping[str, Any]],
    left_out: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    conventions: str = "ours",
) -> Selected:
    """The step `protocol` selects among a run's evaluation `records` by `conventions`
    (CONVENTIONS); leave_one_domain_out also reads `left_out` (left-out domain -> the records
    of the run without it), over the steps every one of those runs and this one evaluated."""
    if conventions not in CONVENTIONS:
        raise ValueError(
            f"unknown conventions {conventions!r}; expected one of {', '.join(CONVENTIONS)}"
        )
    if not records:
        raise ValueError("no evaluation records to select from")
    domainbed = conventions == "domainbed"
    by_step = {r["step"]: r for r in records}
    if protocol == "last":
        step = max(by_step)
        return Selected(step, None, by_step[step])
    if protocol == "oracle" and domainbed:
        # DomainBed's oracle selects hyperparameters on the test domains but stops no earlier
        # than the last step.
        step = max(by_step)
        return Selected(step, float(by_step[step]["oracle_average"]), by_step[step])
    if protocol == "training_domain":
        if any(VALIDATION not in r for r in records):
            raise ValueError(
                "training_domain: the runs have no validation slice; train them with "
                "config.selection.val_fraction > 0"
            )
        if not domainbed:
            values = {s: r[VALIDATION]["AP"] for s, r in by_step.items()}
        elif any(VALIDATION_BY_DOMAIN not in r for r in records):
            raise ValueError(
                f"training_domain with DomainBed's conventions: the runs' {EVALUATIONS_FILE} "
                "have no validation AP per training domain (runs evaluated before ood-jax "
                "recorded it); train them again in a fresh --workdir"
            )
        else:
            values = {
                s: float(np.mean([v["AP"] for v in r[VALIDATION_BY_DOMAIN].values()]))
                for s, r in by_step.items()
            }
    elif protocol == "oracle":
        values = {s: r["oracle_average"] for s, r in by_step.items()}
    elif protocol == "leave_one_domain_out":
        if not left_out:
            raise ValueError("leave_one_domain_out: no runs with a training domain left out")
        runs = {d: {r["step"]: r[LEFT_OUT]["AP"] for r in rs} for d, rs in left_out.items()}
        steps = set(by_step).intersection(*runs.values())
        if not steps:
            raise ValueError("leave_one_domain_out: the runs evaluated no step in common")
        values = {s: float(np.mean([run[s] for run in runs.values()])) for s in steps}
    else:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    step = _argmax(values, later_on_ties=not domainbed)
    return Selected(step, float(values[step]), by_step[step])
