"""`ood-jax compare` (ood_jax.eval.compare, ood_jax.cli.compare) on run directories written here by hand: seeded
random answers, a few dozen items per group. Scores and intervals are checked against
statsmodels (Clopper-Pearson and Wilson intervals, McNemar exact) and sklearn (accuracy, F1,
MCC), the difference intervals and bootstrap p-values against a slow numpy loop replaying the
same resamples, and the scores of runs without failed requests against the benchmarks' own
results (what results.json holds).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from ood_jax.cli import compare as compare_cli
from ood_jax.eval import compare
from ood_jax.eval.tasks.oodbench import bap_results, yes_no_results

BOOTSTRAP = 300


def write_run(directory: pathlib.Path, benchmark: str, records: list[dict], **identity) -> str:
    directory.mkdir(parents=True)
    run = {"benchmark": benchmark, "client": "openai", "model": "model-a", **identity}
    (directory / "run.json").write_text(json.dumps(run))
    (directory / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(directory)


def record(item_id: str, meta: dict, parsed, correct, error: str | None = None) -> dict:
    """A predictions.jsonl line as the runner writes it (a failed request: no reply, wrong)."""
    return {
        "id": item_id,
        "digest": f"sha256-of-{item_id}",
        "outcome": "error" if error else "answered",
        "reply": None if error else str(parsed),
        "parsed": None if error else parsed,
        "correct": False if error else correct,
        "error": error,
        "meta": meta,
    }


def _failure(rng: np.random.Generator, p_error: float) -> str | None:
    return "HTTP 500: upstream error" if rng.random() < p_error else None


def foci_records(seed: int, p_right: float, p_error: float = 0.1) -> list[dict]:
    answers = np.random.default_rng(100)  # the data: the same in every run
    rng = np.random.default_rng(seed)  # the model's answers
    records = []
    for dataset in ("food101", "flowers102"):
        for k in range(30):
            answer = int(answers.integers(0, 4))
            if rng.random() < p_right:
                parsed = answer
            else:
                parsed = None if rng.random() < 0.2 else int((answer + rng.integers(1, 4)) % 4)
            meta = {"dataset": dataset, "options": ["a", "b", "c", "d"], "answer": answer}
            records.append(
                record(f"{dataset}/{k}.jpg", meta, parsed, parsed == answer, _failure(rng, p_error))
            )
    return records


def oodbench_records(seed: int, p_right: float, p_error: float = 0.1) -> list[dict]:
    answers = np.random.default_rng(200)
    rng = np.random.default_rng(seed)
    records = []
    for split in ("id", "ood_s", "ood_h"):
        for k in range(40):
            answer = bool(answers.random() < 0.5)
            parsed = answer if rng.random() < p_right else rng.choice([not answer, None])
            meta = {"split": split, "answer": answer, "category": "dog", "kind": "positive"}
            error = _failure(rng, p_error)
            records.append(record(f"{split}/{k}/dog", meta, parsed, parsed == answer, error))
    return records


def slow_bootstrap(metric, a: tuple, b: tuple, seed: int = 0) -> dict:
    """The paired bootstrap one resample at a time, each metric computed by `metric(*arrays)`."""
    rng = np.random.default_rng(seed)
    n = len(a[0])
    da, db = np.empty(BOOTSTRAP), np.empty(BOOTSTRAP)
    for k in range(BOOTSTRAP):
        index = rng.integers(0, n, n)
        da[k], db[k] = metric(*(x[index] for x in a)), metric(*(x[index] for x in b))
    observed = metric(*b) - metric(*a)
    tails = [0.025, 0.975]
    return {
        "a": np.quantile(da, tails),
        "b": np.quantile(db, tails),
        "difference": np.quantile(db - da, tails),
        "p_value": (1 + np.sum(np.abs(db - da - observed) >= abs(observed))) / (1 + BOOTSTRAP),
    }


def run_compare(tmp_path, benchmark, records_a, records_b, **kwargs) -> dict:
    a = write_run(tmp_path / "a", benchmark, records_a)
    b = write_run(tmp_path / "b", benchmark, records_b, model="model-b")
    return compare.compare_runs(a, b, num_bootstrap=BOOTSTRAP, **kwargs)


def kept_pairs(records_a, records_b, keep=lambda r: True):
    return [
        (ra, rb)
        for ra, rb in zip(records_a, records_b)
        if keep(ra) and ra["error"] is None and rb["error"] is None
    ]


def rows_by(result: dict) -> dict:
    return {(r["group"], r["metric"]): r for r in result["rows"]}


# --- FOCI: accuracy, its intervals, McNemar --------------------------------------------------


def _check_accuracy_row(row: dict, pairs: list, interval: str = "clopper-pearson") -> None:
    right_a = np.array([ra["correct"] for ra, _ in pairs], float)
    right_b = np.array([rb["correct"] for _, rb in pairs], float)
    n = len(pairs)
    assert row["n"] == n
    method = {"wilson": "wilson", "clopper-pearson": "beta"}[interval]
    for side, right in (("a", right_a), ("b", right_b)):
        assert row[side]["score"] == pytest.approx(right.mean(), abs=1e-12)
        want = proportion_confint(int(right.sum()), n, 0.05, method=method)
        assert row[side]["interval"] == pytest.approx(list(want), abs=1e-12)
    table = [
        [np.sum((right_a == 1) & (right_b == 1)), np.sum((right_a == 1) & (right_b == 0))],
        [np.sum((right_a == 0) & (right_b == 1)), np.sum((right_a == 0) & (right_b == 0))],
    ]
    assert row["test"] == "mcnemar-exact"
    assert (row["only_a"], row["only_b"]) == (table[0][1], table[1][0])
    assert row["p_value"] == pytest.approx(mcnemar(table, exact=True).pvalue, abs=1e-12)
    slow = slow_bootstrap(np.mean, (right_a,), (right_b,))
    assert row["difference"] == pytest.approx(right_b.mean() - right_a.mean(), abs=1e-12)
    assert row["difference_interval"] == pytest.approx(list(slow["difference"]), abs=1e-12)


@pytest.mark.parametrize("interval", ["wilson", "clopper-pearson"])
def test_foci_accuracy_per_dataset_against_statsmodels(tmp_path, interval):
    records_a, records_b = foci_records(1, 0.55), foci_records(2, 0.75)
    result = run_compare(tmp_path, "foci", records_a, records_b, interval=interval)
    rows = rows_by(result)
    assert list(rows) == [
        ("flowers102", "accuracy"),
        ("food101", "accuracy"),
        ("all items", "accuracy"),
    ]
    for dataset in ("flowers102", "food101"):
        in_dataset = kept_pairs(
            records_a, records_b, lambda r, d=dataset: r["meta"]["dataset"] == d
        )
        row = rows[dataset, "accuracy"]
        _check_accuracy_row(row, in_dataset, interval)
        assert row["excluded"] == 30 - len(in_dataset) > 0
    _check_accuracy_row(rows["all items", "accuracy"], kept_pairs(records_a, records_b), interval)
    failed = sum(
        ra["error"] is not None or rb["error"] is not None for ra, rb in zip(records_a, records_b)
    )
    assert result["items"] == {
        "a": 60,
        "b": 60,
        "compared": 60,
        "only_a": 0,
        "only_b": 0,
        "failed": failed,
    }
    assert result["differs"] == {"model": ["model-a", "model-b"]}


def test_a_single_dataset_is_one_row(tmp_path):
    records = [r for r in foci_records(1, 0.6) if r["meta"]["dataset"] == "food101"]
    other = [r for r in foci_records(3, 0.6) if r["meta"]["dataset"] == "food101"]
    result = run_compare(tmp_path, "foci", records, other)
    assert [(r["group"], r["metric"]) for r in result["rows"]] == [("food101", "accuracy")]


def test_the_same_seed_gives_the_same_numbers(tmp_path):
    a = write_run(tmp_path / "a", "foci", foci_records(1, 0.6))
    b = write_run(tmp_path / "b", "foci", foci_records(2, 0.7))
    first = compare.compare_runs(a, b, num_bootstrap=BOOTSTRAP)
    assert compare.compare_runs(a, b, num_bootstrap=BOOTSTRAP) == first
    other = compare.compare_runs(a, b, num_bootstrap=BOOTSTRAP, seed=1)
    assert other["rows"][0]["difference_interval"] != first["rows"][0]["difference_interval"]
    assert other["rows"][0]["p_value"] == first["rows"][0]["p_value"]  # McNemar: no resampling


# --- OODBench: accuracy, F1 and MCC of yes/no -----------------------------------------------------


def _yes_no(pairs, side: int) -> tuple[np.ndarray, np.ndarray]:
    truth = np.array([p[side]["meta"]["answer"] for p in pairs])
    parsed = [p[side]["parsed"] for p in pairs]
    said_yes = np.array([(not t) if v is None else v for t, v in zip(truth, parsed)])
    return truth, said_yes


@pytest.mark.slow
def test_oodbench_f1_and_mcc_against_sklearn_and_a_slow_bootstrap(tmp_path):
    records_a, records_b = oodbench_records(1, 0.6), oodbench_records(2, 0.8)
    rows = rows_by(run_compare(tmp_path, "oodbench", records_a, records_b))
    labels = {"id": "ID", "ood_s": "OOD-S", "ood_h": "OOD-H"}
    assert list(rows) == [(labels[s], m) for s in labels for m in ("accuracy", "f1", "mcc")]
    references = {
        "f1": lambda t, y: f1_score(t, y, zero_division=0),
        "mcc": matthews_corrcoef,
        "accuracy": accuracy_score,
    }
    for split, label in labels.items():
        pairs = kept_pairs(records_a, records_b, lambda r, s=split: r["meta"]["split"] == s)
        _check_accuracy_row(rows[label, "accuracy"], pairs)
        a, b = _yes_no(pairs, 0), _yes_no(pairs, 1)
        for metric in ("f1", "mcc"):
            row, reference = rows[label, metric], references[metric]
            assert row["n"] == len(pairs) and row["excluded"] == 40 - len(pairs)
            assert row["a"]["score"] == pytest.approx(reference(*a), abs=1e-12)
            assert row["b"]["score"] == pytest.approx(reference(*b), abs=1e-12)
            slow = slow_bootstrap(reference, a, b)
            assert row["a"]["interval"] == pytest.approx(list(slow["a"]), abs=1e-12)
            assert row["b"]["interval"] == pytest.approx(list(slow["b"]), abs=1e-12)
            assert row["difference_interval"] == pytest.approx(list(slow["difference"]), abs=1e-12)
            assert row["test"] == "paired-bootstrap"
            assert row["p_value"] == pytest.approx(slow["p_value"], abs=1e-12)


def test_oodbench_scores_are_results_json_without_failures(tmp_path):
    records_a = oodbench_records(1, 0.6, p_error=0.0)
    records_b = oodbench_records(2, 0.8, p_error=0.0)
    rows = rows_by(run_compare(tmp_path, "oodbench", records_a, records_b))
    for side, records in (("a", records_a), ("b", records_b)):
        for split, report in yes_no_results(records)["splits"].items():
            label = {"id": "ID", "ood_s": "OOD-S", "ood_h": "OOD-H"}[split]
            for metric in ("accuracy", "f1", "mcc"):
                assert rows[label, metric][side]["score"] == pytest.approx(
                    report[metric], abs=1e-12
                )


# --- OODBench BAP and COUNTS OODG ---------------------------------------------------------------


def bap_records(seed: int, p_right: float, p_error: float) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for split in ("id", "ood_h"):
        for sample in range(25):
            levels = ["existential", "counting", "counting"] + ["logical"] * (sample % 3 != 0)
            for k, level in enumerate(levels):
                meta = {
                    "split": split,
                    "level": level,
                    "answer": "yes",
                    "sample": f"{split}/{sample}",
                }
                right = bool(rng.random() < p_right)
                item = f"{split}/{sample}/{level}/{k}"
                records.append(record(item, meta, "yes", right, _failure(rng, p_error)))
    return records


def test_bap_levels_and_logical_samples(tmp_path):
    records_a, records_b = bap_records(1, 0.5, 0.0), bap_records(2, 0.7, 0.0)
    rows = rows_by(run_compare(tmp_path, "oodbench-bap", records_a, records_b))
    for side, records in (("a", records_a), ("b", records_b)):
        for split, report in bap_results(records)["splits"].items():
            label = {"id": "ID", "ood_h": "OOD-H"}[split]
            for metric in ("e_acc", "c_acc", "l_acc", "bap"):
                assert rows[label, metric][side]["score"] == pytest.approx(report[metric])
            assert rows[label, "l_acc"]["n"] == report["logical_samples"] == 16
            assert rows[label, "bap"]["n"] == report["questions"]


def test_a_failed_question_excludes_its_whole_logical_sample(tmp_path):
    records_a, records_b = bap_records(1, 0.5, 0.0), bap_records(2, 0.7, 0.0)
    # Sample id/1 has a logical question; fail one of its counting questions in B only.
    failed = next(r for r in records_b if r["id"] == "id/1/counting/1")
    failed.update(error="timeout", parsed=None, correct=False)
    existential = next(r for r in records_a if r["id"] == "id/2/existential/0")
    existential.update(error="timeout", parsed=None, correct=False)
    rows = rows_by(run_compare(tmp_path, "oodbench-bap", records_a, records_b))
    # id/2's failed existential question is not part of its L-Acc unit.
    assert (rows["ID", "l_acc"]["n"], rows["ID", "l_acc"]["excluded"]) == (15, 1)
    assert (rows["ID", "c_acc"]["n"], rows["ID", "c_acc"]["excluded"]) == (49, 1)
    assert (rows["ID", "e_acc"]["n"], rows["ID", "e_acc"]["excluded"]) == (24, 1)
    assert (rows["OOD-H", "l_acc"]["n"], rows["OOD-H", "l_acc"]["excluded"]) == (16, 0)


def oodg_records(seed: int, p_right: float) -> list[dict]:
    answers = np.random.default_rng(300)
    rng = np.random.default_rng(seed)
    records = []
    for setting, ice in (("zero_shot", 0), ("covariate_shift", 3)):
        for k in range(24):
            domain = ("sky", "sea")[k % 2]
            base = {
                "setting": setting,
                "ice": ice,
                "domain": domain,
                "size": "M",
                "options": ["w", "x", "y", "z"],
            }
            answer = int(answers.integers(0, 4))
            parsed = answer if rng.random() < p_right else (answer + 1) % 4
            meta = {**base, "task": "grounding", "answer": answer}
            records.append(record(f"g/{setting}/{k}", meta, parsed, parsed == answer))
            mapping = [int(v) for v in answers.permutation(4)]
            guess = [v if rng.random() < p_right else (v + 1) % 4 for v in mapping]
            guess = None if rng.random() < 0.1 else guess
            meta = {**base, "task": "mapping", "answer": mapping}
            records.append(record(f"m/{setting}/{k}", meta, guess, guess == mapping))
    meta = {
        "task": "localization",
        "setting": "zero_shot",
        "ice": 0,
        "domain": "sky",
        "answer": [[0, 0, 5, 5]],
    }
    records.append(record("l/0", meta, [[0, 0, 4, 4]], None))
    return records


def test_counts_oodg_rows_per_setting_and_domain(tmp_path):
    records_a, records_b = oodg_records(1, 0.5), oodg_records(2, 0.8)
    result = run_compare(tmp_path, "counts-oodg", records_a, records_b)
    rows = rows_by(result)
    groups = []
    for task, metrics in (("grounding", ["accuracy"]), ("mapping", ["accuracy", "exact_match"])):
        for cell in ("zero_shot ICE 0", "covariate_shift ICE 3"):
            groups += [(f"{task} {cell}{d}", m) for d in ("", " sea", " sky") for m in metrics]
    assert list(rows) == groups
    sea = [
        (ra, rb)
        for ra, rb in zip(records_a, records_b)
        if ra["id"].startswith("g/zero_shot/") and ra["meta"]["domain"] == "sea"
    ]
    _check_accuracy_row(rows["grounding zero_shot ICE 0 sea", "accuracy"], sea)

    def box_accuracy(r):
        guess = r["parsed"] or [None] * 4
        return np.mean([g == t for g, t in zip(guess, r["meta"]["answer"])])

    mapping = [
        (ra, rb)
        for ra, rb in zip(records_a, records_b)
        if ra["id"].startswith("m/covariate_shift/")
    ]
    row = rows["mapping covariate_shift ICE 3", "accuracy"]
    a = np.array([box_accuracy(ra) for ra, _ in mapping])
    b = np.array([box_accuracy(rb) for _, rb in mapping])
    assert row["a"]["score"] == pytest.approx(a.mean()) and row["test"] == "paired-bootstrap"
    slow = slow_bootstrap(np.mean, (a,), (b,))
    assert row["difference_interval"] == pytest.approx(list(slow["difference"]), abs=1e-12)
    assert row["p_value"] == pytest.approx(slow["p_value"], abs=1e-12)
    _check_accuracy_row(rows["mapping covariate_shift ICE 3", "exact_match"], mapping)
    assert result["notes"] == [
        "localization left out (1 items): its mAP scores all boxes together, with no per-item "
        "verdict to pair"
    ]


# --- Refusals: runs whose items differ --------------------------------------------------------


def test_runs_with_different_ids_are_refused_naming_them(tmp_path):
    records_a = foci_records(1, 0.6)
    records_b = foci_records(2, 0.7)[5:] + [
        record("food101/new.jpg", {"dataset": "food101"}, 0, True)
    ]
    a = write_run(tmp_path / "a", "foci", records_a)
    b = write_run(tmp_path / "b", "foci", records_b)
    with pytest.raises(ValueError) as error:
        compare.compare_runs(a, b)
    assert str(error.value) == (
        f"{a} and {b} hold different items: 6 ids differ: 5 only in {a} ('food101/0.jpg', "
        f"'food101/1.jpg', 'food101/2.jpg' and 2 more); 1 only in {b} ('food101/new.jpg'). "
        "--on-common compares the 55 ids both hold"
    )
    result = compare.compare_runs(a, b, on_common=True, num_bootstrap=BOOTSTRAP)
    assert result["items"]["compared"] == 55
    assert (result["items"]["only_a"], result["items"]["only_b"]) == (5, 1)
    assert "(--on-common: 5 only in A and 1 only in B left out)" in compare.render(result)
    shared = kept_pairs(records_a[5:], records_b[:-1])
    _check_accuracy_row(rows_by(result)["all items", "accuracy"], shared)


def test_an_id_asking_another_question_is_refused_even_on_common(tmp_path):
    records_a, records_b = foci_records(1, 0.6), foci_records(2, 0.7)
    for r in records_b[10:14]:
        r["digest"] = "another prompt"
    a = write_run(tmp_path / "a", "foci", records_a)
    b = write_run(tmp_path / "b", "foci", records_b[:-1])
    with pytest.raises(ValueError, match="hold different items"):
        compare.compare_runs(a, b)
    with pytest.raises(
        ValueError,
        match=r"ask different questions under 4 of the same ids \(the digest of prompt and "
        r"images differs\): 'food101/10.jpg', 'food101/11.jpg', 'food101/12.jpg' and 1 more$",
    ):
        compare.compare_runs(a, b, on_common=True)


def test_an_item_with_another_answer_key_is_refused(tmp_path):
    records_a, records_b = foci_records(1, 0.6), foci_records(2, 0.7)
    records_b[3]["meta"]["answer"] = (records_b[3]["meta"]["answer"] + 1) % 4
    a = write_run(tmp_path / "a", "foci", records_a)
    b = write_run(tmp_path / "b", "foci", records_b)
    with pytest.raises(ValueError, match=r"item 'food101/3\.jpg' has meta field 'answer' "):
        compare.compare_runs(a, b)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "run.json").unlink(), r"a/run\.json: not found"),
        (lambda d: (d / "predictions.jsonl").unlink(), r"a: no predictions\.jsonl"),
        (lambda d: (d / "run.json").write_text("{"), r"a/run\.json: malformed JSON"),
        (lambda d: (d / "run.json").write_text("[]"), r"a/run\.json: not a JSON object"),
        (lambda d: (d / "run.json").write_text("{}"), r"a/run\.json: expected a JSON object"),
        (lambda d: (d / "predictions.jsonl").write_text(""), r"predictions\.jsonl: no predictions"),
        (
            lambda d: (d / "predictions.jsonl").write_text('{"id": "x"}\n'),
            r"predictions\.jsonl: line 1: a record needs 'id' and 'digest'",
        ),
        (
            lambda d: (d / "predictions.jsonl").write_text('{"id": "x", "digest": "d"}\n'),
            r"predictions\.jsonl: record 'x': missing field 'parsed'",
        ),
    ],
)
def test_unreadable_run_directories_name_the_file_and_field(tmp_path, damage, match):
    a = write_run(tmp_path / "a", "foci", foci_records(1, 0.6))
    b = write_run(tmp_path / "b", "foci", foci_records(2, 0.6))
    damage(pathlib.Path(a))
    with pytest.raises(ValueError, match=match):
        compare.compare_runs(a, b)


def test_bad_records_and_mismatched_runs_fail_in_one_line(tmp_path):
    records = foci_records(1, 0.6, p_error=0.0)
    records[4]["correct"] = None
    a = write_run(tmp_path / "a", "foci", records)
    b = write_run(tmp_path / "b", "foci", foci_records(2, 0.6))
    with pytest.raises(ValueError, match=r"record 'food101/4\.jpg': field 'correct' is None"):
        compare.compare_runs(a, b)
    c = write_run(tmp_path / "c", "oodbench", oodbench_records(1, 0.6))
    with pytest.raises(ValueError, match=r"/b is a run of foci and .*/c one of oodbench$"):
        compare.compare_runs(b, c)
    with pytest.raises(ValueError, match=r"missing: no such run directory"):
        compare.compare_runs(b, tmp_path / "missing")
    del records[0]["meta"]["dataset"]
    d = write_run(tmp_path / "d", "foci", records)
    e = write_run(tmp_path / "e", "foci", records)
    with pytest.raises(ValueError, match=r"record 'food101/0\.jpg': meta has no field 'dataset'"):
        compare.compare_runs(d, e)


def test_an_unknown_benchmark_names_run_json(tmp_path):
    a = write_run(tmp_path / "a", "mystery", foci_records(1, 0.6))
    with pytest.raises(ValueError, match=r"a/run\.json: compare knows no benchmark 'mystery'$"):
        compare.compare_runs(a, a)


def test_a_group_whose_every_item_failed_is_shown_empty(tmp_path):
    records_a, records_b = foci_records(1, 0.6), foci_records(2, 0.7)
    for r in records_b[:30]:
        r.update(error="timeout", parsed=None, correct=False)
    result = run_compare(tmp_path, "foci", records_a, records_b)
    row = rows_by(result)["food101", "accuracy"]
    assert (row["n"], row["excluded"], row["a"], row["p_value"]) == (0, 30, None, None)
    line = next(x for x in compare.render(result).splitlines() if x.startswith("food101"))
    assert line.split() == ["food101", "accuracy", "0", "30", "-", "-", "-", "-", "-"]


def test_a_torn_last_line_is_noted_and_left_unrepaired(tmp_path):
    a = write_run(tmp_path / "a", "foci", foci_records(1, 0.6))
    b = write_run(tmp_path / "b", "foci", foci_records(2, 0.6))
    predictions = pathlib.Path(b) / "predictions.jsonl"
    predictions.write_text(predictions.read_text() + '{"id": "food101/x.jp')
    before = predictions.read_bytes()
    result = compare.compare_runs(a, b, num_bootstrap=BOOTSTRAP)
    assert result["notes"] == [
        f"{predictions} ends in a torn line (a run killed mid-write); that item is not read"
    ]
    assert predictions.read_bytes() == before


# --- The command -----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ood-jax")
    compare_cli.add_compare(p.add_subparsers(dest="command", required=True))
    return p


def test_command_prints_json_and_a_table(tmp_path, capsys):
    a = write_run(tmp_path / "a", "oodbench", oodbench_records(1, 0.6), setting="plain")
    b = write_run(
        tmp_path / "b", "oodbench", oodbench_records(2, 0.8), setting="plain", model="model-b"
    )
    args = parser().parse_args(["compare", a, b, "--json", "--bootstrap", "200", "--seed", "3"])
    returned = args.run(args)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(returned))
    assert returned == compare.compare_runs(a, b, num_bootstrap=200, seed=3)

    args = parser().parse_args(["compare", a, b, "--bootstrap", "200", "--confidence", "0.9"])
    args.run(args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"A: {a}",
        f"B: {b}",
        "oodbench; the runs differ in: model 'model-a' (A), 'model-b' (B)",
    ]
    assert lines[4].startswith("90% intervals: accuracies Clopper-Pearson;")
    header = lines[7].split()
    assert header == ["group", "metric", "n", "excl", "A", "B", "B", "-", "A", "p", "test"]
    assert len(lines) == 8 + 9 and lines[8].split()[:2] == ["ID", "accuracy"]
    assert lines[9].split()[-1] == "paired-bootstrap"


def test_help_ends_with_examples_that_parse():
    p = parser()
    (compare_parser,) = p._subparsers._group_actions[0].choices.values()
    text = compare_parser.format_help()
    epilog = text[text.index("examples:") :].strip().splitlines()
    assert epilog[0] == "examples:" and len(epilog) == 4
    for line in epilog[1:]:
        argv = shlex.split(line.strip())
        assert argv[:2] == ["ood-jax", "compare"]
        args = p.parse_args(argv[1:])
        assert args.run is compare_parser.get_default("run")
    assert "--on-common" in text and "refuses" in text
