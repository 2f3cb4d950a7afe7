"""OODBench's verification statistics (OODBench paper, Sec. 3 and Appendix C), and the intervals
and paired tests that compare MLLM runs on the same items (`ood-jax compare`).

Binomial bounds (`clopper_pearson`, `wilson`, `beta_posterior_bound`), kernel MMD^2 with its
permutation test, upper bounds and TOST-style equivalence (`mmd_equivalence`), the Hard-vs-OOD
tests (`variance_f_test`, `correlation`, `resampling_p_value`), and paired tests of two runs
(`mcnemar_exact`, `paired_bootstrap`). `ood_jax.cli.stats` is the `ood-jax stats` command.
"""

import functools
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

# scipy loads scipy.stats when first used: the command line imports this module for its flags
# in every command, and importing scipy.stats takes 0.7 s.
import scipy

from ood_jax.metrics import bootstrap

Alternative = Literal["two-sided", "greater", "less"]
_ALTERNATIVES = ("two-sided", "greater", "less")

# Pairwise distances for the median heuristic use at most this many points (a fixed-seed random
# subset beyond it): the exact median over N^2/2 pairs is infeasible for large N and a few hundred
# thousand pairs pin it down well.
MEDIAN_HEURISTIC_MAX_POINTS = 1000


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return float(confidence)


def _check_k_n(k: int, n: int) -> tuple[int, int]:
    k, n = _check_count("k", k), _check_count("n", n)
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    return k, n


