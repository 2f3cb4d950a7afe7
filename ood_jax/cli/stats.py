"""`ood-jax stats`: OODBench's statistical checks (ood_jax.stats) run from result and embedding
files, and FOCI's clip-conditional accuracy of two eval-mllm runs. `add_command` adds a check
with --json and examples; `emit`, `count` and `probability` serve every command that prints
numbers (ood_jax.cli.compare)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ood_jax import files, stats
from ood_jax.cli import help_text
from ood_jax.stats import inputs


def add_command(
    commands, name: str, help: str, run, *, examples: Sequence[str]
) -> argparse.ArgumentParser:
    """One `ood-jax stats NAME` check with a --json flag; `run(args)` returns what it printed.
    `examples`: whole command lines shown at the end of its --help."""
    q = commands.add_parser(
        name,
        help=help,
        description=help_text.fill(help),
        epilog=help_text.examples(*examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("--json", action="store_true", help="print the numbers as JSON")
    q.set_defaults(run=run)
    return q


def emit(args: argparse.Namespace, result: dict, lines: list[str]) -> dict:
    """Prints `result` as JSON (--json) or `lines` as text; returns `result`."""
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines))
    return result


def count(low: int):
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def _fail(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


CLOPPER_PEARSON_EXAMPLE = "ood-jax stats clopper-pearson 49 50"
DROPS_EXAMPLE = (
    "ood-jax stats drops --results runs/qwen/results.json runs/llava/results.json "
    "--out drops_hard.json"
)
F_TEST_EXAMPLE = "ood-jax stats f-test --x drops_hard.json --y drops_ood.json"


def add_parsers(subparsers):
    """Adds `ood-jax stats` to `subparsers`; returns the action its checks are added to."""
    p = subparsers.add_parser(
        "stats",
        help="OODBench's statistical checks from result and embedding files",
        description=help_text.fill(
            "The checks behind OODBench's claim that its data is OOD: binomial bounds on the "
            "share of models that see it as OOD, MMD equivalence of train-OOD and val-OOD, and "
            "the Hard-vs-OOD variance, correlation and resampling tests on accuracy drops; "
            "McNemar's exact test of two models on the same items; and FOCI's accuracy of an "
            "LVLM where the CLIP baseline is right and where it is wrong."
        ),
        epilog=help_text.examples(CLOPPER_PEARSON_EXAMPLE, DROPS_EXAMPLE, F_TEST_EXAMPLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="stats_command", required=True)
    for add in (
        _add_binomial,
        _add_mcnemar,
        _add_mmd,
        _add_equivalence,
        _add_f_test,
        _add_correlation,
        _add_resampling,
        _add_drops,
        _add_clip_conditional,
    ):
        add(sub)
    return sub


def _add_binomial(sub) -> None:
    q = add_command(
        sub,
        "clopper-pearson",
        "exact binomial (Clopper-Pearson) and Wilson intervals and the Beta-posterior lower "
        "bound for K of N (e.g. 49 of 50 models treat the data as OOD, or 412 of 500 answers "
        "right)",
        _stats_binomial,
        examples=[
            CLOPPER_PEARSON_EXAMPLE,
            "ood-jax stats clopper-pearson 49 50 --confidence 0.99 --prior jeffreys --json",
        ],
    )
    q.add_argument("k", type=int)
    q.add_argument("n", type=int)
    q.add_argument("--confidence", type=probability, default=0.95)
    q.add_argument("--prior", choices=("uniform", "jeffreys"), default="uniform")


def _add_mcnemar(sub) -> None:
    q = add_command(
        sub,
        "mcnemar",
        "exact McNemar test of two models answering the same items: ONLY_A items only A got "
        "right, ONLY_B only B (`ood-jax compare` counts them from two run directories)",
        _stats_mcnemar,
        examples=["ood-jax stats mcnemar 21 9"],
    )
    q.add_argument("only_a", type=count(0), help="items A answered right and B wrong")
    q.add_argument("only_b", type=count(0), help="items B answered right and A wrong")


def _add_mmd(sub) -> None:
    q = add_command(
        sub,
        "mmd",
        "unbiased Gaussian-kernel MMD^2 between two point sets (.npy)",
        _stats_mmd,
        examples=[
            "ood-jax stats mmd --x features/train_ood.npy --y features/val_ood.npy "
            "--permutations 2000"
        ],
    )
    _points_arguments(q, "--x", "--y")
    q.add_argument(
        "--permutations", type=count(0), default=1000, help="permutation test draws (0: none)"
    )
    _upper_bound_arguments(q)


def _add_equivalence(sub) -> None:
    q = add_command(
        sub,
        "equivalence",
        "MMD equivalence of train-OOD and val-OOD: the upper confidence bound of MMD^2 below the "
        "95th percentile of within-train split MMD^2",
        _stats_equivalence,
        examples=[
            "ood-jax stats equivalence --train features/train_ood.npy --val features/val_ood.npy",
            "ood-jax stats equivalence --train features/train_ood.npy --val features/val_ood.npy "
            "\\\n      --method bootstrap --bootstrap 2000 --confidence 0.99",
        ],
    )
    _points_arguments(q, "--train", "--val")
    q.add_argument(
        "--splits", type=count(1), default=100, help="random splits of train for the margin"
    )
    q.add_argument("--quantile", type=probability, default=0.95, help="margin quantile")
    _upper_bound_arguments(q)


def _add_f_test(sub) -> None:
    q = add_command(
        sub,
        "f-test",
        "variance F-test of two drop vectors: F = var(x) / var(y) (paper: x = Hard, y = OOD, "
        "alternative greater)",
        _stats_f_test,
        examples=[F_TEST_EXAMPLE],
    )
    _vector_arguments(q)
    q.add_argument("--alternative", choices=("greater", "less", "two-sided"), default="greater")


def _add_correlation(sub) -> None:
    q = add_command(
        sub,
        "correlation",
        "Pearson and Spearman correlation of two drop vectors",
        _stats_correlation,
        examples=["ood-jax stats correlation --x drops_hard.json --y drops_ood.json"],
    )
    _vector_arguments(q)


def _add_resampling(sub) -> None:
    q = add_command(
        sub,
        "resampling",
        "empirical p-value of an observed statistic against resampled baseline values",
        _stats_resampling,
        examples=["ood-jax stats resampling --observed 0.12 --samples resampled_drops.npy"],
    )
    q.add_argument("--observed", type=float, required=True)
    q.add_argument("--samples", required=True, help="baseline values (.npy or .json list)")
    q.add_argument("--alternative", choices=("greater", "less", "two-sided"), default="less")


def _add_drops(sub) -> None:
    q = add_command(
        sub,
        "drops",
        "per-model drops (reference split minus shifted split) from eval-mllm results.json files",
        _stats_drops,
        examples=[
            DROPS_EXAMPLE,
            "ood-jax stats drops --results runs/qwen/results.json runs/llava/results.json "
            "\\\n      --metric f1 --shifted ood_s --out drops_ood.json",
        ],
    )
    q.add_argument("--results", nargs="+", required=True, help="one results.json per model")
    q.add_argument("--metric", default="accuracy", help="accuracy, precision, recall, f1, mcc, ...")
    q.add_argument("--reference", default="id", help="split of the reference numbers (default id)")
    q.add_argument(
        "--shifted", default="ood_h", help="split of the shifted numbers (default ood_h)"
    )
    q.add_argument("--out", help="also write {models, drops} here (input to f-test/correlation)")


def _add_clip_conditional(sub) -> None:
    q = add_command(
        sub,
        "clip-conditional",
        "FOCI Fig. 4: LVLM accuracy where the CLIP baseline is right and where it is wrong",
        _stats_clip_conditional,
        examples=["ood-jax stats clip-conditional --lvlm runs/foci_qwen --clip runs/foci_clip"],
    )
    q.add_argument("--lvlm", required=True, help="eval-mllm output directory of the LVLM")
    q.add_argument("--clip", required=True, help="eval-mllm --clip output directory")


def _points_arguments(q: argparse.ArgumentParser, first: str, second: str) -> None:
    q.add_argument(first, required=True, help="points [N, D] (.npy)")
    q.add_argument(second, required=True, help="points [M, D] (.npy)")
    q.add_argument(
        "--bandwidth",
        type=positive,
        help="Gaussian kernel width (default: median heuristic)",
    )
    q.add_argument("--seed", type=int, default=0)


def _upper_bound_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--confidence", type=probability, default=0.95, help="of the MMD^2 upper bound")
    q.add_argument(
        "--method",
        choices=stats.UPPER_BOUND_METHODS,
        default="jackknife",
        help="upper bound: jackknife-normal (default) or percentile bootstrap (conservative "
        "near equal distributions)",
    )
    q.add_argument(
        "--bootstrap", type=count(1), default=1000, help="resamples for --method bootstrap"
    )


def _vector_arguments(q: argparse.ArgumentParser) -> None:
    for name in ("--x", "--y"):
        q.add_argument(
            name, required=True, help="a vector: .npy, a .json list, or a `stats drops --out` file"
        )


def _points(path: str) -> np.ndarray:
    return _call(inputs.load_points, path)


def _vector(path: str) -> np.ndarray:
    return _call(inputs.load_vector, path)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except ValueError as e:
        raise _fail(str(e)) from None


def _stats_binomial(args: argparse.Namespace) -> dict:
    prior = (1.0, 1.0) if args.prior == "uniform" else (0.5, 0.5)
    low, high = _call(stats.clopper_pearson, args.k, args.n, args.confidence)
    one_sided = _call(stats.clopper_pearson_lower, args.k, args.n, args.confidence)
    posterior = _call(stats.beta_posterior_bound, args.k, args.n, args.confidence, prior)
    wilson_low, wilson_high = stats.wilson(args.k, args.n, args.confidence)
    result = {
        "k": args.k,
        "n": args.n,
        "confidence": args.confidence,
        "clopper_pearson": [low, high],
        "clopper_pearson_one_sided_lower": one_sided,
        "wilson": [wilson_low, wilson_high],
        "beta_posterior_lower": posterior,
        "prior": args.prior,
    }
    c = f"{100 * args.confidence:g}%"
    lines = [
        f"{args.k} of {args.n} (share {args.k / args.n:.4f})",
        f"Clopper-Pearson two-sided {c} interval: [{low:.4f}, {high:.4f}]",
        f"Clopper-Pearson one-sided {c} lower bound: {one_sided:.4f}",
        f"Wilson two-sided {c} interval: [{wilson_low:.4f}, {wilson_high:.4f}]",
        f"Beta posterior ({args.prior} prior) {c} lower bound: {posterior:.4f}",
    ]
    return emit(args, result, lines)


def _stats_mcnemar(args: argparse.Namespace) -> dict:
    p = _call(stats.mcnemar_exact, args.only_a, args.only_b)
    result = {"only_a": args.only_a, "only_b": args.only_b, "p_value": p}
    lines = [
        f"{args.only_a} items only A got right, {args.only_b} only B: exact McNemar "
        f"p = {p:.4g} (two-sided)"
    ]
    return emit(args, result, lines)


def _stats_mmd(args: argparse.Namespace) -> dict:
    x, y = _points(args.x), _points(args.y)
    bandwidth = args.bandwidth or _call(stats.median_heuristic_bandwidth, x, y)
    result: dict[str, Any] = {
        "mmd2": _call(stats.mmd2_unbiased, x, y, bandwidth),
        "bandwidth": bandwidth,
        "num_x": len(x),
        "num_y": len(y),
    }
    lines = [f"MMD^2 (unbiased, bandwidth {bandwidth:.6g}): {result['mmd2']:.6g}"]
    if args.permutations > 0:
        _, p_value = _call(
            stats.mmd_permutation_test, x, y, args.permutations, args.seed, bandwidth
        )
        result.update(p_value=p_value, permutations=args.permutations)
        lines.append(f"permutation test p-value ({args.permutations} permutations): {p_value:.6g}")
    bound = _call(
        stats.mmd2_upper_bound,
        x,
        y,
        confidence=args.confidence,
        method=args.method,
        num_bootstrap=args.bootstrap,
        seed=args.seed,
        bandwidth=bandwidth,
    )
    result.update(upper=bound["upper"], confidence=args.confidence, method=args.method)
    lines.append(f"{100 * args.confidence:g}% upper bound ({args.method}): {bound['upper']:.6g}")
    return emit(args, result, lines)


def _stats_equivalence(args: argparse.Namespace) -> dict:
    train, val = _points(args.train), _points(args.val)
    result = _call(
        stats.mmd_equivalence,
        train,
        val,
        num_splits=args.splits,
        quantile=args.quantile,
        confidence=args.confidence,
        method=args.method,
        num_bootstrap=args.bootstrap,
        seed=args.seed,
        bandwidth=args.bandwidth,
    )
    verdict = "equivalent (H0 rejected)" if result["equivalent"] else "not shown equivalent"
    lines = [
        f"MMD^2(train, val): {result['mmd2']:.6g}; {100 * args.confidence:g}% upper bound "
        f"{result['upper']:.6g} ({args.method})",
        f"margin xi: {100 * args.quantile:g}th percentile of {args.splits} within-train splits = "
        f"{result['threshold']:.6g}",
        f"bandwidth {result['bandwidth']:.6g}: {verdict}",
    ]
    return emit(args, result, lines)


def _stats_f_test(args: argparse.Namespace) -> dict:
    x, y = _vector(args.x), _vector(args.y)
    f, p = _call(stats.variance_f_test, x, y, args.alternative)
    result = {"F": f, "df": [len(x) - 1, len(y) - 1], "p_value": p, "alternative": args.alternative}
    lines = [f"F({len(x) - 1}, {len(y) - 1}) = {f:.4f}, p = {p:.4g} ({args.alternative})"]
    return emit(args, result, lines)


def _stats_correlation(args: argparse.Namespace) -> dict:
    x, y = _vector(args.x), _vector(args.y)
    corr = _call(stats.correlation, x, y)
    result = {name: {"r": r, "p_value": p} for name, (r, p) in corr.items()}
    lines = [f"{name}: r = {r:.4f}, p = {p:.4g}" for name, (r, p) in corr.items()]
    return emit(args, result, lines)


def _stats_resampling(args: argparse.Namespace) -> dict:
    samples = _vector(args.samples)
    p = _call(stats.resampling_p_value, args.observed, samples, args.alternative)
    result = {
        "observed": args.observed,
        "p_value": p,
        "num_samples": len(samples),
        "alternative": args.alternative,
    }
    lines = [f"empirical p-value ({args.alternative}, B={len(samples)}): {p:.6g}"]
    return emit(args, result, lines)


def _stats_drops(args: argparse.Namespace) -> dict:
    result = _call(inputs.drops, args.results, args.metric, args.reference, args.shifted)
    if args.out:
        files.write_atomic(pathlib.Path(args.out), json.dumps(result, indent=2) + "\n")
    lines = [
        f"{m}: {args.metric} {args.reference} - {args.shifted} = {d:.4f}"
        for m, d in zip(result["models"], result["drops"])
    ]
    return emit(args, result, lines)


def _stats_clip_conditional(args: argparse.Namespace) -> dict:
    from ood_jax.eval import clip_baseline

    try:
        result = clip_baseline.conditional_accuracy(args.lvlm, args.clip)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    lines = [
        f"items: {result['num_items']}; CLIP accuracy {result['clip_accuracy']:.4f}, "
        f"LVLM accuracy {result['lvlm_accuracy']:.4f}",
        f"LVLM accuracy where CLIP is right: {result['clip_correct']['lvlm_accuracy']:.4f} "
        f"({result['clip_correct']['count']} items)",
        f"LVLM accuracy where CLIP is wrong: {result['clip_wrong']['lvlm_accuracy']:.4f} "
        f"({result['clip_wrong']['count']} items)",
    ]
    return emit(args, result, lines)
