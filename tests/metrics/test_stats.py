"""ood_jax.stats against scipy and a plain-numpy MMD reference on randomized inputs."""

import numpy as np
import pytest
from scipy import stats as sps

from ood_jax import stats


def mmd2_reference(x: np.ndarray, y: np.ndarray, bandwidth: float) -> float:
    """O(n^2) float64 unbiased MMD^2 written straight from the definition."""

    def gram(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-d2 / (2 * bandwidth**2))

    m, n = len(x), len(y)
    kxx, kyy, kxy = gram(x, x), gram(y, y), gram(x, y)
    return (
        (kxx.sum() - np.trace(kxx)) / (m * (m - 1))
        + (kyy.sum() - np.trace(kyy)) / (n * (n - 1))
        - 2 * kxy.mean()
    )


def median_reference(x: np.ndarray, y: np.ndarray) -> float:
    z = np.concatenate([x, y])
    d = np.sqrt(((z[:, None, :] - z[None, :, :]) ** 2).sum(-1))
    return float(np.median(d[np.triu_indices(len(z), k=1)]))


# --- binomial bounds ---------------------------------------------------------------------------


def test_clopper_pearson_matches_scipy_exact():
    rng = np.random.default_rng(0)
    cases = [(0, 1), (1, 1), (0, 50), (50, 50), (49, 50)]
    cases += [(int(k), int(n)) for n in rng.integers(1, 500, 40) for k in [rng.integers(0, n + 1)]]
    for k, n in cases:
        for confidence in (0.9, 0.95, 0.99):
            ref = sps.binomtest(k, n).proportion_ci(confidence, method="exact")
            np.testing.assert_allclose(
                stats.clopper_pearson(k, n, confidence), (ref.low, ref.high), rtol=1e-9, atol=1e-12
            )


def test_paper_k49_n50_bound():
    # The paper: "k=49, n=50 ... yields theta_min ~ 0.89": the lower end of the two-sided 95%
    # Clopper-Pearson interval (0.8935); the one-sided 95% bounds are all above 0.90.
    low, high = stats.clopper_pearson(49, 50)
    assert round(low, 2) == 0.89
    np.testing.assert_allclose((low, high), (0.893530, 0.999494), atol=1e-6)
    np.testing.assert_allclose(stats.beta_posterior_bound(49, 50), 0.910328, atol=1e-6)
    np.testing.assert_allclose(
        stats.beta_posterior_bound(49, 50, prior=(0.5, 0.5)), 0.924461, atol=1e-6
    )


def test_beta_posterior_bound_matches_beta_quantile():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(1, 300))
        k = int(rng.integers(0, n + 1))
        a, b = rng.uniform(0.3, 3, 2)
        want = sps.beta.ppf(0.1, a + k, b + n - k)
        got = stats.beta_posterior_bound(k, n, confidence=0.9, prior=(a, b))
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stats.clopper_pearson(1, 0), "n must be positive"),
        (lambda: stats.clopper_pearson(6, 5), "k must be in"),
        (lambda: stats.clopper_pearson(-1, 5), "k must be in"),
        (lambda: stats.clopper_pearson(2.5, 5), "k must be an integer"),
        (lambda: stats.clopper_pearson(2, 5, confidence=1.5), "confidence"),
        (lambda: stats.beta_posterior_bound(2, 5, prior=(0, 1)), "prior"),
    ],
)
def test_binomial_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- MMD ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_mmd2_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    m, n, d = rng.integers(2, 120), rng.integers(2, 120), rng.integers(1, 8)
    x = rng.normal(size=(m, d))
    y = rng.normal(size=(n, d)) * rng.uniform(0.5, 2) + rng.uniform(-1, 1)
    med = median_reference(x, y)
    np.testing.assert_allclose(stats.median_heuristic_bandwidth(x, y), med, rtol=1e-5)
    for bw in (None, 0.3, 1.0, 5.0):
        want = mmd2_reference(x, y, med if bw is None else bw)
        for block_size in (1, 16, 256):
            got = stats.mmd2_unbiased(x, y, bandwidth=bw, block_size=block_size)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6)