def _check_vector(name: str, x: object, min_len: int = 1) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size < min_len:
        raise ValueError(f"{name} needs at least {min_len} values, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def _check_points(name: str, x: object) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim == 1:  # one scalar feature per point
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError(f"{name} must be [num_points, num_features], got shape {arr.shape}")
    # The unbiased estimator averages over distinct pairs within each sample.
    if arr.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 points, got {arr.shape[0]}")
    if arr.shape[1] == 0:
        raise ValueError(f"{name} has no features")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def _check_alternative(alternative: str) -> str:
    if alternative not in _ALTERNATIVES:
        raise ValueError(f"alternative must be one of {_ALTERNATIVES}, got {alternative!r}")
    return alternative


# ---------------------------------------------------------------------------------------------
# Binomial bounds
# ---------------------------------------------------------------------------------------------


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided exact (Clopper-Pearson) interval for a binomial proportion from k of n.

    Equal to `scipy.stats.binomtest(k, n).proportion_ci(confidence, method="exact")`. For the
    paper's k=49, n=50 the 95% interval is (0.8935, 0.9995): its lower end is the "theta_min
    ~ 0.89" the paper reports (a one-sided 95% bound would be 0.9086).
    """
    k, n = _check_k_n(k, n)
    alpha = 1.0 - _check_confidence(confidence)
    # Beta quantiles are undefined at a zero shape parameter; the interval ends there are exact.
    low = 0.0 if k == 0 else float(scipy.stats.beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(scipy.stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def clopper_pearson_lower(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact lower confidence bound: the (1 - confidence) Beta(k, n - k + 1) quantile.

    For k=49, n=50 at 95% it is 0.9086 (the two-sided interval's lower end is 0.8935).
    """
    k, n = _check_k_n(k, n)
    alpha = 1.0 - _check_confidence(confidence)
    return 0.0 if k == 0 else float(scipy.stats.beta.ppf(alpha, k, n - k + 1))


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval for a binomial proportion from k of n (no continuity
    correction): every p with |k/n - p| <= z sqrt(p (1 - p) / n), which the score test keeps.

    Equal to statsmodels' `proportion_confint(k, n, 1 - confidence, method="wilson")`. Unlike
    Clopper-Pearson it is not conservative: its coverage is close to the nominal level on
    average over p (Brown, Cai and DasGupta, 2001), so it is usually the shorter of the two.
    """
    k, n = _check_k_n(k, n)
    z = float(scipy.stats.norm.ppf(0.5 + _check_confidence(confidence) / 2))
    p, z2 = k / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # At k = 0 or k = n one end is exactly 0 or 1; the formula reaches it only up to rounding.
    low = 0.0 if k == 0 else max(0.0, center - half)
    high = 1.0 if k == n else min(1.0, center + half)
    return low, high


def beta_posterior_bound(
    k: int, n: int, confidence: float = 0.95, prior: tuple[float, float] = (1.0, 1.0)
) -> float:
    """One-sided lower credible bound on theta: the (1 - confidence) quantile of the posterior.

    The posterior of a Bernoulli rate after k successes in n trials under a Beta(a, b) prior is
    Beta(a + k, b + n - k). k=49, n=50 gives 0.9103 with the uniform prior and 0.9245 with
    Jeffreys' (0.5, 0.5).
    """
    k, n = _check_k_n(k, n)
    confidence = _check_confidence(confidence)
    a, b = prior
    if not (a > 0 and b > 0):
        raise ValueError(f"prior must be two positive Beta parameters, got {prior!r}")
    return float(scipy.stats.beta.ppf(1.0 - confidence, a + k, b + n - k))


# ---------------------------------------------------------------------------------------------
# Kernel MMD
# ---------------------------------------------------------------------------------------------
# In jax, jitted, over fixed-size row blocks of the pooled kernel matrix, so that tens of thousands
# of points never materialize an N x N matrix; a permutation test evaluates a chunk of
# permutations per pass over the kernel, as one matmul per row block.


def _median_pairwise_distance(z: jax.Array, seed: int = 0) -> jax.Array:
    if z.shape[0] > MEDIAN_HEURISTIC_MAX_POINTS:
        idx = jax.random.choice(
            jax.random.PRNGKey(seed), z.shape[0], (MEDIAN_HEURISTIC_MAX_POINTS,), replace=False
        )
        z = z[idx]
    sq = jnp.sum(z * z, axis=-1)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * z @ z.T, 0)
    iu = jnp.triu_indices(z.shape[0], k=1)
    med = jnp.median(jnp.sqrt(d2[iu]))
    # A zero median (more than half the pairs are duplicates) would make the kernel an identity
    # test; unit bandwidth keeps the statistic defined.
    return jnp.where(med > 0, med, 1.0)


def _kernel_rows(
    z: jax.Array, sq: jax.Array, start: jax.Array, block_size: int, gamma: jax.Array
) -> jax.Array:
    """RBF kernel of rows [start, start + block_size) of z against all of z [block_size, N],
    zero where a row meets itself: the unbiased estimators exclude i == j pairs exactly."""
    zb = jax.lax.dynamic_slice_in_dim(z, start, block_size)
    rows = start + jnp.arange(block_size)
    d2 = jnp.maximum(sq[rows, None] + sq[None, :] - 2 * zb @ z.T, 0)
    kernel = jnp.exp(-gamma * d2)
    return jnp.where(rows[:, None] == jnp.arange(z.shape[0])[None, :], 0.0, kernel)


def _map_row_blocks(
    z: jax.Array,
    bandwidth: jax.Array,
    block_size: int,
    block_fn: Callable[..., jax.Array],
    columns: tuple[jax.Array, ...] = (),
) -> jax.Array:
    """block_fn(kernel_rows, *column_rows) for each row block of z, stacked [num_blocks, ...].

    kernel_rows is the block's [block_size, N] kernel (see _kernel_rows) and column_rows the
    block's rows of each array in `columns`; one block at a time keeps memory O(block_size * N).
    """
    sq = jnp.sum(z * z, axis=-1)
    gamma = 1.0 / (2.0 * bandwidth**2)

    def one_block(i: jax.Array) -> jax.Array:
        start = i * block_size
        rows = [jax.lax.dynamic_slice_in_dim(c, start, block_size) for c in columns]
        return block_fn(_kernel_rows(z, sq, start, block_size, gamma), *rows)

    return jax.lax.map(one_block, jnp.arange(z.shape[0] // block_size))


@functools.partial(jax.jit, static_argnames=("m", "n", "block_size"))
def _mmd2_columns(
    z: jax.Array, labels: jax.Array, bandwidth: jax.Array, *, m: int, n: int, block_size: int
) -> jax.Array:
    """Unbiased MMD^2 for each labelling column of `labels` ([N_pad, P], 1 = first sample).

    Rows of z past the real points are padding and carry label 0 and valid 0. Each row i adds
    its own term, e.g. for i in X: sum_{j in X, j != i} k_ij / (m (m-1)) - sum_{j in Y} k_ij / (m n),
    so the large X-X / Y-Y / X-Y sums cancel per row rather than after summing N^2 terms.
    """
    valid = (jnp.arange(z.shape[0]) < m + n).astype(z.dtype)

    def block_terms(kb: jax.Array, lb: jax.Array, vb: jax.Array) -> jax.Array:
        rx = kb @ labels  # sum over j in X of k_ij, per labelling
        ry = (kb @ valid)[:, None] - rx  # sum over j in Y
        in_x, in_y = lb, vb[:, None] - lb
        terms = in_x * (rx / (m * (m - 1)) - ry / (m * n)) + in_y * (
            ry / (n * (n - 1)) - rx / (m * n)
        )
        return jnp.sum(terms, axis=0)

    return jnp.sum(_map_row_blocks(z, bandwidth, block_size, block_terms, (labels, valid)), axis=0)


def _pooled(x: object, y: object, block_size: int) -> tuple[jax.Array, int, int]:
    x, y = _check_points("x", x), _check_points("y", y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x and y must have the same feature dim, got {x.shape[1]} and {y.shape[1]}"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    # float64 only where jax_enable_x64 is on; float32 otherwise.
    dtype = jax.dtypes.canonicalize_dtype(np.result_type(x.dtype, y.dtype, np.float32))
    z = np.concatenate([x, y]).astype(np.float64)
    # Distances are translation invariant; centering keeps |a|^2 + |b|^2 - 2ab accurate.
    z = (z - z.mean(axis=0)).astype(dtype)
    pad = -len(z) % block_size
    return jnp.asarray(np.pad(z, ((0, pad), (0, 0)))), len(x), len(y)


def _resolve_bandwidth(z: jax.Array, num_points: int, bandwidth: float | None) -> jax.Array:
    if bandwidth is None:
        return _median_pairwise_distance(z[:num_points])
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    return jnp.asarray(bandwidth, z.dtype)


def _check_draws(name: str, count: object, chunk_name: str, chunk: int) -> int:
    """`count` random draws (permutations, resamples) scored `chunk` at a time; both positive."""
    count = _check_count(name, count)
    if count <= 0:
        raise ValueError(f"{name} must be positive, got {count}")
    if chunk <= 0:
        raise ValueError(f"{chunk_name} must be positive, got {chunk}")
    return count


def median_heuristic_bandwidth(x: object, y: object) -> float:
    """Median Euclidean distance over distinct pairs of the pooled points (subsampled past
    MEDIAN_HEURISTIC_MAX_POINTS with a fixed seed)."""
    z, m, n = _pooled(x, y, 1)
    return float(_median_pairwise_distance(z[: m + n]))


def mmd2_unbiased(
    x: object, y: object, bandwidth: float | None = None, block_size: int = 256
) -> float:
    """Unbiased MMD^2 between samples x [m, d] and y [n, d] with k(a, b) = exp(-|a-b|^2 / (2 s^2)).

    s = `bandwidth`, or the median heuristic on the pooled points when None. Memory is
    O(block_size * (m + n)). The unbiased estimate can be slightly negative when x and y come
    from the same distribution.
    """
    z, m, n = _pooled(x, y, block_size)
    s = _resolve_bandwidth(z, m + n, bandwidth)
    labels = (jnp.arange(z.shape[0]) < m).astype(z.dtype)[:, None]
    return float(_mmd2_columns(z, labels, s, m=m, n=n, block_size=block_size)[0])


def mmd_permutation_test(
    x: object,
    y: object,
    num_permutations: int = 1000,
    seed: int = 0,
    bandwidth: float | None = None,
    block_size: int = 256,
    permutation_chunk: int = 128,
) -> tuple[float, float]:
    """Permutation test of P_x == P_y with the unbiased MMD^2; returns (mmd2, p_value).

    p = (1 + #{permutations with MMD^2 >= observed}) / (1 + num_permutations). The median
    bandwidth is computed once on the pooled set, which every permutation shares. Each pass over
    the kernel matrix scores `permutation_chunk` relabellings at once.
    """
    num_permutations = _check_draws(
        "num_permutations", num_permutations, "permutation_chunk", permutation_chunk
    )
    z, m, n = _pooled(x, y, block_size)
    s = _resolve_bandwidth(z, m + n, bandwidth)
    n_pad = z.shape[0]
    score = functools.partial(_mmd2_columns, z, bandwidth=s, m=m, n=n, block_size=block_size)
    observed = score((jnp.arange(n_pad) < m).astype(z.dtype)[:, None])[0]

    @jax.jit
    def relabel(keys: jax.Array) -> jax.Array:
        # Point i joins X when its rank in a random permutation is < m; padding stays unlabelled.
        ranks = jax.vmap(lambda k: jax.random.permutation(k, m + n))(keys)
        labels = (ranks < m).astype(z.dtype).T
        return jnp.pad(labels, ((0, n_pad - m - n), (0, 0)))

    keys = jax.random.split(jax.random.PRNGKey(seed), num_permutations)
    chunk = min(permutation_chunk, num_permutations)
    # Pad the key list so every chunk has the same shape and compiles once.
    keys = jnp.concatenate([keys, keys[: -num_permutations % chunk]])
    null = jnp.concatenate(
        [score(relabel(keys[i : i + chunk])) for i in range(0, len(keys), chunk)]
    )[:num_permutations]
    p_value = (1 + int(jnp.sum(null >= observed))) / (1 + num_permutations)
    return float(observed), p_value


@functools.partial(jax.jit, static_argnames=("block_size",))
def _weighted_mmd2_columns(
    z: jax.Array, wx: jax.Array, wy: jax.Array, bandwidth: jax.Array, *, block_size: int
) -> jax.Array:
    """MMD^2 of weighted samples, one per column of wx / wy ([N_pad, P], zero off each sample).

    Point i of X carries weight wx_i (its multiplicity in a resample), and the within-sample
    sums run over pairs of distinct *points*, i != j, weighted w_i w_j:
      sum_{i != j} wx_i wx_j k_ij / ((sum wx)^2 - sum wx^2) + (same for Y)
      - 2 sum_{i, j} wx_i wy_j k_ij / (sum wx sum wy).
    With unit weights this is exactly the unbiased estimator; under bootstrap weights a point
    drawn twice never meets itself, so the k(x, x) = 1 terms that would inflate the within-sample
    means (by O(1/m), the size of the statistic itself near zero) are left out.
    """

    def block_terms(kb: jax.Array, wxb: jax.Array, wyb: jax.Array) -> jax.Array:
        # Per row: weighted kernel sums towards X and Y; stacked so the three sums come out at once.
        kx, ky = kb @ wx, kb @ wy
        return jnp.stack(
            [jnp.sum(wxb * kx, axis=0), jnp.sum(wyb * ky, axis=0), jnp.sum(wxb * ky, axis=0)]
        )

    xx, yy, xy = jnp.sum(_map_row_blocks(z, bandwidth, block_size, block_terms, (wx, wy)), axis=0)
    sx, sy = jnp.sum(wx, axis=0), jnp.sum(wy, axis=0)
    dxx = sx**2 - jnp.sum(wx**2, axis=0)
    dyy = sy**2 - jnp.sum(wy**2, axis=0)
    return xx / dxx + yy / dyy - 2 * xy / (sx * sy)


def bootstrap_weights(
    m: int, n: int, num_bootstrap: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Multiplicities [B, m] and [B, n] of the points in B resamples (with replacement) of x, y.

    Drawn with numpy's default_rng(seed): row b resamples x by `rng.integers(0, m, m)` and then y
    by `rng.integers(0, n, n)`, so a reference can replay the exact resamples.
    """
    rng = np.random.default_rng(seed)
    wx, wy = np.zeros((num_bootstrap, m)), np.zeros((num_bootstrap, n))
    for b in range(num_bootstrap):
        wx[b] = np.bincount(rng.integers(0, m, m), minlength=m)
        wy[b] = np.bincount(rng.integers(0, n, n), minlength=n)
    return wx, wy


def mmd2_bootstrap(
    x: object,
    y: object,
    num_bootstrap: int = 1000,
    seed: int = 0,
    bandwidth: float | None = None,
    block_size: int = 256,
    bootstrap_chunk: int = 64,
) -> np.ndarray:
    """MMD^2 of `num_bootstrap` resamples of (x, y), each sample resampled with replacement.

    Every resample is scored with the estimator of `_weighted_mmd2_columns` (the unbiased one
    with pairs of a point with itself left out), on one kernel bandwidth: `bandwidth`, or the
    median heuristic on the original pooled points. `bootstrap_chunk` resamples share a pass.
    """
    num_bootstrap = _check_draws("num_bootstrap", num_bootstrap, "bootstrap_chunk", bootstrap_chunk)
    z, m, n = _pooled(x, y, block_size)
    s = _resolve_bandwidth(z, m + n, bandwidth)
    wx, wy = bootstrap_weights(m, n, num_bootstrap, seed)
    n_pad = z.shape[0]
    chunk = min(bootstrap_chunk, num_bootstrap)
    out = []
    for start in range(0, num_bootstrap, chunk):
        bx, by = wx[start : start + chunk], wy[start : start + chunk]
        # Pad the last chunk with copies of its first resample: one shape, one compile.
        pad = chunk - len(bx)
        bx, by = (
            np.concatenate([bx, bx[:1].repeat(pad, 0)]),
            np.concatenate([by, by[:1].repeat(pad, 0)]),
        )
        cols_x = np.zeros((n_pad, chunk))
        cols_y = np.zeros((n_pad, chunk))
        cols_x[:m], cols_y[m : m + n] = bx.T, by.T
        values = _weighted_mmd2_columns(
            z, jnp.asarray(cols_x, z.dtype), jnp.asarray(cols_y, z.dtype), s, block_size=block_size
        )
        out.append(np.asarray(values)[: chunk - pad])
    return np.concatenate(out).astype(np.float64)


@functools.partial(jax.jit, static_argnames=("block_size",))
def _kernel_row_sums(
    z: jax.Array, in_x: jax.Array, valid: jax.Array, bandwidth: jax.Array, *, block_size: int
) -> jax.Array:
    """[N_pad, 2]: per point, the kernel sums towards X (j != i) and towards Y."""

    def block_sums(kb: jax.Array) -> jax.Array:
        to_x = kb @ in_x
        return jnp.stack([to_x, kb @ valid - to_x], axis=-1)

    return _map_row_blocks(z, bandwidth, block_size, block_sums).reshape(z.shape[0], 2)


def mmd2_jackknife(
    x: object, y: object, bandwidth: float | None = None, block_size: int = 256
) -> tuple[float, float]:
    """(unbiased MMD^2, its jackknife standard error), from one pass over the kernel matrix.

    The two-sample jackknife (Arvesen, 1969) leaves out each point of x and of y in turn:
    var = (m-1)/m sum_i (T_-i - mean)^2 + (n-1)/n sum_j (T_-j - mean)^2. Every leave-one-out
    statistic follows from the kernel's row sums, so no resampling is needed. By the Efron-Stein
    inequality the jackknife variance is, in expectation, at least the true variance.
    """
    z, m, n = _pooled(x, y, block_size)
    if m < 3 or n < 3:
        raise ValueError(f"the jackknife needs at least 3 points per sample, got {m} and {n}")
    s = _resolve_bandwidth(z, m + n, bandwidth)
    index = jnp.arange(z.shape[0])
    in_x = (index < m).astype(z.dtype)
    valid = (index < m + n).astype(z.dtype)
    sums = np.asarray(_kernel_row_sums(z, in_x, valid, s, block_size=block_size), dtype=np.float64)
    within_x, cross_x = sums[:m, 0], sums[:m, 1]
    cross_y, within_y = sums[m : m + n, 0], sums[m : m + n, 1]
    a, b, c = within_x.sum(), within_y.sum(), cross_x.sum()
    estimate = a / (m * (m - 1)) + b / (n * (n - 1)) - 2 * c / (m * n)
    # Leaving out x_i removes its row and column from the X-X sum and its row from X-Y.
    without_x = (
        (a - 2 * within_x) / ((m - 1) * (m - 2)) + b / (n * (n - 1))
        - 2 * (c - cross_x) / ((m - 1) * n)
    )  # fmt: skip
    without_y = (
        a / (m * (m - 1)) + (b - 2 * within_y) / ((n - 1) * (n - 2))
        - 2 * (c - cross_y) / (m * (n - 1))
    )  # fmt: skip
    variance = (m - 1) / m * np.sum((without_x - without_x.mean()) ** 2) + (n - 1) / n * np.sum(
        (without_y - without_y.mean()) ** 2
    )
    return float(estimate), float(np.sqrt(variance))


UPPER_BOUND_METHODS = ("jackknife", "bootstrap")


def mmd2_upper_bound(
    x: object,
    y: object,
    confidence: float = 0.95,
    method: str = "jackknife",
    num_bootstrap: int = 1000,
    seed: int = 0,
    bandwidth: float | None = None,
    block_size: int = 256,
) -> dict:
    """One-sided upper confidence bound on MMD^2(P_x, P_y).

    The paper states that "the upper confidence bound of MMD^2(P_train, P_val)" lies below the
    margin without saying how it is built. Two constructions:
      * "jackknife" (default): estimate + z_confidence * jackknife standard error
        (`mmd2_jackknife`), the normal approximation of the U-statistic with a variance that is
        conservative on average. In simulations (m = n = 60, 4-D Gaussians) it covered the
        true MMD^2 in ~93% of draws at 95%, both under a shift and at P_x = P_y.
      * "bootstrap": the `confidence` quantile of `mmd2_bootstrap`. Near P_x = P_y the
        statistic is degenerate and resampling widens its spread, so this bound is very
        conservative there: in six draws of two samples of one 4-D Gaussian (200 and 150
        points) it stayed above the within-split margin every time (1.04-2.4x), while the
        jackknife bound fell below it in 4 of 6 such draws.
    Returns mmd2 (the point estimate), upper (the bound), method and confidence (plus std for
    the jackknife, num_bootstrap for the bootstrap).
    """
    confidence = _check_confidence(confidence)
    if method == "jackknife":
        estimate, std = mmd2_jackknife(x, y, bandwidth, block_size)
        upper = estimate + float(scipy.stats.norm.ppf(confidence)) * std
        return {
            "mmd2": estimate,
            "upper": upper,
            "std": std,
            "method": method,
            "confidence": confidence,
        }
    if method != "bootstrap":
        raise ValueError(f"method must be one of {UPPER_BOUND_METHODS}, got {method!r}")
    estimate = mmd2_unbiased(x, y, bandwidth, block_size)
    samples = mmd2_bootstrap(x, y, num_bootstrap, seed, bandwidth, block_size)
    return {
        "mmd2": estimate,
        "upper": float(np.quantile(samples, confidence)),
        "method": method,
        "confidence": confidence,
        "num_bootstrap": int(num_bootstrap),
    }


def mmd_equivalence(
    train: object,
    val: object,
    num_splits: int = 100,
    quantile: float = 0.95,
    confidence: float = 0.95,
    method: str = "jackknife",
    num_bootstrap: int = 1000,
    seed: int = 0,
    bandwidth: float | None = None,
    block_size: int = 256,
) -> dict:
    """The paper's equivalence check of train-OOD and val-OOD, end to end.

    One kernel for everything: `bandwidth`, or the median heuristic on `train`. Margin xi = the
    `quantile` of MMD^2 between the halves of `num_splits` random splits of `train`; the statistic
    is the upper confidence bound of MMD^2(train, val) (`mmd2_upper_bound` with `method`);
    equivalence when it is below xi (`tost_equivalence`). Rows are points of the joint space the
    test runs in, e.g. an image embedding concatenated with its category's text embedding.
    """
    train = _check_points("train", train)
    val = _check_points("val", val)
    if bandwidth is None:
        half = len(train) // 2
        bandwidth = median_heuristic_bandwidth(train[:half], train[half:])
    null = within_split_mmd2(train, num_splits, seed, bandwidth, block_size)
    bound = mmd2_upper_bound(
        train, val, confidence, method, num_bootstrap, seed, bandwidth, block_size
    )
    decision = tost_equivalence(bound["upper"], null, quantile)
    return {**decision, **bound, "bandwidth": float(bandwidth), "num_splits": int(num_splits)}


def within_split_mmd2(
    x: object,
    num_splits: int = 100,
    seed: int = 0,
    bandwidth: float | None = None,
    block_size: int = 256,
) -> np.ndarray:
    """MMD^2 between the two halves of random splits of x: the paper's intra-distribution
    fluctuations D^(1), D^(2) ~ P_train whose 95th percentile is the equivalence margin.

    The bandwidth (median heuristic on x when None) is fixed across splits so that the margin and
    the observed statistic use the same kernel: pass the same value to `mmd2_unbiased`.
    """
    x = _check_points("x", x)
    num_splits = _check_count("num_splits", num_splits)
    if num_splits <= 0:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    if len(x) < 4:
        raise ValueError(f"x needs at least 4 points to split into halves, got {len(x)}")
    if bandwidth is None:
        bandwidth = median_heuristic_bandwidth(x[: len(x) // 2], x[len(x) // 2 :])
    rng = np.random.default_rng(seed)
    half = len(x) // 2
    out = np.empty(num_splits)
    for i in range(num_splits):
        perm = rng.permutation(len(x))
        out[i] = mmd2_unbiased(x[perm[:half]], x[perm[half:]], bandwidth, block_size)
    return out


# ---------------------------------------------------------------------------------------------
# Equivalence, variance, correlation and resampling tests
# ---------------------------------------------------------------------------------------------


def tost_equivalence(value: float, null_samples: object, quantile: float = 0.95) -> dict:
    """The paper's MMD equivalence rule between train-OOD and val-OOD.

    Margin xi = the `quantile` (95th percentile) of `null_samples`, the MMD^2 values between
    random splits of one distribution (`within_split_mmd2`). Hypotheses:
    H0: MMD^2(P_train, P_val) >= xi (not equivalent) vs H1: MMD^2 < xi (equivalent).
    H0 is rejected, and equivalence declared, when `value` < xi. Pass as `value` the upper
    confidence bound of MMD^2 as the paper does (or the point estimate, a weaker claim). Only
    this upper side is tested: the lower TOST side (MMD^2 > -xi) holds for any population MMD^2,
    which is non-negative.

    Returns statistic, threshold (xi), quantile, equivalent (bool) and null_fraction_below: the
    share of within-distribution fluctuations smaller than `value`.
    """
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
    null = _check_vector("null_samples", null_samples)
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"value must be finite, got {value}")
    threshold = float(np.quantile(null, quantile))
    return {
        "statistic": value,
        "threshold": threshold,
        "quantile": float(quantile),
        "equivalent": bool(value < threshold),
        "null_fraction_below": float(np.mean(null < value)),
    }


def variance_f_test(
    x: object, y: object, alternative: Alternative = "two-sided"
) -> tuple[float, float]:
    """F-test of equal variances: F = var(x) / var(y) (ddof=1), df = (len(x)-1, len(y)-1).

    "greater" tests var(x) > var(y): the paper's Hard-vs-OOD F(8, 8) = 4.59, p = 0.0227 is this
    one-sided p (two-sided it would be 0.045).
    """
    x, y = _check_vector("x", x, 2), _check_vector("y", y, 2)
    alternative = _check_alternative(alternative)
    vx, vy = np.var(x, ddof=1), np.var(y, ddof=1)
    if vy == 0:
        raise ValueError("y has zero variance; the F ratio is undefined")
    f = float(vx / vy)
    dfn, dfd = len(x) - 1, len(y) - 1
    upper, lower = float(scipy.stats.f.sf(f, dfn, dfd)), float(scipy.stats.f.cdf(f, dfn, dfd))
    p = {"greater": upper, "less": lower, "two-sided": min(1.0, 2 * min(upper, lower))}
    return f, p[alternative]


def correlation(x: object, y: object) -> dict[str, tuple[float, float]]:
    """Pearson and Spearman correlations with their two-sided p-values (scipy)."""
    x, y = _check_vector("x", x, 2), _check_vector("y", y, 2)
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    pr, sr = scipy.stats.pearsonr(x, y), scipy.stats.spearmanr(x, y)
    return {
        "pearson": (float(pr.statistic), float(pr.pvalue)),
        "spearman": (float(sr.statistic), float(sr.pvalue)),
    }


def resampling_p_value(
    observed: float, samples: object, alternative: Alternative = "greater"
) -> float:
    """Empirical p-value of `observed` against a resampled baseline of B `samples`.

    "greater": (1 + #{samples >= observed}) / (1 + B); "less": (1 + #{samples <= observed}) /
    (1 + B), the left tail the paper uses for the OOD-vs-Hard variance and correlation tests
    (its p < 1/(B+1) with B=1000 means no baseline draw was as low); "two-sided": twice the
    smaller tail, capped at 1.
    """
    samples = _check_vector("samples", samples)
    alternative = _check_alternative(alternative)
    observed = float(observed)
    if not np.isfinite(observed):
        raise ValueError(f"observed must be finite, got {observed}")
    b = len(samples)
    upper = (1 + int(np.sum(samples >= observed))) / (1 + b)
    lower = (1 + int(np.sum(samples <= observed))) / (1 + b)
    p = {"greater": upper, "less": lower, "two-sided": min(1.0, 2 * min(upper, lower))}
    return p[alternative]


# ---------------------------------------------------------------------------------------------
# Paired tests of two runs on the same items
# ---------------------------------------------------------------------------------------------


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs of two paired binary outcomes:
    `only_a` items that A got right and B wrong, `only_b` the other way round.

    Under H0 (both equally accurate) each discordant item is a fair coin, so the p-value is
    twice the smaller binomial tail of Binomial(only_a + only_b, 1/2), capped at 1; without
    discordant items it is 1. Equal to statsmodels' `mcnemar([[., only_a], [only_b, .]],
    exact=True).pvalue`. The items both runs got right or wrong carry no evidence either way.
    """
    only_a, only_b = _check_count("only_a", only_a), _check_count("only_b", only_b)
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a} and {only_b}")
    discordant = only_a + only_b
    if discordant == 0:
        return 1.0
    return min(1.0, 2.0 * float(scipy.stats.binom.cdf(min(only_a, only_b), discordant, 0.5)))


# Item indices of the resamples scored at once in paired_bootstrap: [chunk, n] int64 of at most
# this many entries (32 MiB), and as much again for the one statistic gathered at a time.
BOOTSTRAP_CHUNK_ITEMS = 1 << 22


def bootstrap_indices(n: int, num_bootstrap: int, seed: int = 0, chunk: int = 256) -> Iterator:
    """The item indices of `num_bootstrap` resamples of n items with replacement, `chunk`
    resamples ([<= chunk, n] int arrays) at a time.

    Resample b is what the b-th call of `rng.integers(0, n, n)` on `numpy.random.default_rng(
    seed)` returns (numpy draws a [chunk, n] block from the same stream), so a plain loop can
    replay them.
    """
    n = _check_count("n", n)
    num_bootstrap = _check_count("num_bootstrap", num_bootstrap)
    if n <= 0 or num_bootstrap <= 0 or chunk <= 0:
        raise ValueError(
            f"n, num_bootstrap and chunk must be positive, got {n}, {num_bootstrap}, {chunk}"
        )
    rng = np.random.default_rng(seed)
    for start in range(0, num_bootstrap, chunk):
        yield rng.integers(0, n, (min(chunk, num_bootstrap - start), n))


def _resampled_means(indices: np.ndarray, statistics: np.ndarray) -> np.ndarray:
    """[R, k]: the per-item statistics [n, k] averaged over each resample's items [R, n]."""
    # One gather per statistic: a [R, n, k] gather would cost k times the memory and, in
    # practice, is slower than k gathers of one column each.
    sums = [column[indices].sum(axis=1) for column in statistics.T]
    return np.stack(sums, axis=-1) / indices.shape[1]


def _check_statistics(name: str, x: object) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:  # one statistic per item
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"{name} must be [num_items, num_statistics], got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def paired_bootstrap(
    metric: Callable[[np.ndarray], np.ndarray],
    a: object,
    b: object,
    num_bootstrap: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    chunk: int | None = None,
) -> dict:
    """Paired bootstrap over items of metric(B) - metric(A), two runs scored on the same items.

    `a` and `b` are per-item statistics [n, k] (row i: item i in each run), and `metric` maps
    their means over items [..., k] to the metric [...], e.g. accuracy from [correct] or F1
    from the confusion indicators [tp, fp, fn, tn]; every yes/no metric is such a function.
    Each resample draws n items with replacement (`bootstrap_indices`) and scores both runs on
    the same draw, so what the runs share (easy and hard items) cancels in the difference.

    `chunk` resamples are scored at a time (default: as many as keep a chunk's item indices
    within BOOTSTRAP_CHUNK_ITEMS); the numbers do not depend on it.

    Returns a, b and difference (the observed values), a_interval, b_interval and
    difference_interval (percentile intervals at `confidence` of the resampled values),
    p_value and num_bootstrap. The p-value is two-sided for H0 "no difference", by the
    bootstrap's distribution shifted to the null (Efron and Tibshirani, 1993, ch. 16):
    (1 + #{|d_b - d| >= |d|}) / (1 + B), with d the observed difference and d_b a resample's.
    """
    a, b = _check_statistics("a", a), _check_statistics("b", b)
    if a.shape != b.shape:
        raise ValueError(
            f"a and b must be paired statistics of one shape, got {a.shape} and {b.shape}"
        )
    confidence = _check_confidence(confidence)
    observed_a, observed_b = (float(metric(x.mean(axis=0))) for x in (a, b))
    difference = observed_b - observed_a
    both = np.concatenate([a, b], axis=1)
    k = a.shape[1]
    if chunk is None:
        chunk = max(1, BOOTSTRAP_CHUNK_ITEMS // len(a))
    resampled_a, resampled_b = [], []
    for indices in bootstrap_indices(len(a), num_bootstrap, seed, chunk):
        means = _resampled_means(indices, both)
        resampled_a.append(metric(means[:, :k]))
        resampled_b.append(metric(means[:, k:]))
    samples_a, samples_b = np.concatenate(resampled_a), np.concatenate(resampled_b)
    differences = samples_b - samples_a
    extreme = int(np.sum(np.abs(differences - difference) >= abs(difference)))
    return {
        "a": observed_a,
        "b": observed_b,
        "difference": difference,
        "a_interval": bootstrap.percentile_interval(samples_a, confidence),
        "b_interval": bootstrap.percentile_interval(samples_b, confidence),
        "difference_interval": bootstrap.percentile_interval(differences, confidence),
        "p_value": (1 + extreme) / (1 + len(differences)),
        "num_bootstrap": len(differences),
    }
