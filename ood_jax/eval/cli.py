"""`ood-jax eval-mllm` (MLLM evaluation, resumable) and FOCI's `ood-jax stats clip-conditional`.

`add_parsers(subparsers)` adds `eval-mllm` to the `ood-jax` parser: a task of ood_jax.eval.tasks,
asked through a client of ood_jax.eval.clients by ood_jax.eval.runner (or answered by
ood_jax.eval.clip_baseline with --clip). `add_stats_parsers(commands)` adds `clip-conditional`
to the checks of `ood-jax stats` (ood_jax.stats.cli), since it reads eval-mllm run directories.
Each subcommand's `run` takes the parsed arguments.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from ood_jax import help_text
from ood_jax.eval import clients, runner, tasks
from ood_jax.stats import cli as stats_cli


def add_parsers(subparsers) -> None:
    _add_eval_mllm(subparsers)


# ---------------------------------------------------------------------------------------------
# eval-mllm
# ---------------------------------------------------------------------------------------------


def _add_eval_mllm(subparsers) -> None:
    p = subparsers.add_parser(
        "eval-mllm",
        help="evaluate an MLLM on foci, counts-oodg, oodbench or oodbench-bap (resumable)",
        description=help_text.fill(
            "Asks a model every item of a benchmark and writes OUTPUT/predictions.jsonl (one line "
            "per item, appended as replies arrive), results.json and results.md. Rerunning into "
            "the same OUTPUT sends only the items still without a reply; Ctrl-C keeps the "
            "replies received. --limit N writes results.limitN.json and results.limitN.md "
            "beside the full results, never over them."
        ),
        epilog=help_text.examples(
            "ood-jax eval-mllm foci --data-dir data/tfds --config food101 \\\n"
            "      --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2-VL-7B-Instruct "
            "--output runs/foci_qwen",
            "ood-jax eval-mllm counts-oodg --items items/items.jsonl --local models/llava "
            "--output runs/oodg --limit 20",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("benchmark", choices=tasks.BENCHMARKS)
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
    p.add_argument("--task", choices=tasks.OODG_TASKS, help="counts-oodg: only this task")
    p.add_argument(
        "--limit",
        type=int,
        help="only the first N items; their results go to OUTPUT/results.limitN.{json,md}",
    )
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
        choices=tasks.PARSE_MODES,
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
        benchmark = tasks.make_benchmark(
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
    except (runner.RunError, tasks.ItemsError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    output = pathlib.Path(args.output)
    json_name, md_name = runner.results_files(results.get("limit"))
    print((output / md_name).read_text())
    if "limit" in results:
        full = output / runner.RESULTS_JSON
        rest = (
            f"{full} (every item) is unchanged"
            if full.exists()
            else f"a run without --limit writes {full}"
        )
        print(
            f"results of the first {results['limit']} items -> {output / json_name}; {rest}",
            file=sys.stderr,
        )
    if not results["complete"]:
        print(
            "some requests failed; rerun the same command to retry them "
            f"(details in {pathlib.Path(args.output) / runner.PREDICTIONS_FILE})",
            file=sys.stderr,
        )
    return results


def _run_clip(args: argparse.Namespace, benchmark: tasks.Benchmark, progress: bool) -> dict:
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
# stats clip-conditional
# ---------------------------------------------------------------------------------------------


def add_stats_parsers(commands) -> None:
    """Adds FOCI's `clip-conditional` to `commands`, what ood_jax.stats.cli.add_parsers returns."""
    q = stats_cli.add_command(
        commands,
        "clip-conditional",
        "FOCI Fig. 4: LVLM accuracy where the CLIP baseline is right and where it is wrong",
        _stats_clip_conditional,
        examples=["ood-jax stats clip-conditional --lvlm runs/foci_qwen --clip runs/foci_clip"],
    )
    q.add_argument("--lvlm", required=True, help="eval-mllm output directory of the LVLM")
    q.add_argument("--clip", required=True, help="eval-mllm --clip output directory")


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
    return stats_cli.emit(args, result, lines)
