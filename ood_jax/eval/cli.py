"""`ood-jax eval-mllm` (MLLM evaluation, resumable) and `ood-jax stats` (OODBench's statistics).

`add_parsers(subparsers)` adds both to the `ood-jax` parser; each subcommand's `run` takes the
parsed arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

import numpy as np

from ood_jax import files, stats
from ood_jax.eval import benchmarks, clients, runner


def add_parsers(subparsers) -> None:
    _add_eval_mllm(subparsers)
    _add_stats(subparsers)


# ---------------------------------------------------------------------------------------------
# eval-mllm
# ---------------------------------------------------------------------------------------------


def _add_eval_mllm(subparsers) -> None:
    p = subparsers.add_parser(
        "eval-mllm",
        help="evaluate an MLLM on foci, counts-oodg, oodbench or oodbench-bap (resumable)",
        description=(
            "Asks a model every item of a benchmark and writes OUTPUT/predictions.jsonl (one line "
            "per item, appended as replies arrive), results.json and results.md. Rerunning into "
            "the same OUTPUT sends only the items still without a reply."
        ),
    )
    p.add_argument("benchmark", choices=benchmarks.BENCHMARKS)
    p.add_argument("--data-dir", help="TFDS data directory holding the built benchmark")
    p.add_argument(
        "--config",
        help="builder config: foci dataset(s), comma-separated (default: every built one); "
        "oodbench: default / bap",
    )
    p.add_argument("--items", help="counts-oodg: the items.jsonl written by `ood-jax mine oodg`")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    model.add_argument("--local", metavar="PATH", help="a local transformers LVLM directory")
    model.add_argument(
        "--clip", metavar="PATH", help="CLIP/SigLIP baseline: a scorer directory (from_hf)"
    )
    p.add_argument("--model", help="model name sent to the endpoint (required with --endpoint)")
    p.add_argument("--output", required=True, help="run directory (predictions and results)")
    p.add_argument(
        "--setting",
        help="oodbench: plain or cot; counts-oodg: zero_shot, iid, covariate_shift, label_shift "
        "or spurious_correlation (default: all in the items file)",
    )
    p.add_argument(
        "--ice", type=int, help="counts-oodg: only items with this many in-context examples"
    )
    p.add_argument("--task", choices=benchmarks.OODG_TASKS, help="counts-oodg: only this task")
    p.add_argument("--limit", type=int, help="only the first N items")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="generation budget (default: foci 10 as FOCI, oodbench 16, cot 512, bap 32, "
        "counts-oodg 512)",
    )
    p.add_argument(
        "--api-key-env",
        default=clients.DEFAULT_API_KEY_ENV,
        help="environment variable holding the API key (default OPENAI_API_KEY); unset: no key",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")
    p.add_argument("--max-attempts", type=int, default=6, help="HTTP attempts per item")
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="first retry wait in seconds, doubling per attempt up to 60 s (default 1)",
    )
    p.add_argument(
        "--parse-mode",
        choices=benchmarks.PARSE_MODES,
        default="foci",
        help="foci: FOCI's rule (the reply begins with the letter, default) or strict",
    )
    p.add_argument(
        "--templates",
        nargs="+",
        help="--clip: text templates with {} for the option (default: 'a photo of a {}.')",
    )
    p.add_argument("--batch-size", type=int, default=64, help="--clip: images per batch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run_eval_mllm)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


def _check_eval_arguments(args: argparse.Namespace) -> None:
    if args.endpoint and not args.model:
        raise _fail("--endpoint needs --model (the name the server knows the model by)")
    if args.templates and not args.clip:
        raise _fail("--templates applies to --clip only")
    for flag, value, least in (
        ("--concurrency", args.concurrency, 1),
        ("--limit", args.limit, 0),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-attempts", args.max_attempts, 1),
        ("--batch-size", args.batch_size, 1),
    ):
        if value is not None and value < least:
            raise _fail(f"{flag} must be at least {least}, got {value}")


def _make_client(args: argparse.Namespace, max_tokens: int):
    if args.local:
        return clients.TransformersClient(args.local, max_new_tokens=max_tokens)
    try:
        client = clients.OpenAIChatClient(
            args.endpoint,
            args.model,
            max_tokens=max_tokens,
            api_key_env=args.api_key_env,
            timeout_s=args.timeout,
            max_attempts=args.max_attempts,
            backoff_base_s=args.backoff,
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    if not client.has_api_key:
        print(f"note: ${args.api_key_env} is not set; sending no API key", file=sys.stderr)
    return client


def run_eval_mllm(args: argparse.Namespace) -> dict:
    _check_eval_arguments(args)
    try:
        benchmark = benchmarks.make_benchmark(
            args.benchmark,
            data_dir=args.data_dir,
            config=args.config,
            items=args.items,
            setting=args.setting,
            ice=args.ice,
            task=args.task,
            parse_mode=args.parse_mode,
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    progress = not args.no_progress
    try:
        if args.clip:
            results = _run_clip(args, benchmark, progress)
        else:
            client = _make_client(args, args.max_tokens or benchmark.default_max_tokens)
            results = runner.run(
                benchmark,
                client,
                args.output,
                concurrency=args.concurrency,
                limit=args.limit,
                progress=progress,
            )
    except (runner.RunError, benchmarks.ItemsError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    print((pathlib.Path(args.output) / runner.RESULTS_MD).read_text())
    if not results["complete"]:
        print(
            "some requests failed; rerun the same command to retry them "
            f"(details in {pathlib.Path(args.output) / runner.PREDICTIONS_FILE})",
            file=sys.stderr,
        )
    return results


def _run_clip(args: argparse.Namespace, benchmark: benchmarks.Benchmark, progress: bool) -> dict:
    from ood_jax.eval import clip_baseline

    try:
        from ood_jax.scorers import from_hf
    except ImportError as e:
        raise _fail(f"the CLIP baseline needs ood_jax.scorers ({e})") from None
    scorer = from_hf(args.clip)
    return clip_baseline.run_clip_baseline(
        benchmark,
        scorer,
        args.output,
        scorer_name=args.model or str(pathlib.Path(args.clip).resolve()),
        templates=tuple(args.templates or clip_baseline.DEFAULT_TEMPLATES),
        batch_size=args.batch_size,
        limit=args.limit,
        progress=progress,
    )


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------


def _add_stats(subparsers) -> None:
    p = subparsers.add_parser(
        "stats",
        help="OODBench's statistical checks from result and embedding files",
        description=(
            "The checks behind OODBench's claim that its data is OOD: binomial bounds on the "
            "share of models that see it as OOD, MMD equivalence of train-OOD and val-OOD, and "
            "the Hard-vs-OOD variance, correlation and resampling tests on accuracy drops."
        ),
    )
    sub = p.add_subparsers(dest="stats_command", required=True)

    def command(name: str, help: str, run) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help, description=help)
        q.add_argument("--json", action="store_true", help="print the numbers as JSON")
        q.set_defaults(run=run)
        return q

    q = command(
        "clopper-pearson",
        "exact binomial interval and Beta-posterior lower bound for K of N (e.g. 49 of 50 "
        "models treat the data as OOD)",
        _stats_binomial,
    )
    q.add_argument("k", type=int)
    q.add_argument("n", type=int)
    q.add_argument("--confidence", type=float, default=0.95)
    q.add_argument("--prior", choices=("uniform", "jeffreys"), default="uniform")

    q = command("mmd", "unbiased Gaussian-kernel MMD^2 between two point sets (.npy)", _stats_mmd)
    _points_arguments(q, "--x", "--y")
    q.add_argument(
        "--permutations", type=int, default=1000, help="permutation test draws (0: none)"
    )
    _upper_bound_arguments(q)

    q = command(
        "equivalence",
        "MMD equivalence of train-OOD and val-OOD: the upper confidence bound of MMD^2 below the "
        "95th percentile of within-train split MMD^2",
        _stats_equivalence,
    )
    _points_arguments(q, "--train", "--val")
    q.add_argument("--splits", type=int, default=100, help="random splits of train for the margin")
    q.add_argument("--quantile", type=float, default=0.95, help="margin quantile")
    _upper_bound_arguments(q)

    q = command(
        "f-test",
        "variance F-test of two drop vectors: F = var(x) / var(y) (paper: x = Hard, y = OOD, "
        "alternative greater)",
        _stats_f_test,
    )
    _vector_arguments(q)
    q.add_argument("--alternative", choices=("greater", "less", "two-sided"), default="greater")

    q = command(
        "correlation", "Pearson and Spearman correlation of two drop vectors", _stats_correlation
    )
    _vector_arguments(q)

    q = command(
        "resampling",
        "empirical p-value of an observed statistic against resampled baseline values",
        _stats_resampling,
    )
    q.add_argument("--observed", type=float, required=True)
    q.add_argument("--samples", required=True, help="baseline values (.npy or .json list)")
    q.add_argument("--alternative", choices=("greater", "less", "two-sided"), default="less")

    q = command(
        "drops",
        "per-model drops (reference split minus shifted split) from eval-mllm results.json files",
        _stats_drops,
    )
    q.add_argument("--results", nargs="+", required=True, help="one results.json per model")
    q.add_argument("--metric", default="accuracy", help="accuracy, precision, recall, f1, mcc, ...")
    q.add_argument("--reference", default="id", help="split of the reference numbers (default id)")
    q.add_argument(
        "--shifted", default="ood_h", help="split of the shifted numbers (default ood_h)"
    )
    q.add_argument("--out", help="also write {models, drops} here (input to f-test/correlation)")

    q = command(
        "clip-conditional",
        "FOCI Fig. 4: LVLM accuracy where the CLIP baseline is right and where it is wrong",
        _stats_clip_conditional,
    )
    q.add_argument("--lvlm", required=True, help="eval-mllm output directory of the LVLM")
    q.add_argument("--clip", required=True, help="eval-mllm --clip output directory")


def _points_arguments(q: argparse.ArgumentParser, first: str, second: str) -> None:
    q.add_argument(first, required=True, help="points [N, D] (.npy)")
    q.add_argument(second, required=True, help="points [M, D] (.npy)")
    q.add_argument(
        "--bandwidth", type=float, help="Gaussian kernel width (default: median heuristic)"
    )
    q.add_argument("--seed", type=int, default=0)


def _upper_bound_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--confidence", type=float, default=0.95, help="of the MMD^2 upper bound")
    q.add_argument(
        "--method",
        choices=stats.UPPER_BOUND_METHODS,
        default="jackknife",
        help="upper bound: jackknife-normal (default) or percentile bootstrap (conservative "
        "near equal distributions)",
    )
    q.add_argument("--bootstrap", type=int, default=1000, help="resamples for --method bootstrap")


def _vector_arguments(q: argparse.ArgumentParser) -> None:
    for name in ("--x", "--y"):
        q.add_argument(
            name, required=True, help="a vector: .npy, a .json list, or a `stats drops --out` file"
        )


def _load_points(path: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise _fail(f"{path}: file not found") from None
    except ValueError as e:
        raise _fail(f"{path}: not a .npy array ({e})") from None
    if array.ndim not in (1, 2):
        raise _fail(f"{path}: expected points [N, D], got shape {array.shape}")
    return array


def _load_vector(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        values = _load_points(path)
    else:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except FileNotFoundError:
            raise _fail(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise _fail(f"{path}: not valid JSON ({e.msg})") from None
        if isinstance(data, dict):
            if "drops" not in data:
                raise _fail(f"{path}: a JSON object needs a 'drops' list")
            data = data["drops"]
        values = np.asarray(data, dtype=np.float64) if isinstance(data, list) else None
        if values is None:
            raise _fail(f"{path}: expected a list of numbers")
    if values.ndim != 1:
        raise _fail(f"{path}: expected a vector, got shape {values.shape}")
    return values.astype(np.float64)


def _emit(args: argparse.Namespace, result: dict, lines: list[str]) -> dict:
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines))
    return result


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
    result = {
        "k": args.k,
        "n": args.n,
        "confidence": args.confidence,
        "clopper_pearson": [low, high],
        "clopper_pearson_one_sided_lower": one_sided,
        "beta_posterior_lower": posterior,
        "prior": args.prior,
    }
    c = f"{100 * args.confidence:g}%"
    lines = [
        f"{args.k} of {args.n} (share {args.k / args.n:.4f})",
        f"Clopper-Pearson two-sided {c} interval: [{low:.4f}, {high:.4f}]",
        f"Clopper-Pearson one-sided {c} lower bound: {one_sided:.4f}",
        f"Beta posterior ({args.prior} prior) {c} lower bound: {posterior:.4f}",
    ]
    return _emit(args, result, lines)


def _stats_mmd(args: argparse.Namespace) -> dict:
    x, y = _load_points(args.x), _load_points(args.y)
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
    return _emit(args, result, lines)


def _stats_equivalence(args: argparse.Namespace) -> dict:
    train, val = _load_points(args.train), _load_points(args.val)
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
    return _emit(args, result, lines)


def _stats_f_test(args: argparse.Namespace) -> dict:
    x, y = _load_vector(args.x), _load_vector(args.y)
    f, p = _call(stats.variance_f_test, x, y, args.alternative)
    result = {"F": f, "df": [len(x) - 1, len(y) - 1], "p_value": p, "alternative": args.alternative}
    lines = [f"F({len(x) - 1}, {len(y) - 1}) = {f:.4f}, p = {p:.4g} ({args.alternative})"]
    return _emit(args, result, lines)


def _stats_correlation(args: argparse.Namespace) -> dict:
    x, y = _load_vector(args.x), _load_vector(args.y)
    corr = _call(stats.correlation, x, y)
    result = {name: {"r": r, "p_value": p} for name, (r, p) in corr.items()}
    lines = [f"{name}: r = {r:.4f}, p = {p:.4g}" for name, (r, p) in corr.items()]
    return _emit(args, result, lines)


def _stats_resampling(args: argparse.Namespace) -> dict:
    samples = _load_vector(args.samples)
    p = _call(stats.resampling_p_value, args.observed, samples, args.alternative)
    result = {
        "observed": args.observed,
        "p_value": p,
        "num_samples": len(samples),
        "alternative": args.alternative,
    }
    lines = [f"empirical p-value ({args.alternative}, B={len(samples)}): {p:.6g}"]
    return _emit(args, result, lines)


def _split_metric(path: str, split: str, metric: str) -> float:
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise _fail(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise _fail(f"{path}: not valid JSON ({e.msg})") from None
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, dict):
        raise _fail(f"{path}: no 'splits' (an eval-mllm oodbench or oodbench-bap results.json)")
    if split not in splits:
        raise _fail(f"{path}: no split {split!r} (has {', '.join(splits)})")
    value = splits[split].get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise _fail(f"{path}: split {split!r} has no number {metric!r}")
    return float(value)


def _stats_drops(args: argparse.Namespace) -> dict:
    drops, models = [], []
    for path in args.results:
        reference = _split_metric(path, args.reference, args.metric)
        shifted = _split_metric(path, args.shifted, args.metric)
        drops.append(reference - shifted)
        data = json.loads(pathlib.Path(path).read_text())
        models.append(data.get("model", path))
    result = {
        "models": models,
        "metric": args.metric,
        "reference": args.reference,
        "shifted": args.shifted,
        "drops": drops,
    }
    if args.out:
        files.write_atomic(pathlib.Path(args.out), json.dumps(result, indent=2) + "\n")
    lines = [
        f"{m}: {args.metric} {args.reference} - {args.shifted} = {d:.4f}"
        for m, d in zip(models, drops)
    ]
    return _emit(args, result, lines)


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
    return _emit(args, result, lines)