@pytest.mark.slow
def test_mmd2_same_vs_shifted():
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(2000, 16)), rng.normal(size=(1500, 16))
    same = stats.mmd2_unbiased(x, y)
    shifted = stats.mmd2_unbiased(x, y + 0.5)
    assert abs(same) < 2e-3
    assert shifted > 50 * max(abs(same), 1e-4)


@pytest.mark.slow
def test_permutation_test_shifted_and_same():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(150, 4))
    mmd_shift, p_shift = stats.mmd_permutation_test(x, rng.normal(size=(120, 4)) + 0.6, 200)
    assert mmd_shift > 0 and p_shift == pytest.approx(1 / 201)
    p_same = [
        stats.mmd_permutation_test(x, rng.normal(size=(120, 4)), 200, seed=s)[1] for s in range(3)
    ]
    assert min(p_same) > 0.05


@pytest.mark.slow
def test_permutation_chunking_keeps_p_value():
    # Chunking and padding of the permutations must not change which relabellings are scored.
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(30, 3)), rng.normal(size=(25, 3)) + 0.2
    observed, p = stats.mmd_permutation_test(
        x, y, num_permutations=50, bandwidth=1.0, permutation_chunk=16
    )
    _, p_one_chunk = stats.mmd_permutation_test(x, y, num_permutations=50, bandwidth=1.0)
    np.testing.assert_allclose(observed, mmd2_reference(x, y, 1.0), rtol=1e-4)
    assert p == p_one_chunk
    assert 1 / 51 <= p <= 1


@pytest.mark.slow
def test_within_split_and_tost():
    rng = np.random.default_rng(13)
    train = rng.normal(size=(400, 8))
    bw = stats.median_heuristic_bandwidth(train[:200], train[200:])
    null = stats.within_split_mmd2(train, num_splits=20, bandwidth=bw)
    assert null.shape == (20,)
    same = stats.mmd2_unbiased(train, rng.normal(size=(400, 8)), bandwidth=bw)
    shifted = stats.mmd2_unbiased(train, rng.normal(size=(400, 8)) + 0.5, bandwidth=bw)
    res = stats.tost_equivalence(same, null)
    assert res["equivalent"] and res["threshold"] == pytest.approx(np.quantile(null, 0.95))
    res = stats.tost_equivalence(shifted, null)
    assert not res["equivalent"] and res["null_fraction_below"] == 1.0


