"""`ood-jax stats`: every check printed from files, against scipy and plain numpy."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from scipy import stats as sps

from ood_jax import stats
from ood_jax.cli import stats as stats_command


def stats_cli(argv: list[str], capsys) -> dict:
    """Runs `ood-jax stats ... --json` and returns the printed JSON."""
    parser = argparse.ArgumentParser(prog="ood-jax")
    stats_command.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stats", *argv, "--json"])
    returned = args.run(args)
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(returned))
    return printed


def stats_text(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser(prog="ood-jax")
    stats_command.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stats", *argv])
    args.run(args)
    return capsys.readouterr().out


def gaussian_mmd2(x: np.ndarray, y: np.ndarray, bandwidth: float) -> float:
    def gram(a, b):
        return np.exp(-((a[:, None] - b[None]) ** 2).sum(-1) / (2 * bandwidth**2))

    m, n = len(x), len(y)
    kxx, kyy = gram(x, x), gram(y, y)
    return (
        (kxx.sum() - np.trace(kxx)) / (m * (m - 1))
        + (kyy.sum() - np.trace(kyy)) / (n * (n - 1))
        - 2 * gram(x, y).mean()
    )


@pytest.mark.parametrize(
    "k, n, confidence", [(49, 50, 0.95), (0, 12, 0.9), (7, 7, 0.99), (13, 40, 0.95)]
)
def test_clopper_pearson_command_matches_scipy(capsys, k, n, confidence):
    out = stats_cli(["clopper-pearson", str(k), str(n), "--confidence", str(confidence)], capsys)
    exact = sps.binomtest(k, n).proportion_ci(confidence, method="exact")
    assert out["clopper_pearson"] == pytest.approx([exact.low, exact.high], abs=1e-12)
    one_sided = sps.binomtest(k, n, alternative="greater").proportion_ci(confidence, "exact")
    assert out["clopper_pearson_one_sided_lower"] == pytest.approx(one_sided.low, abs=1e-12)
    assert out["beta_posterior_lower"] == pytest.approx(
        sps.beta.ppf(1 - confidence, 1 + k, 1 + n - k), abs=1e-12
    )
    from statsmodels.stats.proportion import proportion_confint

    wilson = proportion_confint(k, n, 1 - confidence, method="wilson")
    assert out["wilson"] == pytest.approx(list(wilson), abs=1e-12)
    jeffreys = stats_cli(["clopper-pearson", str(k), str(n), "--prior", "jeffreys"], capsys)
    assert jeffreys["beta_posterior_lower"] == pytest.approx(
        sps.beta.ppf(0.05, 0.5 + k, 0.5 + n - k), abs=1e-12
    )


@pytest.mark.parametrize("only_a, only_b", [(21, 9), (0, 0), (0, 5), (40, 41)])
def test_mcnemar_command_matches_statsmodels(capsys, only_a, only_b):
    from statsmodels.stats.contingency_tables import mcnemar

    out = stats_cli(["mcnemar", str(only_a), str(only_b)], capsys)
    want = mcnemar([[10, only_a], [only_b, 10]], exact=True).pvalue
    assert out == {"only_a": only_a, "only_b": only_b, "p_value": pytest.approx(want, abs=1e-12)}
    assert f"p = {want:.4g}" in stats_text(["mcnemar", str(only_a), str(only_b)], capsys)


def test_paper_theta_min_is_printed(capsys):
    text = stats_text(["clopper-pearson", "49", "50"], capsys)
    assert "two-sided 95% interval: [0.8935, 0.9995]" in text


@pytest.mark.slow
def test_mmd_command_matches_numpy(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=(30, 3)) + 0.8
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    files = ["--x", str(tmp_path / "x.npy"), "--y", str(tmp_path / "y.npy")]
    out = stats_cli(["mmd", *files, "--permutations", "200"], capsys)
    z = np.concatenate([x, y])
    d = np.sqrt(((z[:, None] - z[None]) ** 2).sum(-1))[np.triu_indices(len(z), 1)]
    assert out["bandwidth"] == pytest.approx(np.median(d), rel=1e-5)
    assert out["mmd2"] == pytest.approx(gaussian_mmd2(x, y, out["bandwidth"]), abs=1e-5)
    # A 0.8 shift in every coordinate is plain to see: no permutation scores as high.
    assert out["p_value"] == pytest.approx(1 / 201)
    estimate, std = stats.mmd2_jackknife(x, y, out["bandwidth"])
    assert out["upper"] == pytest.approx(estimate + sps.norm.ppf(0.95) * std, rel=1e-6)
    boot = stats_cli(["mmd", *files, "--method", "bootstrap", "--bootstrap", "40"], capsys)
    resampled = stats.mmd2_bootstrap(x, y, 40, seed=0, bandwidth=out["bandwidth"])
    assert boot["upper"] == pytest.approx(np.quantile(resampled, 0.95), rel=1e-6)
    fixed = stats_cli(["mmd", *files, "--bandwidth", "2.5", "--permutations", "0"], capsys)
    assert fixed["mmd2"] == pytest.approx(gaussian_mmd2(x, y, 2.5), abs=1e-5)
    assert "p_value" not in fixed


@pytest.mark.slow
def test_equivalence_command(tmp_path, capsys):
    rng = np.random.default_rng(1)
    train = rng.normal(size=(80, 4))
    np.save(tmp_path / "train.npy", train)
    # A larger val sample narrows the bound; the margin comes from halves of train.
    np.save(tmp_path / "same.npy", rng.normal(size=(300, 4)))
    np.save(tmp_path / "shifted.npy", rng.normal(size=(60, 4)) + 1.0)
    base = ["equivalence", "--train", str(tmp_path / "train.npy"), "--splits", "30"]
    base += ["--seed", "3"]
    same = stats_cli([*base, "--val", str(tmp_path / "same.npy")], capsys)
    shifted = stats_cli([*base, "--val", str(tmp_path / "shifted.npy")], capsys)
    assert same["equivalent"] is True
    assert shifted["equivalent"] is False
    # The margin is the 95th percentile of within-train split MMD^2 on the same kernel.
    null = stats.within_split_mmd2(train, 30, seed=3, bandwidth=same["bandwidth"])
    assert same["threshold"] == pytest.approx(np.quantile(null, 0.95), rel=1e-5)
    assert shifted["threshold"] == pytest.approx(same["threshold"], rel=1e-6)
    assert same["statistic"] == same["upper"]
    estimate, std = stats.mmd2_jackknife(train, np.load(tmp_path / "same.npy"), same["bandwidth"])
    assert same["upper"] == pytest.approx(estimate + sps.norm.ppf(0.95) * std, rel=1e-5)


def test_f_test_correlation_and_resampling_commands(tmp_path, capsys):
    rng = np.random.default_rng(2)
    hard, ood = rng.normal(0.2, 0.08, 9), rng.normal(0.25, 0.03, 9)
    np.save(tmp_path / "hard.npy", hard)
    (tmp_path / "ood.json").write_text(json.dumps(ood.tolist()))
    pair = ["--x", str(tmp_path / "hard.npy"), "--y", str(tmp_path / "ood.json")]
    f = stats_cli(["f-test", *pair], capsys)
    ratio = np.var(hard, ddof=1) / np.var(ood, ddof=1)
    assert f["F"] == pytest.approx(ratio)
    assert f["df"] == [8, 8]
    assert f["p_value"] == pytest.approx(sps.f.sf(ratio, 8, 8))
    two = stats_cli(["f-test", *pair, "--alternative", "two-sided"], capsys)
    assert two["p_value"] == pytest.approx(2 * min(sps.f.sf(ratio, 8, 8), sps.f.cdf(ratio, 8, 8)))
    corr = stats_cli(["correlation", *pair], capsys)
    assert corr["pearson"]["r"] == pytest.approx(sps.pearsonr(hard, ood).statistic)
    assert corr["pearson"]["p_value"] == pytest.approx(sps.pearsonr(hard, ood).pvalue)
    assert corr["spearman"]["r"] == pytest.approx(sps.spearmanr(hard, ood).statistic)
    assert corr["spearman"]["p_value"] == pytest.approx(sps.spearmanr(hard, ood).pvalue)
    baseline = rng.normal(0.9, 0.05, 1000)
    np.save(tmp_path / "baseline.npy", baseline)
    res = stats_cli(
        ["resampling", "--observed", "0.85", "--samples", str(tmp_path / "baseline.npy")], capsys
    )
    assert res["p_value"] == pytest.approx((1 + np.sum(baseline <= 0.85)) / 1001)


def _results_file(path, model: str, metrics: dict[str, float]) -> None:
    splits = {split: {"accuracy": acc, "f1": acc / 2} for split, acc in metrics.items()}
    path.write_text(json.dumps({"benchmark": "oodbench", "model": model, "splits": splits}))


def test_drops_from_results_files_feed_the_tests(tmp_path, capsys):
    rng = np.random.default_rng(4)
    accuracies = rng.uniform(0.5, 0.95, (6, 3))
    files = []
    for k, (id_acc, s_acc, h_acc) in enumerate(accuracies):
        files.append(tmp_path / f"m{k}.json")
        _results_file(files[-1], f"model-{k}", {"id": id_acc, "ood_s": s_acc, "ood_h": h_acc})
    paths = [str(p) for p in files]
    hard = stats_cli(
        ["drops", "--results", *paths, "--shifted", "ood_s", "--out", str(tmp_path / "a.json")],
        capsys,
    )
    ood = stats_cli(["drops", "--results", *paths, "--out", str(tmp_path / "b.json")], capsys)
    assert hard["drops"] == pytest.approx(accuracies[:, 0] - accuracies[:, 1])
    assert ood["drops"] == pytest.approx(accuracies[:, 0] - accuracies[:, 2])
    assert ood["models"] == [f"model-{k}" for k in range(6)]
    f1 = stats_cli(["drops", "--results", *paths, "--metric", "f1"], capsys)
    assert f1["drops"] == pytest.approx((accuracies[:, 0] - accuracies[:, 2]) / 2)
    corr = stats_cli(
        ["correlation", "--x", str(tmp_path / "a.json"), "--y", str(tmp_path / "b.json")], capsys
    )
    expected = sps.pearsonr(
        accuracies[:, 0] - accuracies[:, 1], accuracies[:, 0] - accuracies[:, 2]
    )
    assert corr["pearson"]["r"] == pytest.approx(expected.statistic)


def test_bad_inputs_name_the_file(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("[1, 2,")
    with pytest.raises(SystemExit, match=r"broken\.json: not valid JSON"):
        stats_cli(
            ["f-test", "--x", str(tmp_path / "broken.json"), "--y", str(tmp_path / "broken.json")],
            capsys,
        )
    with pytest.raises(SystemExit, match=r"missing\.npy: file not found"):
        stats_cli(["mmd", "--x", str(tmp_path / "missing.npy"), "--y", "y.npy"], capsys)
    _results_file(tmp_path / "r.json", "m", {"id": 0.9})
    with pytest.raises(SystemExit, match=r"r\.json: no split 'ood_h' \(has id\)"):
        stats_cli(["drops", "--results", str(tmp_path / "r.json")], capsys)
    with pytest.raises(SystemExit, match=r"k must be in \[0, n=5\]"):
        stats_cli(["clopper-pearson", "6", "5"], capsys)
