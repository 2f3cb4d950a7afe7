"""`ood-jax sweep --conventions domainbed` against DomainBed's own rules, on random toy runs.

DomainBed (facebookresearch/DomainBed) is no package, so its rules are restated below as they
read in its model_selection.py and collect_results.py, on records in its own format (one dict
per evaluated step: `args.test_envs`, `env{i}_in_acc`, `env{i}_out_acc`), and compared with
`selection.select` on the same numbers written as our evaluation records. Values come from a
coarse grid, so ties are common, and the training domains have different sizes, so pooling
their validation images and averaging over them disagree.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.stats

from ood_jax.train import selection, sweep

DOMAINS = ("snow", "fog", "night")  # training domains; env 3 is the target
TARGET = len(DOMAINS)
STEPS = (1, 2, 3, 4, 5)
GRID = np.linspace(0.0, 0.5, 6)  # few values: ties between steps are common


# ------------------------------------------------------------------------------------------------
# DomainBed's rules (model_selection.py, lib/query.py: Q.argmax is Python's max, the first of
# equal values wins), on DomainBed's records.
# ------------------------------------------------------------------------------------------------


def domainbed_training_domain(records: list[dict]) -> dict:
    """IIDAccuracySelectionMethod.run_acc: the mean of the training envs' out accuracies."""

    def step_acc(record: dict) -> dict:
        test_env = record["args"]["test_envs"][0]
        keys = []
        for i in itertools.count():
            if f"env{i}_out_acc" not in record:
                break
            if i != test_env:
                keys.append(f"env{i}_out_acc")
        return {
            "val_acc": np.mean([record[k] for k in keys]),
            "test_acc": record[f"env{test_env}_in_acc"],
        }

    test_records = [r for r in records if len(r["args"]["test_envs"]) == 1]
    return max(map(step_acc, test_records), key=lambda x: x["val_acc"])


def domainbed_oracle(records: list[dict]) -> dict:
    """OracleSelectionMethod.run_acc: the last step, valued by the test env's out accuracy."""
    test_records = [r for r in records if len(r["args"]["test_envs"]) == 1]
    test_env = test_records[0]["args"]["test_envs"][0]
    chosen = sorted(test_records, key=lambda r: r["step"])[-1]
    return {
        "val_acc": chosen[f"env{test_env}_out_acc"],
        "test_acc": chosen[f"env{test_env}_in_acc"],
    }


def domainbed_leave_one_out(records: list[dict]) -> dict | None:
    """LeaveOneOutSelectionMethod.run_acc: per step, the mean over the runs with one more
    test env of that env's in accuracy."""

    def step_acc(step_records: list[dict]) -> dict | None:
        test_records = [r for r in step_records if len(r["args"]["test_envs"]) == 1]
        if len(test_records) != 1:
            return None
        test_env = test_records[0]["args"]["test_envs"][0]
        n_envs = 0
        for i in itertools.count():
            if f"env{i}_out_acc" not in step_records[0]:
                break
            n_envs += 1
        val_accs = np.zeros(n_envs) - 1
        for r in (r for r in step_records if len(r["args"]["test_envs"]) == 2):
            val_env = (set(r["args"]["test_envs"]) - {test_env}).pop()
            val_accs[val_env] = r[f"env{val_env}_in_acc"]
        val_accs = list(val_accs[:test_env]) + list(val_accs[test_env + 1 :])
        if any(v == -1 for v in val_accs):
            return None
        return {
            "val_acc": np.sum(val_accs) / (n_envs - 1),
            "test_acc": test_records[0][f"env{test_env}_in_acc"],
        }

    by_step: dict[int, list[dict]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    accs = [a for a in map(step_acc, by_step.values()) if a is not None]
    return max(accs, key=lambda x: x["val_acc"]) if accs else None


# ------------------------------------------------------------------------------------------------
# One random toy run in both formats.
# ------------------------------------------------------------------------------------------------


def toy_run(rng: np.random.Generator) -> tuple[list[dict], dict, list[dict]]:
    """(our records, our left-out runs, DomainBed's records) of one seed. A step's test
    accuracy is its step number, so what DomainBed's rules return names the step."""
    ours, left_out = [], {d: [] for d in DOMAINS}
    theirs = []
    sizes = rng.choice([100, 400, 1500], size=len(DOMAINS))
    for step in STEPS:
        per_domain = {d: float(rng.choice(GRID)) for d in DOMAINS}
        pooled = float(np.average(list(per_domain.values()), weights=sizes))
        oracle = float(rng.choice(GRID))
        ours.append(
            {
                "step": step,
                selection.VALIDATION: {"AP": pooled},
                selection.VALIDATION_BY_DOMAIN: {d: {"AP": v} for d, v in per_domain.items()},
                "oracle_average": oracle,
            }
        )
        envs = {f"env{i}_out_acc": per_domain[d] for i, d in enumerate(DOMAINS)}
        envs |= {f"env{i}_in_acc": -1.0 for i in range(len(DOMAINS))}
        envs |= {f"env{TARGET}_out_acc": oracle, f"env{TARGET}_in_acc": float(step)}
        theirs.append({"args": {"test_envs": [TARGET]}, "step": step, **envs})
        for i, d in enumerate(DOMAINS):
            held = float(rng.choice(GRID))
            left_out[d].append({"step": step, selection.LEFT_OUT: {"AP": held}})
            theirs.append(
                {"args": {"test_envs": [TARGET, i]}, "step": step, **envs, f"env{i}_in_acc": held}
            )
    return ours, left_out, theirs


RULES = {
    "training_domain": domainbed_training_domain,
    "oracle": domainbed_oracle,
    "leave_one_domain_out": domainbed_leave_one_out,
}


@pytest.mark.parametrize("protocol", sorted(RULES))
def test_selection_is_domainbed_s_on_random_runs(protocol):
    rng = np.random.default_rng(0)
    differ = 0
    for _ in range(200):
        ours, left_out, theirs = toy_run(rng)
        expected = RULES[protocol](theirs)
        chosen = selection.select(protocol, ours, left_out, conventions="domainbed")
        assert chosen.step == int(expected["test_acc"])
        assert chosen.value == pytest.approx(expected["val_acc"], abs=1e-12)
        differ += selection.select(protocol, ours, left_out).step != chosen.step
    assert differ > 0  # our own conventions are another rule on these runs


def test_the_spread_is_domainbed_s_standard_error():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 5):
        per_seed = [
            {"iid": rng.random(), "per_domain": {"sky": rng.random()}, "ood_average": rng.random()}
            for _ in range(n)
        ]
        spread = sweep.mean_and_spread(per_seed, ["sky"], "domainbed")["standard_error"]
        values = np.array([e["ood_average"] for e in per_seed])
        # collect_results.py's format_mean: np.std(data / sqrt(n)), the population std / sqrt(n)
        # (0 for one seed, where scipy has no value)
        expected = scipy.stats.sem(values, ddof=0) if n > 1 else 0.0
        assert spread["ood_average"] == pytest.approx(expected, abs=1e-15)
        ours = sweep.mean_and_spread(per_seed, ["sky"], "ours")["std"]["ood_average"]
        assert ours == (None if n == 1 else pytest.approx(np.std(values, ddof=1)))


def test_records_without_the_per_domain_validation_are_refused():
    records = [{"step": 1, selection.VALIDATION: {"AP": 0.1}}]
    with pytest.raises(ValueError, match="no validation AP per training domain"):
        selection.select("training_domain", records, conventions="domainbed")
    with pytest.raises(ValueError, match="unknown conventions 'pytorch'"):
        selection.select("last", records, conventions="pytorch")