def _gram(a: np.ndarray, b: np.ndarray, bandwidth: float) -> np.ndarray:
    return np.exp(-((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / (2 * bandwidth**2))


def bootstrap_reference(x, y, bandwidth, num_bootstrap, seed):
    """Each resample written out as index arrays; pairs of one original point are left out."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_bootstrap):
        ix, iy = rng.integers(0, len(x), len(x)), rng.integers(0, len(y), len(y))
        within = []
        for points, index in ((x, ix), (y, iy)):
            distinct = index[:, None] != index[None, :]
            gram = _gram(points[index], points[index], bandwidth)
            within.append((gram * distinct).sum() / distinct.sum())
        out.append(within[0] + within[1] - 2 * _gram(x[ix], y[iy], bandwidth).mean())
    return np.array(out)


def jackknife_reference(x, y, bandwidth):
    """Leave-one-out MMD^2 recomputed from scratch for every point; Arvesen's variance."""
    m, n = len(x), len(y)
    loo_x = [mmd2_reference(np.delete(x, i, 0), y, bandwidth) for i in range(m)]
    loo_y = [mmd2_reference(x, np.delete(y, j, 0), bandwidth) for j in range(n)]
    variance = (m - 1) / m * np.sum((loo_x - np.mean(loo_x)) ** 2) + (n - 1) / n * np.sum(
        (loo_y - np.mean(loo_y)) ** 2
    )
    return mmd2_reference(x, y, bandwidth), np.sqrt(variance)


@pytest.mark.parametrize("seed", range(3))
def test_mmd2_bootstrap_matches_resampled_reference(seed):
    rng = np.random.default_rng(30 + seed)
    m, n, d = rng.integers(4, 40), rng.integers(4, 40), rng.integers(1, 5)
    x, y = rng.normal(size=(m, d)), rng.normal(size=(n, d)) + 0.3
    got = stats.mmd2_bootstrap(x, y, 9, seed=seed, bandwidth=1.3, block_size=16, bootstrap_chunk=4)
    np.testing.assert_allclose(got, bootstrap_reference(x, y, 1.3, 9, seed), rtol=1e-4, atol=2e-6)
    bound = stats.mmd2_upper_bound(x, y, 0.9, "bootstrap", 9, seed=seed, bandwidth=1.3)
    assert bound["upper"] == pytest.approx(np.quantile(got, 0.9), rel=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_mmd2_jackknife_matches_leave_one_out(seed):
    rng = np.random.default_rng(40 + seed)
    m, n, d = rng.integers(3, 40), rng.integers(3, 40), rng.integers(1, 5)
    x, y = rng.normal(size=(m, d)), rng.normal(size=(n, d)) * 1.5
    estimate, std = stats.mmd2_jackknife(x, y, bandwidth=0.9, block_size=8)
    want_estimate, want_std = jackknife_reference(x, y, 0.9)
    np.testing.assert_allclose(estimate, want_estimate, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(std, want_std, rtol=1e-3, atol=1e-6)
    bound = stats.mmd2_upper_bound(x, y, 0.95, bandwidth=0.9)
    assert bound["upper"] == pytest.approx(estimate + sps.norm.ppf(0.95) * std, rel=1e-5)


def test_jackknife_upper_bound_covers_the_population_value():
    # Over repeated draws the 90% bound lies above the (large-sample) MMD^2 about 90% of the time.
    rng = np.random.default_rng(50)
    truth = stats.mmd2_unbiased(
        rng.normal(size=(3000, 2)), rng.normal(size=(3000, 2)) + 0.4, bandwidth=1.5
    )
    covered = [
        stats.mmd2_upper_bound(
            rng.normal(size=(50, 2)), rng.normal(size=(50, 2)) + 0.4, 0.9, bandwidth=1.5
        )["upper"]
        >= truth
        for _ in range(60)
    ]
    assert 0.75 <= np.mean(covered) <= 1.0


@pytest.mark.slow
def test_mmd_equivalence_uses_one_kernel():
    rng = np.random.default_rng(51)
    train, val = rng.normal(size=(60, 3)), rng.normal(size=(200, 3))
    result = stats.mmd_equivalence(train, val, num_splits=15, seed=2)
    bandwidth = stats.median_heuristic_bandwidth(train[:30], train[30:])
    assert result["bandwidth"] == pytest.approx(bandwidth)
    null = stats.within_split_mmd2(train, 15, seed=2, bandwidth=bandwidth)
    assert result["threshold"] == pytest.approx(np.quantile(null, 0.95))
    bound = stats.mmd2_upper_bound(train, val, bandwidth=bandwidth)
    assert result["upper"] == pytest.approx(bound["upper"])
    assert result["equivalent"] == (bound["upper"] < result["threshold"])


def test_clopper_pearson_lower_is_one_sided():
    for k, n in [(49, 50), (0, 9), (9, 9), (3, 17)]:
        want = sps.binomtest(k, n, alternative="greater").proportion_ci(0.95, "exact").low
        assert stats.clopper_pearson_lower(k, n) == pytest.approx(want, abs=1e-12)
    assert stats.clopper_pearson_lower(49, 50) == pytest.approx(0.9086, abs=5e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stats.mmd2_unbiased(np.zeros((0, 2)), np.zeros((3, 2))), "x needs at least 2"),
        (lambda: stats.mmd2_unbiased(np.zeros((3, 2)), np.zeros((3, 3))), "same feature dim"),
        (lambda: stats.mmd2_unbiased(np.zeros((3, 2, 1)), np.zeros((3, 2))), "x must be"),
        (lambda: stats.mmd2_unbiased(np.ones((3, 2)), [[np.nan, 0], [0, 0]]), "y contains"),
        (lambda: stats.mmd2_unbiased(np.ones((3, 2)), np.ones((3, 2)), -1.0), "bandwidth"),
        (lambda: stats.mmd_permutation_test(np.ones((3, 2)), np.ones((3, 2)), 0), "num_perm"),
        (lambda: stats.tost_equivalence(0.1, []), "null_samples"),
        (lambda: stats.mmd2_jackknife(np.ones((2, 2)), np.ones((5, 2))), "at least 3 points"),
        (lambda: stats.mmd2_upper_bound(np.ones((4, 1)), np.ones((4, 1)), method="x"), "method"),
        (lambda: stats.mmd2_bootstrap(np.ones((4, 1)), np.ones((4, 1)), 0), "num_bootstrap"),
    ],
)
def test_mmd_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- F-test, correlation, resampling -----------------------------------------------------------


def test_variance_f_test_matches_scipy():
    rng = np.random.default_rng(20)
    for _ in range(20):
        x = rng.normal(size=rng.integers(2, 40)) * rng.uniform(0.2, 3)
        y = rng.normal(size=rng.integers(2, 40))
        dfn, dfd = len(x) - 1, len(y) - 1
        f = np.var(x, ddof=1) / np.var(y, ddof=1)
        got_f, p2 = stats.variance_f_test(x, y)
        np.testing.assert_allclose(got_f, f, rtol=1e-12)
        want2 = min(1.0, 2 * min(sps.f.sf(f, dfn, dfd), sps.f.cdf(f, dfn, dfd)))
        np.testing.assert_allclose(p2, want2, rtol=1e-10)
        np.testing.assert_allclose(stats.variance_f_test(x, y, "greater")[1], sps.f.sf(f, dfn, dfd))
        np.testing.assert_allclose(stats.variance_f_test(x, y, "less")[1], sps.f.cdf(f, dfn, dfd))
    # The paper's F(8, 8) = 4.59 with p = 0.0227 is the one-sided ("greater") p.
    assert round(float(sps.f.sf(4.59, 8, 8)), 3) == 0.023
    with pytest.raises(ValueError, match="x needs at least 2"):
        stats.variance_f_test([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="alternative"):
        stats.variance_f_test([1.0, 2.0], [1.0, 3.0], "bigger")


def test_correlation_matches_scipy():
    rng = np.random.default_rng(21)
    for _ in range(20):
        n = int(rng.integers(3, 50))
        x = rng.normal(size=n)
        y = rng.uniform(-1, 1) * x + rng.normal(size=n)
        got = stats.correlation(x, y)
        pr, sr = sps.pearsonr(x, y), sps.spearmanr(x, y)
        np.testing.assert_allclose(got["pearson"], (pr.statistic, pr.pvalue), rtol=1e-10)
        np.testing.assert_allclose(got["spearman"], (sr.statistic, sr.pvalue), rtol=1e-10)
    with pytest.raises(ValueError, match="same length"):
        stats.correlation([1, 2, 3], [1, 2])


def test_resampling_p_value():
    rng = np.random.default_rng(22)
    for _ in range(20):
        samples = rng.normal(size=int(rng.integers(1, 300)))
        obs = float(rng.normal())
        b = len(samples)
        up = (1 + np.sum(samples >= obs)) / (1 + b)
        lo = (1 + np.sum(samples <= obs)) / (1 + b)
        assert stats.resampling_p_value(obs, samples) == pytest.approx(up)
        assert stats.resampling_p_value(obs, samples, "less") == pytest.approx(lo)
        assert stats.resampling_p_value(obs, samples, "two-sided") == pytest.approx(
            min(1.0, 2 * min(up, lo))
        )
    # The paper's left-tail decision: an OOD correlation below every one of B=1000 baseline draws.
    baseline = rng.uniform(0.9, 1.0, 1000)
    assert stats.resampling_p_value(-0.65, baseline, "less") == pytest.approx(1 / 1001)
    with pytest.raises(ValueError, match="samples"):
        stats.resampling_p_value(0.0, [])


# --- intervals and paired tests of two runs on the same items ------------------------------------


def _binomial_cases(seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    cases = [(0, 1), (1, 1), (0, 50), (50, 50), (49, 50), (1, 2)]
    return cases + [
        (int(k), int(n)) for n in rng.integers(1, 2000, 40) for k in [rng.integers(0, n + 1)]
    ]


def test_wilson_and_clopper_pearson_match_statsmodels():
    from statsmodels.stats.proportion import proportion_confint

    for k, n in _binomial_cases(2):
        for confidence in (0.9, 0.95, 0.99):
            alpha = 1 - confidence
            wilson = proportion_confint(k, n, alpha, method="wilson")
            np.testing.assert_allclose(
                stats.wilson(k, n, confidence), wilson, rtol=1e-10, atol=1e-12
            )
            exact = proportion_confint(k, n, alpha, method="beta")
            np.testing.assert_allclose(
                stats.clopper_pearson(k, n, confidence), exact, rtol=1e-10, atol=1e-12
            )


def test_wilson_ends_are_exact_at_zero_and_all():
    # The formula reaches 0 and 1 only up to rounding; the interval must hold them exactly.
    for n in (1, 5, 40, 300, 10**6):
        assert stats.wilson(0, n)[0] == 0.0 and stats.wilson(n, n)[1] == 1.0
    for n in (5, 40, 10**6):
        assert stats.wilson(1, n)[0] > 0.0 and stats.wilson(n - 1, n)[1] < 1.0


def test_mcnemar_exact_matches_statsmodels():
    from statsmodels.stats.contingency_tables import mcnemar

    rng = np.random.default_rng(3)
    tables = [[[5, 0], [0, 7]], [[0, 3], [0, 0]], [[1, 1], [1, 1]], [[9, 12], [30, 4]]]
    tables += [rng.integers(0, 60, (2, 2)).tolist() for _ in range(60)]
    for table in tables:
        want = mcnemar(table, exact=True).pvalue
        assert stats.mcnemar_exact(table[0][1], table[1][0]) == pytest.approx(want, abs=1e-12)


def _f1_reference(truth: np.ndarray, said_yes: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    return f1_score(truth, said_yes, zero_division=0)


def _mcc_reference(truth: np.ndarray, said_yes: np.ndarray) -> float:
    from sklearn.metrics import matthews_corrcoef

    return matthews_corrcoef(truth, said_yes)


def _confusion_statistics(truth: np.ndarray, said_yes: np.ndarray) -> np.ndarray:
    return np.stack(
        [truth & said_yes, ~truth & said_yes, truth & ~said_yes, ~truth & ~said_yes], axis=1
    ).astype(float)


def _f1_of_means(m):
    den = 2 * m[..., 0] + m[..., 1] + m[..., 2]
    return np.where(den > 0, 2 * m[..., 0] / np.where(den > 0, den, 1), 0.0)


def _mcc_of_means(m):
    tp, fp, fn, tn = (m[..., k] for k in range(4))
    den = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return np.where(den > 0, (tp * tn - fp * fn) / np.where(den > 0, den, 1), 0.0)


def _paired_bootstrap_loop(metric, a, b, num_bootstrap, seed, confidence):
    """One resample at a time, each run's metric from its resampled items by `metric(rows)`."""
    rng = np.random.default_rng(seed)
    da, db = [], []
    for _ in range(num_bootstrap):
        index = rng.integers(0, len(a[0]), len(a[0]))
        da.append(metric(*(x[index] for x in a)))
        db.append(metric(*(x[index] for x in b)))
    da, db = np.array(da), np.array(db)
    observed = metric(*b) - metric(*a)
    tails = [(1 - confidence) / 2, (1 + confidence) / 2]
    return {
        "difference": observed,
        "a_interval": np.quantile(da, tails),
        "b_interval": np.quantile(db, tails),
        "difference_interval": np.quantile(db - da, tails),
        "extreme": np.abs(db - da - observed) >= abs(observed),
    }


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["accuracy", "f1", "mcc"])
def test_paired_bootstrap_matches_a_slow_sklearn_loop(seed, name):
    rng = np.random.default_rng(seed)
    n, num_bootstrap = int(rng.integers(20, 120)), 300
    truth = rng.random(n) < 0.5
    runs = [np.where(rng.random(n) < p, truth, ~truth) for p in (0.7, 0.8)]
    if name == "accuracy":
        a, b = ((r == truth).astype(float) for r in runs)
        got = stats.paired_bootstrap(lambda m: m[..., 0], a, b, num_bootstrap, seed, chunk=7)
        want = _paired_bootstrap_loop(np.mean, (a,), (b,), num_bootstrap, seed, 0.95)
    else:
        of_means, reference = {
            "f1": (_f1_of_means, _f1_reference),
            "mcc": (_mcc_of_means, _mcc_reference),
        }[name]
        a, b = (_confusion_statistics(truth, r) for r in runs)
        got = stats.paired_bootstrap(of_means, a, b, num_bootstrap, seed, chunk=7)
        want = _paired_bootstrap_loop(
            reference, (truth, runs[0]), (truth, runs[1]), num_bootstrap, seed, 0.95
        )
    assert got["difference"] == pytest.approx(want["difference"], abs=1e-12)
    for key in ("a_interval", "b_interval", "difference_interval"):
        np.testing.assert_allclose(got[key], want[key], atol=1e-12)
    # The p-value counts the same resamples, ties at |d_b - d| == |d| included.
    extreme = int(want["extreme"].sum())
    assert round(got["p_value"] * (1 + num_bootstrap)) - 1 == extreme
    assert got["num_bootstrap"] == num_bootstrap


def test_paired_bootstrap_resamples_are_chunk_independent_and_seeded():
    rng = np.random.default_rng(4)
    a, b = rng.random((50, 2)), rng.random((50, 2))

    def metric(m):
        return m[..., 0] / (m[..., 0] + m[..., 1])

    runs = [stats.paired_bootstrap(metric, a, b, 101, seed=5, chunk=c) for c in (1, 13, None)]
    assert runs[0] == runs[1] == runs[2]
    assert stats.paired_bootstrap(metric, a, b, 101, seed=6) != runs[0]
    replay = np.random.default_rng(5)
    for block in stats.bootstrap_indices(50, 101, seed=5, chunk=13):
        for row in block:
            np.testing.assert_array_equal(row, replay.integers(0, 50, 50))


def test_paired_bootstrap_of_accuracy_agrees_with_the_normal_approximation():
    # For a difference of paired proportions, var = ((b + c) / n - d^2) / n with b, c the
    # discordant shares' counts: the bootstrap interval's width should be close to 2 z sd.
    rng = np.random.default_rng(7)
    n = 3000
    a = (rng.random(n) < 0.7).astype(float)
    b = np.where(rng.random(n) < 0.8, a, 1 - a)
    got = stats.paired_bootstrap(lambda m: m[..., 0], a, b, 4000, seed=1)
    d = b.mean() - a.mean()
    discordant = np.mean(a != b)
    sd = np.sqrt((discordant - d**2) / n)
    low, high = got["difference_interval"]
    assert high - low == pytest.approx(2 * 1.959964 * sd, rel=0.06)
    assert (low + high) / 2 == pytest.approx(d, abs=0.2 * sd)


def test_paired_bootstrap_of_identical_runs():
    a = np.array([1.0, 0.0, 1.0, 1.0])
    got = stats.paired_bootstrap(lambda m: m[..., 0], a, a, 50)
    assert got["difference"] == 0.0 and got["p_value"] == 1.0
    assert got["difference_interval"] == (0.0, 0.0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stats.wilson(3, 0), "n must be positive"),
        (lambda: stats.wilson(4, 3), "k must be in"),
        (lambda: stats.wilson(1, 3, confidence=0), "confidence"),
        (lambda: stats.mcnemar_exact(-1, 3), "discordant counts"),
        (lambda: stats.mcnemar_exact(1.5, 3), "only_a must be an integer"),
        (
            lambda: stats.paired_bootstrap(lambda m: m[..., 0], np.ones(3), np.ones(4)),
            "one shape",
        ),
        (
            lambda: stats.paired_bootstrap(lambda m: m[..., 0], np.ones(0), np.ones(0)),
            r"\[num_items, num_statistics\]",
        ),
        (
            lambda: stats.paired_bootstrap(lambda m: m[..., 0], [np.nan], [1.0]),
            "non-finite",
        ),
        (lambda: list(stats.bootstrap_indices(5, 0)), "must be positive"),
    ],
)
def test_paired_test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
